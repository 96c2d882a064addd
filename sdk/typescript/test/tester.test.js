import assert from "node:assert/strict";
import { test } from "node:test";

import { Check, NonRetryable, Service, Tester } from "../src/index.js";

/** A refund agent whose payments endpoint is a map kept by key (the test's outside system). */
function refundService(reconcile) {
  const payments = new Map();
  const svc = new Service("s");
  svc.kind("refund", {}, async (ctx, input) => {
    const order = await ctx.step("lookup", () => ({ order: input.order, cents: 1250 }));
    await ctx.model("decide", { messages: [{ role: "user", content: `Refund ${input.order}?` }] });
    const approval = await ctx.waitForSignal("approval", 3600);
    if ("timedOut" in approval || approval.payload?.approved !== true) throw new NonRetryable("not approved");
    const refund = await ctx.unsafeStep(
      "pay",
      (key) => {
        payments.set(key, (payments.get(key) ?? 0) + 1);
        return { paid: order.cents, key };
      },
      reconcile === undefined ? undefined : (key) => reconcile(payments, key, order),
    );
    const summary = await ctx.model("summarize", { messages: [{ role: "user", content: `Paid ${refund.paid}` }] });
    return { refund, summary: summary.content };
  });
  return { svc, payments };
}

const honest = (payments, key, order) => (payments.has(key) ? { happened: true, output: { paid: order.cents, key } } : null);

test("an honest refund agent passes every crash point, each timeline paying once", async () => {
  const { svc, payments } = refundService(honest);
  const report = await new Tester(svc, "refund", { order: "A-17" }).model({ replies: ["yes", "Refunded."] }).approve("ann").run();
  report.assertOk();
  assert.equal(report.output.summary, "Refunded.");
  assert.deepEqual(report.steps.map((s) => s[1]), ["lookup", "decide", "signal:approval", "pay", "summarize"]);
  assert.ok(report.crashPoints >= 8, String(report.crashPoints));
  assert.ok([...payments.values()].every((n) => n === 1), JSON.stringify([...payments]));
});

test("a kind whose steps depend on a random number is nondeterministic", async () => {
  const svc = new Service("s");
  svc.kind("flaky", {}, async (ctx) => {
    for (let i = 0; i < 4; i++) await ctx.step(`${Math.random() < 0.5 ? "left" : "right"}${i}`, () => 1);
    return "done";
  });
  const report = await new Tester(svc, "flaky", {}).run();
  assert.equal(report.ok, false);
  assert.ok(report.found(Check.NONDETERMINISM).length > 0, String(report));
  assert.throws(() => report.assertOk(), /nondeterminism/);
});

test("an unsafe step without a reconcile is reported", async () => {
  const { svc } = refundService(undefined);
  const report = await new Tester(svc, "refund", { order: "A" }).approve().run();
  assert.ok(report.found(Check.NO_RECONCILE).length > 0, String(report));
});

test("a reconcile that always says 'not happened' pays twice; one that always says 'happened' pays never", async () => {
  const never = refundService(() => null);
  const ranAgain = await new Tester(never.svc, "refund", { order: "A" }).approve().run();
  assert.ok(ranAgain.found(Check.RAN_AGAIN).length > 0, String(ranAgain));
  const always = refundService((_p, key, order) => ({ happened: true, output: { paid: order.cents, key } }));
  const lying = await new Tester(always.svc, "refund", { order: "A" }).approve().run();
  assert.ok(lying.found(Check.WRONG_RECONCILE).length > 0, String(lying));
});

test("a run that fails is not ok, and a rejected refund is its own outcome", async () => {
  const { svc } = refundService(honest);
  const report = await new Tester(svc, "refund", { order: "A" }).reject("bob").run();
  assert.equal(report.outcome.status, "failed");
  assert.equal(report.outcome.errorClass, "non_retryable");
  assert.equal(report.ok, false);
  assert.deepEqual(report.violations, [], "the same outcome at every crash point");
});
