// An agentq service in TypeScript's runtime (plain ESM), run by agentq's end-to-end tests:
//
//   AGENTQ_SERVICE_SECRET=whsec_… node sdk/typescript/examples/refund_service.mjs --port 8000
//
// - `ts_refund`: looks the order up, asks the model, waits for a human's approval, refunds (an
//   unsafe step: POST to `effect_url` with the step's idempotency key; its reconcile asks
//   `effect_url?key=…`), then asks the model for a summary;
// - `ts_steps`: `steps` safe steps, a durable sleep of `sleep` seconds between the first half
//   and the second.
import { NoEffect, NonRetryable, Service } from "../src/index.js";

const svc = new Service("ts_billing", { secret: process.env.AGENTQ_SERVICE_SECRET });

svc.kind(
  "ts_refund",
  {
    description: "Refunds an order after a human approves it.",
    inputSchema: {
      type: "object",
      required: ["order", "effect_url"],
      properties: { order: { type: "string" }, effect_url: { type: "string" } },
    },
  },
  async (ctx, input) => {
    const order = await ctx.step("lookup", () => ({ order: input.order, cents: 1250 }));
    await ctx.model("decide", { messages: [{ role: "user", content: `Refund order ${input.order}?` }] });
    const approval = await ctx.waitForSignal("approval", 3600);
    if ("timedOut" in approval || approval.payload?.approved !== true) throw new NonRetryable("refund not approved");
    const refund = await ctx.unsafeStep(
      "refund",
      async (key) => {
        let res;
        try {
          res = await fetch(input.effect_url, {
            method: "POST",
            headers: { "content-type": "application/json" },
            body: JSON.stringify({ key, order: order.order }),
          });
        } catch (e) {
          if (e?.cause?.code === "ECONNREFUSED") throw new NoEffect("the payments endpoint refused the connection");
          throw e;
        }
        if (!res.ok) throw new Error(`payments answered HTTP ${res.status}`);
        return await res.json();
      },
      async (key) => {
        const res = await fetch(`${input.effect_url}?key=${encodeURIComponent(key)}`);
        const found = await res.json();
        return found.happened ? { happened: true, output: found.output } : null;
      },
    );
    const summary = await ctx.model("summarize", {
      messages: [
        { role: "system", content: "You summarize refunds in one sentence." },
        { role: "user", content: `Summarize this refund: ${JSON.stringify(refund)}` },
      ],
    });
    return { refund, summary: summary.content };
  },
);

svc.kind(
  "ts_steps",
  {
    description: "Runs `steps` safe steps with a durable sleep halfway.",
    inputSchema: { type: "object", properties: { steps: { type: "integer" }, sleep: { type: "number" } } },
  },
  async (ctx, input) => {
    const steps = input.steps ?? 10;
    let sum = 0;
    for (let i = 0; i < steps; i++) {
      if (i === Math.floor(steps / 2) && input.sleep) await ctx.sleep(input.sleep);
      sum += await ctx.step(`s${i}`, () => i);
    }
    const id = await ctx.uuid();
    return { steps, sum, id_length: id.length };
  },
);

const at = process.argv.indexOf("--port");
await svc.listen(at > 0 ? Number(process.argv[at + 1]) : 8000);
