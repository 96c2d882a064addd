import dataclasses
import datetime as dt
import json
import unittest
import uuid
from typing import List, Optional

from _helpers import SECRET, entry, request
from agentq import Context, NoEffect, NonRetryable, Service
from agentq.service import BadRequest, encode_answer

try:
    import pydantic
except ImportError:  # pragma: no cover
    pydantic = None


@dataclasses.dataclass
class Item:
    sku: str
    qty: int = 1


@dataclasses.dataclass
class Order:
    order: str
    cents: int
    items: List[Item] = dataclasses.field(default_factory=list)
    note: Optional[str] = None


def make_service():
    svc = Service("billing", secret=None)
    calls = {"pay": 0, "lookup": 0}

    @svc.kind("refund", version="1", description="Refunds.")
    async def refund(ctx: Context, inp: Order) -> dict:
        def lookup():
            calls["lookup"] += 1
            return {"total": inp.cents}

        total = await ctx.step("lookup", lookup)
        resp = await ctx.model("decide", {"messages": [{"role": "user", "content": "ok?"}]})
        sig = await ctx.wait_for_signal("approval", timeout=60)
        if not sig.approved:
            raise NonRetryable("refund not approved")

        def pay(key):
            calls["pay"] += 1
            return {"paid": total["total"], "key": key}

        paid = await ctx.unsafe_step("pay", pay, reconcile=lambda key: (True, {"paid": 1, "key": key}))
        await ctx.sleep(dt.timedelta(seconds=1.5))
        child = await ctx.spawn("echo", {"text": "hi"})
        outcomes = await ctx.join([child, child])
        now = await ctx.now()
        u = await ctx.uuid()
        return {"paid": paid, "content": resp["content"], "child": child,
                "child_ok": outcomes[0].succeeded, "now": now.isoformat(), "uuid": str(u),
                "types": [type(now).__name__, type(u).__name__, type(child).__name__]}

    return svc, calls


class InvokeTest(unittest.TestCase):
    def setUp(self):
        self.svc, self.calls = make_service()
        self.input = {"order": "A-17", "cents": 1250}

    def invoke(self, req):
        answer = self.svc.invoke(req)
        json.loads(encode_answer(answer))  # always JSON
        return answer

    def test_a_run_step_by_step(self):
        j = []
        a = self.invoke(request("refund", j, input=self.input, session="x"))
        self.assertEqual(a, {"type": "step", "seq": 0, "name": "lookup", "output": {"total": 1250}})
        j.append(entry("lookup", output=a["output"]))
        a = self.invoke(request("refund", j[0:], base=0, input=self.input, session="x"))
        self.assertEqual(a["type"], "model")
        self.assertEqual((a["seq"], a["name"]), (1, "decide"))
        self.assertEqual(a["request"]["messages"][0]["content"], "ok?")
        self.assertEqual(self.calls["lookup"], 1, "a completed step is not run again")
        j.append(entry("decide", "model", {"content": "yes", "model": "m", "finish_reason": "stop",
                                           "usage": {"prompt_tokens": 1, "completion_tokens": 1}}))
        # Incremental: only the new entry, at base 1, no input.
        a = self.invoke(request("refund", j[1:], base=1, session="x"))
        self.assertEqual(a, {"type": "signal", "seq": 2, "name": "approval", "timeout_seconds": 60})
        j.append(entry("signal:approval", "signal", {"payload": {"approved": True}, "sent_by": "ann"}))
        a = self.invoke(request("refund", j[2:], base=2, session="x"))
        self.assertEqual(a, {"type": "unsafe", "seq": 3, "name": "pay", "reconcile": True})
        self.assertEqual(self.calls["pay"], 0)
        j.append(entry("pay", status="started", replay="unsafe"))
        a = self.invoke(request("refund", j[3:], base=3, session="x", run={"seq": 3, "key": "k3"}))
        self.assertEqual(a, {"type": "step", "seq": 3, "name": "pay", "output": {"paid": 1250, "key": "k3"}})
        self.assertEqual(self.calls["pay"], 1)
        j[3] = entry("pay", output=a["output"], replay="unsafe")
        a = self.invoke(request("refund", j[3:], base=3, session="x"))
        self.assertEqual(a, {"type": "sleep", "seq": 4, "seconds": 2})
        j.append(entry("sleep", "sleep"))
        a = self.invoke(request("refund", j[4:], base=4, session="x"))
        self.assertEqual(a, {"type": "spawn", "seq": 5, "kind": "echo", "input": {"text": "hi"}})
        child = str(uuid.uuid4())
        j.append(entry("spawn:echo", "spawn", child))
        a = self.invoke(request("refund", j[5:], base=5, session="x"))
        self.assertEqual(a, {"type": "join", "seq": 6, "children": [child]})
        j.append(entry("join", "join", [{"op_id": child, "kind": "echo", "status": "succeeded", "result": {}}]))
        a = self.invoke(request("refund", j[6:], base=6, session="x"))
        self.assertEqual(a, {"type": "now", "seq": 7})
        j.append(entry("now", "now", "2026-01-02T03:04:05.123456789Z"))
        a = self.invoke(request("refund", j[7:], base=7, session="x"))
        self.assertEqual(a, {"type": "uuid", "seq": 8})
        u = str(uuid.uuid4())
        j.append(entry("uuid", "now", u))
        # A new session (another claim): the whole journal again.
        a = self.invoke(request("refund", j, input=self.input, session="y"))
        self.assertEqual(a["type"], "output")
        out = a["output"]
        self.assertEqual(out["types"], ["datetime", "UUID", "str"])
        self.assertEqual(out["now"], "2026-01-02T03:04:05.123456+00:00")
        self.assertEqual(out["uuid"], u)
        self.assertTrue(out["child_ok"])
        self.assertEqual(self.calls, {"pay": 1, "lookup": 1})

    def test_resend_when_the_session_is_unknown_or_short(self):
        a = self.invoke(request("refund", [entry("decide", "model", {})], base=1, session="nobody"))
        self.assertEqual(a, {"type": "resend"})
        self.invoke(request("refund", [], input=self.input, session="short"))
        a = self.invoke(request("refund", [], base=3, session="short"))
        self.assertEqual(a, {"type": "resend"})

    def test_sessions_are_an_lru(self):
        svc = Service("s", max_sessions=2)

        @svc.kind("k")
        async def k(ctx):
            return 1

        for s in ("a", "b", "c"):
            svc.invoke(request("k", [], session=s))
        self.assertEqual(svc.invoke(request("k", [], base=0, session="a"))["type"], "output")
        self.assertEqual(svc.invoke(request("k", [], base=0, session="b")), {"type": "output", "output": 1})
        self.assertEqual(len(svc.sessions), 2)
        self.assertEqual(svc.invoke(request("k", [], base=1, session="c")), {"type": "resend"})

    def test_nondeterminism_names_both_steps(self):
        a = self.invoke(request("refund", [entry("fetch", output=1)], input=self.input))
        self.assertEqual(a, {"type": "error", "class": "nondeterminism",
                             "message": "step 0: the journal recorded fetch (custom), the code asked "
                                        "for lookup (custom)"})
        j = [entry("lookup", output={"total": 1}), entry("decide", "custom", 1)]
        a = self.invoke(request("refund", j, input=self.input, session="n2"))
        self.assertEqual(a["message"], "step 1: the journal recorded decide (custom), the code asked "
                                       "for decide (model)")

    def test_input_misfits_name_the_field(self):
        cases = [
            ({"cents": 1}, "input.order: missing (a string is required)"),
            ({"order": 1, "cents": 1}, "input.order: expected a string, got an integer"),
            ({"order": "a", "cents": 1, "extra": 1}, "input.extra: unknown field"),
            ({"order": "a", "cents": 1, "items": [{"sku": "x"}, {"sku": 3}]},
             "input.items[1].sku: expected a string, got an integer"),
            ("nope", "input: expected an object, got a string"),
        ]
        for inp, want in cases:
            a = self.invoke(request("refund", [], input=inp, session=f"in-{want}"))
            self.assertEqual((a["type"], a["class"]), ("error", "non_retryable"), inp)
            self.assertIn(want, a["message"])

    def test_dataclass_schema(self):
        schema = self.svc.manifest()["kinds"][0]["input_schema"]
        self.assertEqual(schema["required"], ["order", "cents"])
        self.assertEqual(schema["properties"]["items"]["items"]["properties"]["qty"],
                         {"type": "integer", "default": 1})
        self.assertEqual(schema["properties"]["note"], {"anyOf": [{"type": "string"}, {"type": "null"}],
                                                        "default": None})
        self.assertFalse(schema["additionalProperties"])

    def test_failures_of_the_kind(self):
        svc = Service("s")
        ran = []

        @svc.kind("boom")
        async def boom(ctx: Context, inp: dict):
            if inp.get("mode") == "nonretry":
                raise NonRetryable("refund not approved")
            if inp.get("mode") == "swallow":
                try:
                    await ctx.step("a", lambda: 1)
                except Exception:  # must not swallow the stop
                    ran.append("swallowed")
                return "finished"
            if inp.get("mode") == "catch-all":
                try:
                    await ctx.step("a", lambda: 1)
                except BaseException:
                    pass
                return "finished anyway"
            raise ValueError("boom")

        a = svc.invoke(request("boom", [], input={}))
        self.assertEqual(a, {"type": "error", "class": "retryable", "message": "ValueError: boom"})
        a = svc.invoke(request("boom", [], input={"mode": "nonretry"}))
        self.assertEqual(a, {"type": "error", "class": "non_retryable", "message": "refund not approved"})
        a = svc.invoke(request("boom", [], input={"mode": "swallow"}))
        self.assertEqual(a, {"type": "step", "seq": 0, "name": "a", "output": 1})
        self.assertEqual(ran, [])
        a = svc.invoke(request("boom", [], input={"mode": "catch-all"}))
        self.assertEqual(a, {"type": "step", "seq": 0, "name": "a", "output": 1})
        a = svc.invoke(request("nope", []))
        self.assertEqual(a["class"], "non_retryable")
        self.assertIn("does not serve kind 'nope'", a["message"])

    def test_step_errors(self):
        svc = Service("s")

        def fails(exc):
            def f(*_):
                raise exc
            return f

        @svc.kind("k")
        async def k(ctx: Context, inp: dict):
            if inp["what"] == "safe":
                await ctx.step("s", fails(KeyError("x")))
            if inp["what"] == "safe-nonretry":
                await ctx.step("s", fails(NonRetryable("bad data")))
            if inp["what"] == "not-json":
                await ctx.step("s", lambda: object())
            if inp["what"] == "async":
                async def f():
                    return {"async": True}
                return await ctx.step("s", f)
            if inp["what"] == "nested":
                async def g():
                    await ctx.step("inner", lambda: 1)
                await ctx.step("s", g)
            await ctx.unsafe_step("u", fails(NoEffect("refused")))

        def ask(what, **kw):
            return svc.invoke(request("k", [], input={"what": what}, session=what, **kw))

        self.assertEqual(ask("safe")["error"], {"message": "KeyError: 'x'", "retryable": True, "no_effect": False})
        self.assertEqual(ask("safe-nonretry")["error"], {"message": "bad data", "retryable": False, "no_effect": False})
        e = ask("not-json")["error"]
        self.assertFalse(e["retryable"])
        self.assertIn("not JSON", e["message"])
        self.assertEqual(ask("async")["output"], {"async": True})
        self.assertIn("must not call the context", ask("nested")["error"]["message"])
        a = svc.invoke(request("k", [entry("u", status="started", replay="unsafe")], input={"what": "u"},
                               session="u", run={"seq": 0, "key": "k0"}))
        self.assertEqual(a["error"], {"message": "NoEffect: refused", "retryable": True, "no_effect": True})

    def test_reconcile(self):
        svc = Service("s")
        seen = {}

        @svc.kind("k")
        async def k(ctx: Context, inp: dict):
            def check(key):
                return seen.get(key)
            rec = check if inp["reconciles"] else None
            return await ctx.unsafe_step("pay", lambda key: {"paid": key}, reconcile=rec)

        started = [entry("pay", status="started", replay="unsafe")]

        def ask(reconciles, sess):
            return svc.invoke(request("k", started, input={"reconciles": reconciles}, session=sess,
                                      reconcile={"seq": 0, "key": "K"}))

        self.assertEqual(ask(True, "a"), {"type": "reconciled", "seq": 0, "happened": False})
        seen["K"] = (True, {"paid": "K"})
        self.assertEqual(ask(True, "b"), {"type": "reconciled", "seq": 0, "happened": True, "output": {"paid": "K"}})
        self.assertEqual(ask(False, "c"), {"type": "reconciled", "seq": 0, "unsupported": True})
        seen["K"] = "weird"
        a = ask(True, "d")
        self.assertEqual((a["type"], a["class"]), ("error", "retryable"))
        a = svc.invoke(request("k", started, input={"reconciles": False}, session="e"))
        self.assertEqual(a, {"type": "unsafe", "seq": 0, "name": "pay", "reconcile": False})

    def test_answers_over_4_mib_become_errors(self):
        svc = Service("s")

        @svc.kind("big")
        async def big(ctx: Context, inp: dict):
            if inp["step"]:
                await ctx.step("s", lambda: "x" * (5 << 20))
            return "x" * (5 << 20)

        a = json.loads(encode_answer(svc.invoke(request("big", [], input={"step": True}))))
        self.assertEqual((a["type"], a["error"]["retryable"]), ("step", False))
        self.assertIn("4 MiB", a["error"]["message"])
        a = json.loads(encode_answer(svc.invoke(request("big", [], input={"step": False}, session="2"))))
        self.assertEqual((a["type"], a["class"]), ("error", "non_retryable"))

    def test_bad_requests(self):
        for bad in ([], {"protocol": 2}, dict(request("refund", []), session=None),
                    dict(request("refund", []), journal={"base": -1, "entries": []}),
                    request("refund", [{"seq": 5, "name": "x", "kind": "custom"}])):
            with self.assertRaises(BadRequest):
                self.svc.invoke(bad)

    def test_registration_checks(self):
        svc = Service("s")
        with self.assertRaises(ValueError):
            Service("bad name")
        with self.assertRaises(ValueError):
            svc.kind("bad kind")
        with self.assertRaises(TypeError):
            svc.kind("sync")(lambda ctx: 1)

        @svc.kind("k", version="2")
        async def k(ctx, inp: dict):
            """Does k.

            More text."""

        m = svc.manifest()["kinds"][0]
        self.assertEqual((m["version"], m["description"], m["input_schema"]), ("2", "Does k.", {"type": "object"}))
        with self.assertRaises(ValueError):
            svc.kind("k", version="2")(k)


@unittest.skipIf(pydantic is None, "pydantic is not installed")
class PydanticTest(unittest.TestCase):
    def test_pydantic_inputs(self):
        class Refund(pydantic.BaseModel):
            order: str
            cents: int = pydantic.Field(gt=0)

        svc = Service("s")

        @svc.kind("r")
        async def r(ctx: Context, inp: Refund):
            return {"order": inp.order, "model": inp}

        schema = svc.manifest()["kinds"][0]["input_schema"]
        self.assertEqual(schema["required"], ["order", "cents"])
        a = svc.invoke(request("r", [], input={"order": "A", "cents": 3}))
        self.assertEqual(a["output"], {"order": "A", "model": {"order": "A", "cents": 3}})
        a = svc.invoke(request("r", [], input={"order": "A", "cents": 0}, session="2"))
        self.assertEqual(a["class"], "non_retryable")
        self.assertIn("input.cents:", a["message"])


if __name__ == "__main__":
    unittest.main()


class ToolTest(unittest.TestCase):
    def test_a_tool_is_in_the_manifest_and_called_as_an_unsafe_step_with_its_reconcile(self):
        from agentq import Context, Service
        svc = Service("tools", secret=SECRET)
        sent = []

        @svc.tool("send", description="Sends a note.")
        def send(key, to):
            sent.append((key, to))
            return {"sent": to}

        @send.reconciler
        def sent_already(key, to):
            return (True, {"sent": to}) if (key, to) in sent else None

        @svc.tool("lookup", replay="safe")
        def lookup(order):
            return {"order": order}

        @svc.kind("notify")
        async def notify(ctx: Context, inp: dict) -> dict:
            found = await ctx.call(lookup, inp["order"])
            return await ctx.call(send, found["order"])

        tools = svc.manifest()["tools"]
        self.assertEqual(
            tools,
            [{"name": "send", "description": "Sends a note.", "replay": "unsafe", "reconcile": True},
             {"name": "lookup", "description": "", "replay": "safe", "reconcile": False}],
        )
        first = svc.invoke(request("notify", input={"order": "A"}))
        self.assertEqual(first, {"type": "step", "seq": 0, "name": "lookup", "output": {"order": "A"}})
        done = [entry("lookup", output={"order": "A"})]
        second = svc.invoke(request("notify", done, input={"order": "A"}, session="s2"))
        self.assertEqual(second, {"type": "unsafe", "seq": 1, "name": "send", "reconcile": True})
        started = done + [entry("send", status="started", replay="unsafe")]
        ran = svc.invoke(request("notify", started, input={"order": "A"}, session="s3",
                                 run={"seq": 1, "key": "k1"}))
        self.assertEqual(ran, {"type": "step", "seq": 1, "name": "send", "output": {"sent": "A"}})
        asked = svc.invoke(request("notify", started, input={"order": "A"}, session="s4",
                                   reconcile={"seq": 1, "key": "k1"}))
        self.assertEqual(asked, {"type": "reconciled", "seq": 1, "happened": True, "output": {"sent": "A"}})
        self.assertEqual(sent, [("k1", "A")])
