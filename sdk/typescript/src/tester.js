// The replay tester: checks a kind against every crash it can meet, in memory (the Python
// SDK's `agentq.testing.Tester`, with the same checks as agentq's Rust tester).
//
// `run()` plays agentq's worker through the step protocol (the service's `invoke`, signing
// bypassed): it runs the kind to its end against a scripted model, scripted signals and child
// outcomes, journaling every answer as agentq would, and records every durable write and every
// unsafe effect. Then it crashes the run at every one of those points (including right after an
// unsafe step's function ran and before its output was journaled). Each crash point is an
// operation of its own, with a new id (so idempotency keys of its own): the tester runs it for
// real up to the crash point, drops everything durable after it, then resumes it with a new
// session from what the crash left. A stand-in of the outside system that keeps effects by key
// therefore holds only that timeline's, and what a reconcile answers is checked against it.
// Problems: nondeterminism, an unsafe function run again for one key, no reconcile for an
// interrupted unsafe step, a wrong reconcile, a run that ended otherwise than the first (or a
// first run that failed). It cannot see an effect made outside a step.
import { randomUUID } from "node:crypto";

export const Check = Object.freeze({
  NONDETERMINISM: "nondeterminism",
  RAN_AGAIN: "ran again",
  NO_RECONCILE: "no reconcile",
  WRONG_RECONCILE: "wrong reconcile",
  FAILED: "failed",
});

const ATTEMPTS = 5;
const MAX_PARKS = 1000;
const MAX_REQUESTS = 200_000;

const clone = (v) => (v === undefined ? undefined : structuredClone(v));
const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
const key = (opId, seq, name) => `${opId}/${seq}/${name}`;
const succeeded = (output) => ({ status: "succeeded", output });
const failed = (errorClass, message) => ({ status: "failed", errorClass, message });
const className = (end) => (end.status === "succeeded" ? "succeeded" : String(end.errorClass));
const describe = (end) => (end.status === "succeeded" ? "succeeded" : `failed (${end.errorClass}: ${end.message})`);

function response(r) {
  const out = typeof r === "string" ? { content: r } : { ...r };
  return { content: "", model: "replay-tester", finish_reason: "stop", usage: { prompt_tokens: 0, completion_tokens: 0 }, ...out };
}

function echo(request) {
  let content = "";
  for (const m of request.messages ?? []) {
    if (m && m.role === "user") content = typeof m.content === "string" ? m.content : JSON.stringify(m.content);
  }
  return response(content);
}

function nameKind(answer) {
  switch (answer.type) {
    case "step":
    case "unsafe":
      return [String(answer.name), "custom"];
    case "model":
      return [String(answer.name), "model"];
    case "sleep":
      return ["sleep", "sleep"];
    case "signal":
      return [`signal:${answer.name}`, "signal"];
    case "spawn":
      return [`spawn:${answer.kind}`, "spawn"];
    case "join":
      return ["join", "join"];
    case "now":
      return ["now", "now"];
    case "uuid":
      return ["uuid", "now"];
    case "patch":
      return [String(answer.name), "patch"];
    default:
      return null;
  }
}

const completed = (journal) => journal.filter((e) => e.status === "completed").map((e) => [e.seq, e.name, e.kind]);

/** What `Tester.run` found. */
export class Report {
  constructor(outcome, steps) {
    this.outcome = outcome;
    this.steps = steps;
    this.crashPoints = 0;
    this.violations = [];
  }

  note(v) {
    if (!this.violations.some((o) => o.check === v.check && o.seq === v.seq && o.step === v.step)) this.violations.push(v);
  }

  /** The first run's output (undefined unless it succeeded). */
  get output() {
    return this.outcome.status === "succeeded" ? this.outcome.output : undefined;
  }

  /** Nothing went wrong: no problem found, and the first run did not fail. */
  get ok() {
    return this.violations.length === 0 && this.outcome.status !== "failed";
  }

  found(check) {
    return this.violations.filter((v) => v.check === check);
  }

  /** Throws with the report unless nothing went wrong (a failed run throws too). */
  assertOk() {
    if (!this.ok) throw new Error(String(this));
  }

  toString() {
    const n = this.violations.length;
    const lines = [`replay tester: ${this.steps.length} steps, ${describe(this.outcome)}, ${this.crashPoints} crash points replayed, ${n} ${n === 1 ? "problem" : "problems"}`];
    for (const v of this.violations) {
      lines.push(v.seq === null ? `  [${v.check}] at ${v.at}: ${v.message}` : `  [${v.check}] step ${v.seq} (${v.step}) at ${v.at}: ${v.message}`);
    }
    return lines.join("\n");
  }
}

/** One run's journal, the effects that happened (by key), and what it saw. */
class Memory {
  constructor(journal, happened, { record, crashAfter = null, checkReconciles = true, unsure = new Set() }) {
    this.journal = journal;
    this.happened = happened;
    this.record = record;
    this.crashAfter = crashAfter;
    this.crashed = crashAfter === 0;
    this.checkReconciles = checkReconciles;
    this.unsure = new Set(unsure);
    this.timeline = [];
    this.violations = [];
  }

  crashIfDue() {
    if (this.crashAfter !== null && this.timeline.length >= this.crashAfter) this.crashed = true;
  }

  write(seq, entry) {
    if (this.crashed) return;
    this.journal.splice(seq, this.journal.length - seq, { ...entry, seq });
    if (this.record) {
      this.timeline.push(["durable", clone(this.journal), null, `after step ${seq} (${entry.name}) was written ${entry.status}`]);
      this.crashIfDue();
    }
  }

  effect(k, seq, step, output) {
    if (this.crashed) return;
    if (Object.hasOwn(this.happened, k)) {
      this.violations.push({ check: Check.RAN_AGAIN, seq, step, at: "", message: "the unsafe step's function ran again for the same idempotency key after a crash: its effect would happen twice (its reconcile must say the effect happened when it did)" });
    }
    this.happened[k] = output;
    if (this.record) {
      this.timeline.push(["effect", k, output, `after the effect of ${step}, before its journal write`]);
      this.crashIfDue();
    }
  }

  unknown(k) {
    if (!this.crashed) this.unsure.add(k);
  }

  reconciled(k, seq, step, output) {
    if (this.record || !this.checkReconciles) return;
    let message;
    if (!Object.hasOwn(this.happened, k)) {
      if (this.unsure.has(k)) return;
      message = "its reconcile answered that the effect happened, but in this timeline the crash came before it: the step would be recorded as done and the effect never made (a reconcile must look the effect up by the idempotency key)";
    } else if (!same(output, this.happened[k])) {
      message = `its reconcile answered with another output than the effect's: ${JSON.stringify(output)} where the effect returned ${JSON.stringify(this.happened[k])}`;
    } else {
      return;
    }
    this.violations.push({ check: Check.WRONG_RECONCILE, seq, step, at: "", message });
  }

  left() {
    return [clone(this.journal), clone(this.happened), new Set(this.unsure)];
  }

  firstOpen() {
    const i = this.journal.findIndex((e) => e.status !== "completed");
    return i < 0 ? this.journal.length : i;
  }
}

function crashPoints(timeline) {
  const points = [[[], {}, 0, "before the first step"]];
  let journal = [];
  let happened = {};
  timeline.forEach(([what, a, b, after], n) => {
    if (what === "durable") journal = a;
    else happened = { ...happened, [a]: b };
    const last = points.at(-1);
    if (same(last[0], journal) && same(last[1], happened)) return;
    points.push([journal, happened, n + 1, after]);
  });
  return points;
}

function childOutcome(end, opId, kind) {
  const out = { op_id: opId, kind, status: end.status };
  if (end.status === "succeeded") out.result = end.result ?? null;
  if (end.errorClass !== undefined) out.error_class = end.errorClass;
  if (end.errorMessage !== undefined) out.error_message = end.errorMessage;
  return out;
}

/** Runs `kind` of `service` with `input`, then every crash point of that run (see above). */
export class Tester {
  constructor(service, kind, input = null, { version = undefined, tenant = "test" } = {}) {
    this.service = service;
    this.kind = kind;
    this.input = input;
    this.version_ = version;
    this.tenant = tenant;
    this.model_ = (req) => echo(req);
    this.signals = {};
    this.childEnds = [];
    this.childrenFn = null;
  }

  /** Tests that version of the kind (default: the newest the service serves). */
  version(v) {
    this.version_ = String(v);
    return this;
  }

  /** What the model answers: `replies` in order (the n-th model step gets the n-th; past the
   * end, the last; each a response or a content string), or `fn(request, n)`. Default: it
   * echoes the last user message. */
  model({ replies = null, fn = null } = {}) {
    if (fn) this.model_ = (req, n) => response(fn(req, n));
    else if (replies) {
      if (replies.length === 0) throw new Error("model({ replies: [] }) needs at least one reply");
      const rs = replies.map(response);
      this.model_ = (_req, n) => clone(rs[Math.min(n, rs.length - 1)]);
    }
    return this;
  }

  /** The waits on `name` get these signals in order; a wait with none left times out. */
  signal(name, payload = null, sentBy = "tester") {
    (this.signals[name] ??= []).push({ payload, sent_by: sentBy });
    return this;
  }

  /** `agentq approve`: the signal `approval` with `{ approved: true, … }`. */
  approve(by = "tester", reason = null) {
    return this.signal("approval", { approved: true, by, reason }, by);
  }

  /** `agentq reject`: the signal `approval` with `{ approved: false, … }`. */
  reject(by = "tester", reason = null) {
    return this.signal("approval", { approved: false, by, reason }, by);
  }

  /** How the next spawned child ends: `{ status: "succeeded", result }` or `{ status: "dead",
   * errorClass, errorMessage }`; past the list, `children(fn)` decides, else they succeed. */
  child(end) {
    this.childEnds.push(end);
    return this;
  }

  children(fn) {
    this.childrenFn = fn;
    return this;
  }

  async run() {
    const versions = this.service
      .manifest()
      .kinds.filter((k) => k.name === this.kind)
      .map((k) => k.version)
      .sort((a, b) => a.localeCompare(b, undefined, { numeric: true }));
    const broken = (why) => {
      const r = new Report(failed("tester", why), []);
      r.note({ check: Check.FAILED, seq: null, step: "", at: "the start", message: why });
      return r;
    };
    if (versions.length === 0) return broken(`kind ${this.kind} is not served by service ${this.service.name}`);
    const version = this.version_ ?? versions.at(-1);
    if (!versions.includes(version)) return broken(`kind ${this.kind} has no version ${version} (it has ${versions.join(", ")})`);
    const opId = randomUUID();
    const children = new Map();
    const first = new Memory([], {}, { record: true });
    const ended = await this.#drive(opId, version, first, children);
    const report = new Report(ended, first.journal.map((e) => [e.seq, e.name, e.kind]));
    for (const v of first.violations) report.note({ ...v, at: "the first run" });
    if (ended.status === "failed") {
      if (ended.errorClass === "nondeterminism") report.note({ check: Check.NONDETERMINISM, seq: null, step: "", at: "the first run", message: ended.message });
      else if (ended.errorClass !== "non_retryable") report.note({ check: Check.FAILED, seq: null, step: "", at: "the first run", message: `the operation ended ${ended.errorClass}: ${ended.message}` });
    }
    const expected = completed(first.journal);
    const points = crashPoints(first.timeline);
    for (let n = 0; n < points.length; n++) {
      const [journal, happened, events, after] = points[n];
      report.crashPoints += 1;
      const label = `crash point ${n + 1} (${after})`;
      const timelineId = randomUUID();
      const timelineChildren = new Map();
      const prefix = new Memory([], {}, { record: true, crashAfter: events });
      await this.#drive(timelineId, version, prefix, timelineChildren);
      let mem;
      let runId;
      let runChildren;
      if (prefix.crashed) {
        [runId, runChildren] = [timelineId, timelineChildren];
        const [j, h, unsure] = prefix.left();
        mem = new Memory(j, h, { record: false, unsure });
      } else {
        // It ended before its crash point (another path than the first run): resume from the
        // first run's journal under its keys; reconciles are not judged then.
        [runId, runChildren] = [opId, children];
        mem = new Memory(clone(journal), { ...happened }, { record: false, checkReconciles: false });
      }
      const again = await this.#drive(runId, version, mem, runChildren);
      for (const v of mem.violations) report.note({ ...v, at: label });
      if (again.status === "failed" && again.errorClass === "unknown_side_effect") {
        const row = mem.journal.find((e) => e.status === "unknown");
        report.note({ check: Check.NO_RECONCILE, seq: row ? row.seq : null, step: row ? row.name : "", at: label, message: "an unsafe step a crash interrupted cannot be reconciled: the operation would stop as unknown_side_effect and wait for a human (give it a reconcile that asks the outside system by the idempotency key, or make the step safe if repeating it is harmless)" });
        continue;
      }
      if (again.status === "failed" && again.errorClass === "nondeterminism") {
        report.note({ check: Check.NONDETERMINISM, seq: null, step: "", at: label, message: again.message });
        continue;
      }
      const got = completed(mem.journal);
      if (!same(got, expected)) {
        let k = 0;
        while (k < Math.min(got.length, expected.length) && same(got[k], expected[k])) k += 1;
        const show = (s) => (k < s.length ? `${s[k][1]} (${s[k][2]})` : "nothing");
        const seq = k < expected.length ? expected[k][0] : k;
        report.note({ check: Check.NONDETERMINISM, seq, step: show(expected), at: label, message: `step ${seq} was ${show(expected)} in the first run but ${show(got)} after this crash: the steps depend on something the journal does not hold (the clock, a random number, a global); take it from a step (ctx.now, ctx.uuid, ctx.step)` });
      }
      if (className(again) !== className(ended)) {
        report.note({ check: Check.FAILED, seq: null, step: "", at: label, message: `the first run ${describe(ended)} but this one ${describe(again)}` });
      }
    }
    return report;
  }

  #childEnd(index, kind, input) {
    if (index < this.childEnds.length) return this.childEnds[index];
    if (this.childrenFn) return this.childrenFn(kind, input);
    return { status: "succeeded", result: null };
  }

  async #drive(opId, version, mem, children) {
    let [attempt, parks, requests] = [1, 0, 0];
    for (;;) {
      const session = randomUUID();
      let sent = null;
      let directive = null;
      let resent = false;
      let nextClaim = null;
      while (nextClaim === null) {
        if (mem.crashed) return { status: "crashed" };
        requests += 1;
        if (requests > MAX_REQUESTS) return failed("tester", `more than ${MAX_REQUESTS} requests`);
        let base = 0;
        let entries = mem.journal;
        let input = this.input;
        if (sent !== null) {
          while (base < sent.length && base < mem.journal.length && same(sent[base], mem.journal[base])) base += 1;
          entries = mem.journal.slice(base);
          input = base === 0 ? this.input : null;
        }
        const request = {
          protocol: 1,
          operation: { id: opId, kind: this.kind, version, tenant: this.tenant, attempt },
          session,
          input,
          journal: { base, entries: clone(entries) },
          run: null,
          reconcile: null,
        };
        if (directive !== null) {
          const [what, seq] = directive;
          request[what] = { seq, key: key(opId, seq, mem.journal[seq].name) };
        }
        sent = clone(mem.journal);
        const answer = JSON.parse(JSON.stringify(await this.service.invoke(clone(request))));
        const t = answer.type;
        if (t === "resend") {
          if (resent) return failed("protocol", "the service answered resend to a whole journal");
          [resent, sent] = [true, null];
          continue;
        }
        resent = false;
        if (t === "output") {
          if (directive !== null) return failed("protocol", `a ${directive[0]} request for step ${directive[1]} was answered with the operation's output`);
          return succeeded(answer.output);
        }
        if (t === "error") {
          if (answer.class === "retryable" && attempt < ATTEMPTS) {
            attempt += 1;
            nextClaim = "retry";
            continue;
          }
          return failed(String(answer.class), String(answer.message));
        }
        const seq = answer.seq;
        const expect = mem.firstOpen();
        if (seq !== expect) return failed("protocol", `the service answered step ${seq} but the journal asks for step ${expect}`);
        if (directive !== null && (directive[1] !== seq || !["step", "reconciled"].includes(t))) {
          return failed("protocol", `a ${directive[0]} request for step ${directive[1]} was answered with ${t}`);
        }
        const nk = nameKind(answer);
        const entry = mem.journal[seq];
        if (nk !== null && entry !== undefined && (entry.name !== nk[0] || entry.kind !== nk[1])) {
          return failed("nondeterminism", `step ${seq}: the journal recorded ${entry.name} (${entry.kind}), the code asked for ${nk[0]} (${nk[1]})`);
        }
        const outcome = await this.#apply(opId, mem, children, answer, directive, entry);
        if (outcome !== null && typeof outcome === "object" && !Array.isArray(outcome)) {
          if (outcome.status === "failed" && outcome.errorClass === "retryable" && attempt < ATTEMPTS) {
            attempt += 1;
            nextClaim = "retry";
            continue;
          }
          return outcome;
        }
        if (outcome === "park") {
          parks += 1;
          if (parks > MAX_PARKS) return failed("tester", `parked more than ${MAX_PARKS} times`);
          this.#wake(mem, children);
          nextClaim = "park";
          continue;
        }
        directive = Array.isArray(outcome) ? outcome : null;
      }
    }
  }

  async #apply(opId, mem, children, answer, directive, entry) {
    const { type: t, seq } = answer;
    const row = (fields) => ({ output: null, error: null, replay: "safe", ...fields });
    switch (t) {
      case "step": {
        const unsafe = directive !== null;
        const base = { name: answer.name, kind: "custom", replay: unsafe ? "unsafe" : "safe" };
        const err = answer.error;
        if (err === undefined || err === null) {
          if (unsafe) mem.effect(key(opId, seq, answer.name), seq, answer.name, answer.output ?? null);
          mem.write(seq, { ...base, status: "completed", output: answer.output ?? null, error: null });
          return null;
        }
        const status = unsafe && !err.no_effect ? "unknown" : "failed";
        if (status === "unknown") mem.unknown(key(opId, seq, answer.name));
        mem.write(seq, { ...base, status, output: null, error: err.message });
        return failed(err.retryable === false ? "non_retryable" : "retryable", `step ${answer.name} failed: ${err.message}`);
      }
      case "unsafe":
        if (entry !== undefined && ["started", "unknown"].includes(entry.status)) return ["reconcile", seq];
        mem.write(seq, row({ name: answer.name, kind: "custom", replay: "unsafe", status: "started" }));
        return ["run", seq];
      case "reconciled": {
        if (directive === null || directive[0] !== "reconcile") return failed("protocol", "a reconciled answer to a request that asked no reconcile");
        const r = mem.journal[seq];
        if (answer.unsupported) {
          mem.write(seq, { ...r, status: "unknown" });
          return failed("unknown_side_effect", `step ${seq} (${r.name}): an unsafe step's outcome is unknown and it has no reconcile`);
        }
        if (answer.happened) {
          mem.reconciled(key(opId, seq, r.name), seq, r.name, answer.output ?? null);
          mem.write(seq, { ...r, status: "completed", output: answer.output ?? null, error: null });
          return null;
        }
        return ["run", seq];
      }
      case "model": {
        const n = mem.journal.slice(0, seq).filter((e) => e.kind === "model").length;
        mem.write(seq, row({ name: answer.name, kind: "model", status: "completed", output: clone(this.model_(answer.request ?? {}, n)) }));
        return null;
      }
      case "sleep":
        mem.write(seq, row({ name: "sleep", kind: "sleep", status: "started" }));
        return "park";
      case "signal":
        mem.write(seq, row({ name: `signal:${answer.name}`, kind: "signal", status: "started" }));
        return "park";
      case "spawn": {
        const childId = `${opId}-child-${seq}`;
        if (!children.has(childId)) children.set(childId, [answer.kind, answer.input, children.size]);
        mem.write(seq, row({ name: `spawn:${answer.kind}`, kind: "spawn", status: "completed", output: childId }));
        return null;
      }
      case "join": {
        const ids = (answer.children ?? []).map(String);
        const stranger = ids.find((c) => !children.has(c));
        if (stranger !== undefined) return failed("non_retryable", `join names ${stranger}, which is not this operation's child`);
        mem.write(seq, row({ name: "join", kind: "join", status: "started", output: { children: ids } }));
        return "park";
      }
      case "now":
        mem.write(seq, row({ name: "now", kind: "now", status: "completed", output: new Date().toISOString() }));
        return null;
      case "uuid":
        mem.write(seq, row({ name: "uuid", kind: "now", status: "completed", output: randomUUID() }));
        return null;
      case "patch":
        mem.write(seq, row({ name: answer.name, kind: "patch", status: "completed", output: true }));
        return null;
      default:
        return failed("protocol", `an answer of unknown type ${JSON.stringify(t)}`);
    }
  }

  /** What the scheduler and senders do while the operation is parked. */
  #wake(mem, children) {
    const seq = mem.firstOpen();
    const r = mem.journal[seq];
    if (r.kind === "sleep") mem.write(seq, { ...r, status: "completed", output: null });
    else if (r.kind === "signal") {
      const name = r.name.slice("signal:".length);
      const k = mem.journal.slice(0, seq).filter((e) => e.name === r.name).length;
      const queue = this.signals[name] ?? [];
      mem.write(seq, { ...r, status: "completed", output: k < queue.length ? clone(queue[k]) : { timed_out: true } });
    } else if (r.kind === "join") {
      const outcomes = (r.output?.children ?? []).map((c) => {
        const [kind, input, index] = children.get(c);
        return childOutcome(this.#childEnd(index, kind, input), c, kind);
      });
      mem.write(seq, { ...r, status: "completed", output: outcomes });
    }
  }
}
