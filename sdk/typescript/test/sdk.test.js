import assert from "node:assert/strict";
import { test } from "node:test";

import { NoEffect, NonRetryable, Refused, Secret, Service, replayJournal, signHeaders, verify } from "../src/index.js";

function request(kind, entries, { base = 0, input = {}, run = null, reconcile = null, session = "s1" } = {}) {
  return {
    protocol: 1,
    operation: { id: "op-1", kind, version: "1", tenant: "t", attempt: 1 },
    session,
    input: base === 0 ? input : null,
    journal: { base, entries },
    run,
    reconcile,
  };
}

const done = (seq, name, kind, output) => ({ seq, name, kind, replay: "safe", status: "completed", output, error: null });

test("a signature verifies, and a changed body, another secret or an old timestamp does not", () => {
  const secret = Secret.generate();
  const body = Buffer.from('{"a":1}');
  const h = signHeaders(secret, "msg_1", body);
  verify([secret], h["webhook-id"], h["webhook-timestamp"], h["webhook-signature"], body);
  assert.throws(() => verify([secret], "msg_1", h["webhook-timestamp"], h["webhook-signature"], Buffer.from("{}")), Refused);
  assert.throws(() => verify([Secret.generate()], "msg_1", h["webhook-timestamp"], h["webhook-signature"], body), Refused);
  const old = signHeaders(secret, "msg_1", body, Date.now() / 1000 - 600);
  assert.throws(() => verify([secret], "msg_1", old["webhook-timestamp"], old["webhook-signature"], body), /5 minutes/);
  assert.equal(String(secret), "Secret(***)");
  assert.equal(Secret.parse(secret.expose()).expose(), secret.expose());
});

test("each call replays what the journal holds and stops at the first open position", async () => {
  const svc = new Service("s");
  const ran = [];
  svc.kind("k", {}, async (ctx) => {
    const a = await ctx.step("a", () => (ran.push("a"), 1));
    const b = await ctx.step("b", () => (ran.push("b"), a + 1));
    await ctx.sleep(2.5);
    return { b, now: (await ctx.now()).toISOString() };
  });
  assert.deepEqual(await svc.invoke(request("k", [])), { type: "step", seq: 0, name: "a", output: 1 });
  assert.deepEqual(await svc.invoke(request("k", [done(0, "a", "custom", 1)])), { type: "step", seq: 1, name: "b", output: 2 });
  assert.deepEqual(ran, ["a", "b"]);
  const j = [done(0, "a", "custom", 1), done(1, "b", "custom", 2)];
  assert.deepEqual(await svc.invoke(request("k", j)), { type: "sleep", seq: 2, seconds: 3 });
  j.push(done(2, "sleep", "sleep", null));
  assert.deepEqual(await svc.invoke(request("k", j)), { type: "now", seq: 3 });
  j.push(done(3, "now", "now", "2026-12-08T00:00:00Z"));
  assert.deepEqual(await svc.invoke(request("k", j)), { type: "output", output: { b: 2, now: "2026-12-08T00:00:00.000Z" } });
  assert.deepEqual(ran, ["a", "b"], "replays run no step function");
});

test("a stop is not an exception a kind's try/catch can take", async () => {
  const svc = new Service("s");
  let caught = 0;
  svc.kind("k", {}, async (ctx) => {
    try {
      await ctx.model("m", { messages: [{ role: "user", content: "hi" }] });
    } catch {
      caught += 1;
    }
    return "went on";
  });
  const a = await svc.invoke(request("k", []));
  assert.equal(a.type, "model");
  assert.equal(caught, 0);
});

test("a step asked for differently than recorded is nondeterminism", async () => {
  const svc = new Service("s");
  svc.kind("k", {}, async (ctx) => ctx.step("b", () => 1));
  const a = await svc.invoke(request("k", [done(0, "a", "custom", 1)]));
  assert.equal(a.class, "nondeterminism");
  assert.match(a.message, /step 0: the journal recorded a \(custom\), the code asked for b \(custom\)/);
});

test("an unsafe step asks first, runs on the run directive, and is reconciled after a crash", async () => {
  const svc = new Service("s");
  const effects = [];
  svc.kind("k", {}, async (ctx) =>
    ctx.unsafeStep(
      "pay",
      (key) => (effects.push(key), { paid: key }),
      (key) => (effects.includes(key) ? { happened: true, output: { paid: key } } : null),
    ),
  );
  assert.deepEqual(await svc.invoke(request("k", [])), { type: "unsafe", seq: 0, name: "pay", reconcile: true });
  const started = [{ seq: 0, name: "pay", kind: "custom", replay: "unsafe", status: "started", output: null, error: null }];
  assert.deepEqual(await svc.invoke(request("k", started, { run: { seq: 0, key: "K" } })), {
    type: "step",
    seq: 0,
    name: "pay",
    output: { paid: "K" },
  });
  assert.deepEqual(await svc.invoke(request("k", started, { reconcile: { seq: 0, key: "K" } })), {
    type: "reconciled",
    seq: 0,
    happened: true,
    output: { paid: "K" },
  });
  assert.deepEqual(await svc.invoke(request("k", started, { reconcile: { seq: 0, key: "other" } })), {
    type: "reconciled",
    seq: 0,
    happened: false,
  });
  assert.deepEqual(effects, ["K"]);
});

test("failures are classified: a step's, no effect, non-retryable, a kind's own", async () => {
  const svc = new Service("s");
  svc.kind("k", {}, async (ctx, input) => {
    if (input.mode === "kind") throw new NonRetryable("bad order");
    if (input.mode === "crash") throw new Error("boom");
    return ctx.unsafeStep("pay", () => {
      if (input.mode === "no_effect") throw new NoEffect("refused");
      throw new NonRetryable("card declined");
    });
  });
  const run = { seq: 0, key: "K" };
  let a = await svc.invoke(request("k", [], { input: { mode: "no_effect" }, run }));
  assert.deepEqual(a.error, { message: "NoEffect: refused", retryable: true, no_effect: true });
  a = await svc.invoke(request("k", [], { input: { mode: "declined" }, run, session: "s2" }));
  assert.deepEqual(a.error, { message: "card declined", retryable: false, no_effect: false });
  a = await svc.invoke(request("k", [], { input: { mode: "kind" }, session: "s3" }));
  assert.deepEqual(a, { type: "error", class: "non_retryable", message: "bad order" });
  a = await svc.invoke(request("k", [], { input: { mode: "crash" }, session: "s4" }));
  assert.deepEqual(a, { type: "error", class: "retryable", message: "Error: boom" });
});

test("a session sends only the journal's tail; a lost one asks for the whole journal", async () => {
  const svc = new Service("s", { maxSessions: 1 });
  svc.kind("k", {}, async (ctx) => {
    await ctx.step("a", () => 1);
    return ctx.step("b", () => 2);
  });
  await svc.invoke(request("k", []));
  const tail = request("k", [done(0, "a", "custom", 1)]);
  assert.deepEqual(await svc.invoke(tail), { type: "step", seq: 1, name: "b", output: 2 });
  const next = request("k", [done(1, "b", "custom", 2)], { base: 1 });
  assert.deepEqual(await svc.invoke(next), { type: "output", output: 2 });
  await svc.invoke(request("k", [], { session: "other" })); // evicts s1 (one session kept)
  assert.deepEqual(await svc.invoke(next), { type: "resend" });
});

test("patched: new runs take the new path, journals recorded before the change the old one", async () => {
  const svc = new Service("s");
  svc.kind("k", {}, async (ctx) => {
    await ctx.step("fetch", () => 1);
    let checked = false;
    if (await ctx.patched("check-first")) checked = await ctx.step("check", () => true);
    await ctx.step("send", () => 2);
    return { checked };
  });
  const fetched = [done(0, "fetch", "custom", 1)];
  assert.deepEqual(await svc.invoke(request("k", fetched)), { type: "patch", seq: 1, name: "check-first" });
  const old = [...fetched, done(1, "send", "custom", 2)];
  assert.deepEqual(await svc.invoke(request("k", old, { session: "old" })), { type: "output", output: { checked: false } });
  const marked = [...fetched, done(1, "check-first", "patch", true), done(2, "check", "custom", true), done(3, "send", "custom", 2)];
  assert.deepEqual(await svc.invoke(request("k", marked, { session: "new" })), { type: "output", output: { checked: true } });
});

test("over HTTP: the manifest is open, an invoke must be signed, and its answer is", async () => {
  const secret = Secret.generate();
  const svc = new Service("s", { secret: secret.expose() });
  svc.kind("k", { version: "2", description: "d", inputSchema: { type: "object" } }, async (ctx) => ctx.step("a", () => "x"));
  const server = await svc.listen(0);
  const base = `http://127.0.0.1:${server.address().port}`;
  try {
    const manifest = await (await fetch(`${base}/agentq/manifest`)).json();
    assert.deepEqual(manifest.kinds, [{ name: "k", version: "2", description: "d", input_schema: { type: "object" } }]);
    const body = Buffer.from(JSON.stringify({ ...request("k", []), operation: { id: "o", kind: "k", version: "2" } }));
    const unsigned = await fetch(`${base}/agentq/invoke`, { method: "POST", body });
    assert.equal(unsigned.status, 401);
    const res = await fetch(`${base}/agentq/invoke`, { method: "POST", body, headers: signHeaders(secret, "msg_9", body) });
    assert.equal(res.status, 200);
    const answer = Buffer.from(await res.arrayBuffer());
    assert.equal(res.headers.get("webhook-id"), "msg_9");
    verify([secret], res.headers.get("webhook-id"), res.headers.get("webhook-timestamp"), res.headers.get("webhook-signature"), answer);
    assert.deepEqual(JSON.parse(answer), { type: "step", seq: 0, name: "a", output: "x" });
    // The same through the fetch-style handler.
    const viaFetch = await svc.fetch(new Request(`${base}/agentq/manifest`));
    assert.equal(viaFetch.status, 200);
  } finally {
    server.close();
  }
});

test("replayJournal agrees with a journal the code replays, and diverges as agentq replay does", async () => {
  const svc = new Service("s");
  svc.kind("k", { parse: (i) => { if (typeof i.order !== "string") throw new TypeError("order: a string is required"); return i; } }, async (ctx, input) => {
    await ctx.step("lookup", () => input.order);
    return ctx.step("send", () => 1);
  });
  const lines = [JSON.stringify(done(0, "lookup", "custom", "A"))].join("\n");
  const ok = await replayJournal(svc, "k", { order: "A" }, lines);
  assert.equal(ok.agrees, true, JSON.stringify(ok.answer));
  assert.deepEqual(ok.answer, { type: "step", seq: 1, name: "send" }, "nothing runs");
  const renamed = await replayJournal(svc, "k", { order: "A" }, [done(0, "fetch", "custom", "A")]);
  assert.equal(renamed.agrees, false);
  assert.equal(renamed.answer.class, "nondeterminism");
  const unparsable = await replayJournal(svc, "k", {}, lines);
  assert.equal(unparsable.agrees, false);
  assert.match(unparsable.answer.message, /order: a string is required/);
});
