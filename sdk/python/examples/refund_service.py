"""An agentq service with four kinds, run by agentq's Rust end-to-end tests and benchmark:

    AGENTQ_SERVICE_SECRET=whsec_… PYTHONPATH=sdk/python python3 sdk/python/examples/refund_service.py --port 8000

- ``refund_agent``: looks the order up, asks the model, waits for a human's approval, refunds
  (an unsafe step: POST to ``effect_url`` with the step's idempotency key; its reconcile asks
  ``effect_url?key=…``), then asks the model for a summary;
- ``ten_steps``: ``steps`` safe steps (the benchmark's);
- ``sleeper``: a durable one-second sleep, then the clock;
- ``patched_steps``: two safe steps with a third added later behind ``ctx.patched``, so
  operations recorded before the change keep their path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from agentq import Context, NoEffect, NonRetryable, Service  # noqa: E402

svc = Service("billing", secret=os.environ.get("AGENTQ_SERVICE_SECRET"))


@dataclass
class RefundInput:
    order: str
    effect_url: str


@svc.tool("refund", replay="unsafe", description="Refunds an order through the payments endpoint.")
def refund_tool(key: str, effect_url: str, order: str):
    return _post_refund(effect_url, key, order)


@refund_tool.reconciler
def refund_happened(key: str, effect_url: str, order: str):
    return _check_refund(effect_url, key)


def _post_refund(effect_url: str, key: str, order: str):
    body = json.dumps({"key": key, "order": order}).encode()
    req = urllib.request.Request(effect_url, data=body, method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.URLError as e:
        if isinstance(getattr(e, "reason", None), ConnectionRefusedError):
            raise NoEffect("the payments endpoint refused the connection") from None
        raise


def _check_refund(effect_url: str, key: str):
    sep = "&" if "?" in effect_url else "?"
    url = f"{effect_url}{sep}key={urllib.parse.quote(key, safe='')}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        answer = json.loads(resp.read() or b"{}")
    if answer.get("happened"):
        return True, answer.get("output")
    return None


@svc.kind("refund_agent", version="1", description="Refunds an order after a human approves it.")
async def refund_agent(ctx: Context, inp: RefundInput) -> dict:
    order = await ctx.step("lookup", lambda: {"order": inp.order, "cents": 1250})
    await ctx.model("decide", {
        "messages": [
            {"role": "system", "content": "You approve refunds."},
            {"role": "user", "content": f"Refund order {inp.order}?"},
        ],
        "tools": [{
            "name": "refund",
            "description": "Refund an order",
            "parameters": {"type": "object", "properties": {"order": {"type": "string"}}},
        }],
        "tool_choice": {"tool": "refund"},
    })
    approval = await ctx.wait_for_signal("approval", timeout=3600)
    if not approval.approved:
        raise NonRetryable("refund not approved")
    refund = await ctx.call(refund_tool, inp.effect_url, order["order"])
    summary = await ctx.model("summarize", {
        "messages": [
            {"role": "system", "content": "You summarize refunds in one sentence."},
            {"role": "user", "content": f"Summarize this refund: {json.dumps(refund)}"},
        ],
    })
    return {"order": inp.order, "refund": refund, "summary": summary.get("content")}


@dataclass
class TenStepsInput:
    steps: int = 10
    payload_bytes: int = 0


@svc.kind("ten_steps", version="1", description="Runs `steps` safe steps (a benchmark).")
async def ten_steps(ctx: Context, inp: TenStepsInput) -> dict:
    for i in range(inp.steps):
        def step(i=i):
            out = {"i": i}
            if inp.payload_bytes:
                out["payload"] = "x" * inp.payload_bytes
            return out

        await ctx.step(f"s{i}", step)
    return {"steps": inp.steps}


@svc.kind("sleeper", version="1", description="Sleeps one second durably, then reads the clock.")
async def sleeper(ctx: Context) -> str:
    await ctx.sleep(1)
    await ctx.now()
    return "woke"


@svc.kind("patched_steps", version="1",
          description="Fetches and sends; checks in between since the change check-first.")
async def patched_steps(ctx: Context) -> dict:
    await ctx.step("fetch", lambda: {"fetched": True})
    checked = False
    if await ctx.patched("check-first"):
        checked = await ctx.step("check", lambda: True)
    await ctx.step("send", lambda: {"sent": True})
    return {"checked": checked}


def main() -> None:
    parser = argparse.ArgumentParser(description="agentq example service (billing)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    svc.serve(host=args.host, port=args.port)


if __name__ == "__main__":
    main()
