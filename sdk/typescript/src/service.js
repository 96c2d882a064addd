// A service: a name, the kinds it serves, and the secret agentq signs with; the step protocol
// (docs/protocol.md) over `GET /agentq/manifest` and signed `POST /agentq/invoke`, served by
// Node's http module (`listen`, `nodeHandler`) or a fetch-style framework (`fetch`). Nothing
// here logs a request, an answer or a header.
import { createServer } from "node:http";

import { Context, NonRetryable, errorText, jsonable } from "./context.js";
import { Refused, parseSecrets, signHeaders, verify } from "./signing.js";

export const PROTOCOL = 1;
export const MANIFEST_PATH = "/agentq/manifest";
export const INVOKE_PATH = "/agentq/invoke";
export const MAX_REQUEST_BYTES = 64 << 20;
export const MAX_ANSWER_BYTES = 4 << 20;
const NAME = /^[A-Za-z0-9_.-]{1,64}$/;

class BadRequest extends Error {}

function problem(status, title, detail) {
  const body = Buffer.from(JSON.stringify({ type: "about:blank", title, status, detail }));
  return {
    status,
    headers: { "content-type": "application/problem+json", "content-length": String(body.length) },
    body,
  };
}

/** The journals (and inputs) of recent sessions, least recently used dropped first. */
class Sessions {
  constructor(capacity) {
    this.capacity = Math.max(1, capacity);
    this.items = new Map();
  }

  get(id) {
    const item = this.items.get(id);
    if (item !== undefined) {
      this.items.delete(id);
      this.items.set(id, item);
    }
    return item;
  }

  put(id, input, journal) {
    this.items.delete(id);
    this.items.set(id, { input, journal });
    while (this.items.size > this.capacity) this.items.delete(this.items.keys().next().value);
  }

  drop(id) {
    this.items.delete(id);
  }
}

function checkRequest(req) {
  if (req === null || typeof req !== "object" || Array.isArray(req)) throw new BadRequest("a step protocol request is a JSON object");
  if (req.protocol !== PROTOCOL) throw new BadRequest(`this SDK speaks step protocol ${PROTOCOL}, the request says ${JSON.stringify(req.protocol)}`);
  const op = req.operation;
  if (!op || typeof op.kind !== "string" || typeof op.version !== "string") throw new BadRequest("operation: an object with kind and version is required");
  if (typeof req.session !== "string" || !req.session) throw new BadRequest("session: a string is required");
  const j = req.journal;
  if (!j || typeof j !== "object") throw new BadRequest("journal: an object with base and entries is required");
  if (!Number.isInteger(j.base) || j.base < 0) throw new BadRequest("journal.base: a non-negative integer is required");
  if (j.entries === undefined || j.entries === null) j.entries = [];
  if (!Array.isArray(j.entries)) throw new BadRequest("journal.entries: an array is required");
  j.entries.forEach((e, i) => {
    if (e === null || typeof e !== "object") throw new BadRequest(`journal.entries[${i}]: an object is required`);
    if (e.seq !== undefined && e.seq !== null && e.seq !== j.base + i) {
      throw new BadRequest(`journal.entries[${i}].seq is ${e.seq}, but its position is ${j.base + i}`);
    }
  });
  for (const d of ["run", "reconcile"]) {
    const v = req[d];
    if (v !== undefined && v !== null && (typeof v !== "object" || !Number.isInteger(v.seq) || v.key === undefined || v.key === null)) {
      throw new BadRequest(`${d}: null or an object with seq and key`);
    }
  }
  return req;
}

/** The answer's JSON bytes; one over 4 MiB becomes an error answer saying so. */
export function encodeAnswer(answer) {
  let data;
  try {
    data = Buffer.from(JSON.stringify(answer));
  } catch (e) {
    data = Buffer.from(JSON.stringify({ type: "error", class: "non_retryable", message: `the answer is not JSON: ${errorText(e)}` }));
  }
  if (data.length <= MAX_ANSWER_BYTES) return data;
  const msg = `the ${answer.type} answer is ${data.length} bytes; an answer carries at most 4 MiB (keep large data outside the journal and pass references)`;
  const small = answer.type === "step"
    ? { type: "step", seq: answer.seq, name: answer.name, error: { message: `step ${answer.name}: ${msg}`, retryable: false, no_effect: false } }
    : { type: "error", class: "non_retryable", message: msg };
  return Buffer.from(JSON.stringify(small));
}

export class Service {
  #kinds = new Map();
  #secrets;

  /** `secret`: the `whsec_…` secret `agentq services add` printed (usually
   * `process.env.AGENTQ_SERVICE_SECRET`); several, space separated, are all accepted and
   * answers are signed with the first. Without one, every invoke is refused (401). */
  constructor(name, { secret = undefined, maxSessions = 1024 } = {}) {
    if (typeof name !== "string" || !NAME.test(name)) {
      throw new Error(`a service name is 1-64 letters, digits, '_', '-', '.': ${JSON.stringify(name)}`);
    }
    this.name = name;
    this.#secrets = parseSecrets(secret);
    this.sessions = new Sessions(maxSessions);
  }

  /** Serves `fn(ctx, input)` as `version` of the kind `name`. `inputSchema` (a JSON Schema)
   * is what agentq checks every input against before anything is written; `parse(input)`,
   * if given, turns the JSON into what `fn` takes (throwing when it does not fit). */
  kind(name, { version = "1", description = "", inputSchema = {}, parse = null } = {}, fn) {
    for (const [what, v] of [["kind", name], ["version", version]]) {
      if (typeof v !== "string" || !NAME.test(v)) throw new Error(`a ${what} is 1-64 letters, digits, '_', '-', '.': ${JSON.stringify(v)}`);
    }
    if (typeof fn !== "function") throw new TypeError(`kind ${name}: a function (ctx, input) => output is required`);
    const key = `${name}\u0000${version}`;
    if (this.#kinds.has(key)) throw new Error(`kind ${name} version ${version} is registered twice`);
    this.#kinds.set(key, { name, version, description, inputSchema, parse, fn });
    return this;
  }

  manifest() {
    return {
      protocol: PROTOCOL,
      service: this.name,
      kinds: [...this.#kinds.values()].map((k) => ({
        name: k.name,
        version: k.version,
        ...(k.description ? { description: k.description } : {}),
        input_schema: k.inputSchema,
      })),
      tools: [],
    };
  }

  /** Answers one step protocol request (already verified). `dry`: stop at the first open
   * position and run nothing (a journal replay). */
  async invoke(request, { dry = false } = {}) {
    const req = checkRequest(request);
    const { operation: op, session } = req;
    const { base, entries } = req.journal;
    let input;
    let full;
    if (base === 0) {
      input = req.input;
      if (input === undefined || input === null) input = this.sessions.get(session)?.input ?? null;
      full = [...entries];
    } else {
      const cached = this.sessions.get(session);
      if (cached === undefined || cached.journal.length < base) return { type: "resend" };
      input = cached.input;
      full = cached.journal.slice(0, base).concat(entries);
    }
    this.sessions.put(session, input, full);
    const kind = this.#kinds.get(`${op.kind}\u0000${op.version}`);
    if (kind === undefined) {
      const served = [...this.#kinds.values()].map((k) => `${k.name} ${k.version}`).join(", ") || "nothing";
      return {
        type: "error",
        class: "non_retryable",
        message: `service ${JSON.stringify(this.name)} does not serve kind ${JSON.stringify(op.kind)} version ${JSON.stringify(op.version)} (it serves: ${served})`,
      };
    }
    const info = {
      id: String(op.id ?? ""),
      kind: op.kind,
      version: op.version,
      tenant: String(op.tenant ?? ""),
      attempt: Number(op.attempt) || 1,
      session,
    };
    const ctx = new Context(info, full, { run: req.run ?? null, reconcile: req.reconcile ?? null, dry });
    return runKind(kind, ctx, input);
  }

  /** One HTTP exchange (`headers` with lower-case names, `body` a Buffer). */
  async handle(method, path, headers, body) {
    path = path.split("?", 1)[0];
    if (path === MANIFEST_PATH) {
      if (method !== "GET" && method !== "HEAD") return problem(405, "Method Not Allowed", "GET /agentq/manifest");
      const data = Buffer.from(JSON.stringify(this.manifest()));
      return { status: 200, headers: { "content-type": "application/json", "content-length": String(data.length) }, body: data };
    }
    if (path !== INVOKE_PATH) return problem(404, "Not Found", "this service answers GET /agentq/manifest and POST /agentq/invoke");
    if (method !== "POST") return problem(405, "Method Not Allowed", "POST /agentq/invoke");
    if (body.length > MAX_REQUEST_BYTES) return problem(413, "Payload Too Large", "a request may carry at most 64 MiB");
    if (this.#secrets.length === 0) {
      return problem(401, "Unauthorized", "this service has no secret: AGENTQ_SERVICE_SECRET is not set (start it with the secret `agentq services add` printed)");
    }
    const id = headers["webhook-id"];
    try {
      verify(this.#secrets, id, headers["webhook-timestamp"], headers["webhook-signature"], body);
    } catch (e) {
      if (e instanceof Refused) return problem(401, "Unauthorized", `the request's signature does not verify: ${e.message}`);
      throw e;
    }
    let request;
    try {
      request = JSON.parse(body.toString("utf8"));
    } catch (e) {
      return problem(400, "Bad Request", `the body is not JSON: ${e.message}`);
    }
    let answer;
    try {
      answer = await this.invoke(request);
    } catch (e) {
      if (e instanceof BadRequest) return problem(400, "Bad Request", e.message);
      throw e;
    }
    const data = encodeAnswer(answer);
    return {
      status: 200,
      headers: { "content-type": "application/json", "content-length": String(data.length), ...signHeaders(this.#secrets[0], String(id), data) },
      body: data,
    };
  }

  /** A handler for Node's `http.createServer`. */
  nodeHandler() {
    return (req, res) => {
      const chunks = [];
      let size = 0;
      let tooBig = false;
      req.on("data", (c) => {
        size += c.length;
        if (size > MAX_REQUEST_BYTES) tooBig = true;
        else chunks.push(c);
      });
      req.on("end", async () => {
        let out;
        try {
          out = tooBig
            ? problem(413, "Payload Too Large", "a request may carry at most 64 MiB")
            : await this.handle(req.method, req.url || "/", lowerHeaders(req.headers), Buffer.concat(chunks));
        } catch (e) {
          out = problem(500, "Internal Server Error", e instanceof Error ? e.name : "Error");
        }
        res.writeHead(out.status, out.headers);
        res.end(req.method === "HEAD" ? undefined : out.body);
      });
    };
  }

  /** A handler for fetch-style frameworks (`(Request) => Promise<Response>`). */
  async fetch(request) {
    const url = new URL(request.url);
    const headers = {};
    request.headers.forEach((v, k) => {
      headers[k.toLowerCase()] = v;
    });
    const body = Buffer.from(await request.arrayBuffer());
    const out = await this.handle(request.method, url.pathname, headers, body);
    return new Response(request.method === "HEAD" ? null : out.body, { status: out.status, headers: out.headers });
  }

  /** Listens on `host:port` (port 0: any free one); resolves with the server once it accepts
   * connections. */
  listen(port = 8000, host = "127.0.0.1") {
    if (this.#secrets.length === 0) {
      process.stderr.write("agentq: AGENTQ_SERVICE_SECRET is not set: every invoke will be refused (401)\n");
    }
    const server = createServer({ keepAliveTimeout: 75_000 }, this.nodeHandler());
    return new Promise((resolve) => {
      server.listen(port, host, () => {
        const a = server.address();
        process.stdout.write(`agentq service ${this.name} listening on http://${a.address}:${a.port}\n`);
        resolve(server);
      });
    });
  }
}

function lowerHeaders(h) {
  const out = {};
  for (const [k, v] of Object.entries(h)) out[k.toLowerCase()] = Array.isArray(v) ? v.join(", ") : v;
  return out;
}

async function runKind(kind, ctx, input) {
  let value = input;
  if (kind.parse) {
    try {
      value = await kind.parse(input);
    } catch (e) {
      return { type: "error", class: "non_retryable", message: `the input does not fit kind ${kind.name} version ${kind.version}: ${errorText(e)}` };
    }
  }
  const done = (async () => {
    try {
      return { output: await kind.fn(ctx, value) };
    } catch (e) {
      return { error: e };
    }
  })();
  const result = await Promise.race([done, ctx.halted.then((answer) => ({ halted: answer }))]);
  if (ctx.answer !== null) return ctx.answer;
  if (result.error !== undefined) {
    const e = result.error;
    if (e instanceof NonRetryable) return { type: "error", class: "non_retryable", message: e.message || "NonRetryable" };
    return { type: "error", class: "retryable", message: errorText(e) };
  }
  try {
    return { type: "output", output: jsonable(result.output) };
  } catch (e) {
    return { type: "error", class: "non_retryable", message: `the output of kind ${kind.name} is not JSON: ${errorText(e)}` };
  }
}
