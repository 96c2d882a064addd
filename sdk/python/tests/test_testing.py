import random
import unittest

import _helpers  # noqa: F401
from agentq import Context, NoEffect, Service
from agentq.testing import Check, ChildEnd, Tester, replay_journal

import refund_service


class TesterTest(unittest.TestCase):
    def test_the_example_refund_agent_passes_every_crash_point(self):
        refunds = []

        def refund(key):
            refunds.append(key)
            return {"refunded": 1250, "key": key}

        report = (Tester(refund_service.svc, "refund_agent", {"order": "A-17", "effect_url": "http://x"})
                  .model(replies=["approve it", "Refunded 12.50 for A-17."])
                  .approve(by="ann")
                  .fake_unsafe("refund", refund)
                  .run())
        report.assert_ok()
        self.assertEqual(report.output["summary"], "Refunded 12.50 for A-17.")
        self.assertEqual(report.output["refund"]["refunded"], 1250)
        self.assertEqual([s[1] for s in report.steps],
                         ["lookup", "decide", "signal:approval", "refund", "summarize"])
        self.assertGreaterEqual(report.crash_points, 8)
        # Every crash point is an operation of its own, with a key of its own: the first run and
        # each timeline refunded once, none twice.
        self.assertEqual(len(refunds), len(set(refunds)), refunds)
        self.assertEqual(len(refunds), report.crash_points + 1, refunds)
        self.assertEqual(report.output["refund"]["key"], refunds[0])

    def test_a_rejection_ends_non_retryable_without_violations(self):
        report = (Tester(refund_service.svc, "refund_agent", {"order": "A", "effect_url": "http://x"})
                  .reject().run())
        self.assertEqual(report.violations, [])
        self.assertEqual((report.outcome.error_class, report.outcome.message),
                         ("non_retryable", "refund not approved"))
        # A failed run is not ok, even with no problem found.
        self.assertFalse(report.ok)
        with self.assertRaises(AssertionError):
            report.assert_ok()

    def test_a_wait_with_no_signal_times_out(self):
        report = Tester(refund_service.svc, "refund_agent", {"order": "A", "effect_url": "x"}).run()
        self.assertEqual(report.outcome.message, "refund not approved")
        self.assertEqual(report.violations, [])

    def test_sleeps_and_the_clock(self):
        report = Tester(refund_service.svc, "sleeper").run()
        report.assert_ok()
        self.assertEqual(report.output, "woke")
        self.assertEqual([s[2] for s in report.steps], ["sleep", "now"])

    def test_a_kind_that_branches_on_random_is_nondeterministic(self):
        svc = Service("s")

        @svc.kind("flaky")
        async def flaky(ctx: Context, inp: dict):
            for i in range(4):
                name = random.choice(["left", "right"])
                await ctx.step(f"{name}{i}", lambda: 1)
            return "done"

        report = Tester(svc, "flaky", {}).run()
        self.assertFalse(report.is_ok())
        self.assertTrue(report.found(Check.NONDETERMINISM), str(report))
        with self.assertRaises(AssertionError) as cm:
            report.assert_ok()
        self.assertIn("nondeterminism", str(cm.exception))

    def test_an_unsafe_step_without_reconcile_is_reported(self):
        svc = Service("s")

        @svc.kind("pay")
        async def pay(ctx: Context, inp: dict):
            await ctx.step("prepare", lambda: 1)
            out = await ctx.unsafe_step("charge", lambda key: {"charged": key})
            return out

        report = Tester(svc, "pay", {}).run()
        found = report.found(Check.NO_RECONCILE)
        self.assertEqual([(v.seq, v.step) for v in found], [(1, "charge")], str(report))
        self.assertFalse(report.found(Check.RAN_AGAIN))

    def test_a_reconcile_that_misses_the_effect_runs_it_again(self):
        svc = Service("s")

        @svc.kind("pay")
        async def pay(ctx: Context, inp: dict):
            return await ctx.unsafe_step("charge", lambda key: {"charged": key},
                                         reconcile=lambda key: None)

        report = Tester(svc, "pay", {}).run()
        self.assertEqual([v.step for v in report.found(Check.RAN_AGAIN)], ["charge"], str(report))
        self.assertIn("before its journal write", report.found(Check.RAN_AGAIN)[0].at)

    def test_an_honest_real_reconcile_passes(self):
        svc = Service("s")
        ledger, calls = {}, []

        def charge(key):
            calls.append(key)
            ledger[key] = {"charged": True, "key": key}
            return ledger[key]

        @svc.kind("pay")
        async def pay(ctx: Context, inp: dict):
            await ctx.step("prepare", lambda: 1)
            return await ctx.unsafe_step("charge", charge,
                                         reconcile=lambda key: (True, ledger[key]) if key in ledger else None)

        report = Tester(svc, "pay", {}).run()
        report.assert_ok()
        # The ledger holds one charge per timeline (the first run and each crash point), each
        # made once: its reconcile was asked about keys of its own timeline only.
        self.assertEqual(len(calls), len(set(calls)), calls)
        self.assertEqual(len(ledger), report.crash_points + 1)

    def test_a_reconcile_that_always_says_it_happened_is_wrong(self):
        svc = Service("s")
        ledger = {}

        def charge(key):
            ledger[key] = {"charged": True}
            return ledger[key]

        @svc.kind("pay")
        async def pay(ctx: Context, inp: dict):
            await ctx.step("prepare", lambda: 1)
            # It never looks at the ledger: "happened", with the output the charge would return.
            return await ctx.unsafe_step("charge", charge, reconcile=lambda key: (True, {"charged": True}))

        report = Tester(svc, "pay", {}).run()
        self.assertFalse(report.ok)
        found = report.found(Check.WRONG_RECONCILE)
        self.assertEqual([(v.seq, v.step) for v in found], [(1, "charge")], str(report))
        self.assertEqual(len(report.violations), 1, str(report))
        # The crash between the step's started row and its effect.
        self.assertIn("(after step 1 (charge) was written started)", found[0].at)
        self.assertIn("in this timeline the crash came before it", found[0].message)
        self.assertIn("look the effect up by the idempotency key", found[0].message)
        self.assertIn("[wrong reconcile] step 1 (charge) at crash point", str(report))

    def test_a_reconcile_that_answers_another_output_is_wrong(self):
        svc = Service("s")
        ledger = {}

        def charge(key):
            ledger[key] = {"charged": 1250, "id": len(ledger)}
            return ledger[key]

        @svc.kind("pay")
        async def pay(ctx: Context, inp: dict):
            # It finds the charge by its key but answers something else than the charge returned.
            return await ctx.unsafe_step("charge", charge,
                                         reconcile=lambda key: (True, {"charged": 1250}) if key in ledger else None)

        report = Tester(svc, "pay", {}).run()
        found = report.found(Check.WRONG_RECONCILE)
        self.assertEqual([(v.seq, v.step) for v in found], [(0, "charge")], str(report))
        self.assertIn("before its journal write", found[0].at)
        self.assertIn("another output than the effect's", found[0].message)
        self.assertIn('{"charged": 1250} where the effect returned {"charged": 1250, "id": ', found[0].message)
        self.assertFalse(report.found(Check.RAN_AGAIN))

    def test_a_reconcile_after_a_function_that_raised_is_not_judged(self):
        # The function made its effect and then raised: the tester cannot know the effect
        # happened, so a reconcile that finds it is not called wrong.
        svc = Service("s")
        ledger, raised = {}, set()

        def charge(key):
            ledger[key] = {"charged": True}
            if key not in raised:
                raised.add(key)
                raise RuntimeError("connection reset after the charge")
            return ledger[key]

        @svc.kind("pay")
        async def pay(ctx: Context, inp: dict):
            return await ctx.unsafe_step("charge", charge,
                                         reconcile=lambda key: (True, ledger[key]) if key in ledger else None)

        report = Tester(svc, "pay", {}).run()
        report.assert_ok()
        self.assertEqual(report.output, {"charged": True})

    def test_no_effect_failures_are_retried(self):
        svc = Service("s")
        tries = []

        def flaky(key):
            tries.append(key)
            if len(tries) < 2:
                raise NoEffect("connection refused")
            return "ok"

        @svc.kind("pay")
        async def pay(ctx: Context, inp: dict):
            return await ctx.unsafe_step("charge", flaky, reconcile=lambda key: None)

        report = Tester(svc, "pay", {}).run()
        self.assertEqual(report.output, "ok")

    def test_a_kind_that_always_fails_is_reported(self):
        svc = Service("s")

        @svc.kind("bad")
        async def bad(ctx: Context, inp: dict):
            raise RuntimeError("no database")

        report = Tester(svc, "bad", {}).run()
        self.assertEqual(report.outcome.error_class, "retryable")
        self.assertEqual([v.check for v in report.violations], [Check.FAILED])

    def test_children(self):
        svc = Service("s")

        @svc.kind("parent")
        async def parent(ctx: Context, inp: dict):
            a = await ctx.spawn("echo", {"n": 1})
            b = await ctx.spawn("echo", {"n": 2})
            outs = await ctx.join([a, b])
            return [(o.status, o.result, o.error_class) for o in outs]

        report = (Tester(svc, "parent", {}).child(ChildEnd.succeeded({"n": 1}))
                  .child(ChildEnd.dead("non_retryable", "bad")).run())
        report.assert_ok()
        self.assertEqual(report.output, [["succeeded", {"n": 1}, None], ["dead", None, "non_retryable"]])

    def test_an_unknown_kind_is_a_broken_report(self):
        report = Tester(Service("s"), "nope").run()
        self.assertEqual(report.outcome.error_class, "tester")
        self.assertFalse(report.is_ok())

    def test_a_thousand_steps_runs_quickly(self):
        # Only the first run: the benchmark's kind, through the same handler.
        svc = refund_service.svc
        import json

        from _helpers import entry, request
        journal = []
        for i in range(1000):
            if i == 0:
                req = request("ten_steps", [], input={"steps": 1000}, session="bench")
            else:  # only the entry just journaled
                req = request("ten_steps", journal[i - 1:], base=i - 1, session="bench")
            a = svc.invoke(req)
            self.assertEqual((a["type"], a["seq"]), ("step", i))
            journal.append(entry(a["name"], output=a["output"]))
        a = svc.invoke(request("ten_steps", journal[999:], base=999, session="bench"))
        self.assertEqual(a, {"type": "output", "output": {"steps": 1000}})
        json.dumps(a)

    def test_replay_journal(self):
        journal = [
            {"seq": 0, "name": "lookup", "kind": "custom", "status": "completed", "output": {"order": "A"}},
            {"seq": 1, "name": "decide", "kind": "model", "status": "completed", "output": {"content": "x"}},
        ]
        r = replay_journal(refund_service.svc, "refund_agent", {"order": "A", "effect_url": "x"}, journal)
        self.assertTrue(r.agrees)
        self.assertEqual(r.answer["type"], "signal")
        journal[1]["name"] = "choose"
        r = replay_journal(refund_service.svc, "refund_agent", {"order": "A", "effect_url": "x"}, journal)
        self.assertFalse(r.agrees)
        self.assertIn("step 1", r.answer["message"])

    def test_patched_takes_the_new_path_on_new_runs_and_the_old_one_on_old_journals(self):
        svc = Service("s")

        @svc.kind("onboard")
        async def onboard(ctx: Context, inp: dict):
            await ctx.step("fetch", lambda: 1)
            checked = False
            if await ctx.patched("check-first"):
                checked = await ctx.step("check", lambda: True)
            await ctx.step("send", lambda: 2)
            return {"checked": checked}

        # A new operation takes the new path, through every crash point.
        report = Tester(svc, "onboard", {}).run()
        report.assert_ok()
        self.assertEqual(report.output, {"checked": True})
        self.assertEqual([(s[1], s[2]) for s in report.steps],
                         [("fetch", "custom"), ("check-first", "patch"), ("check", "custom"),
                          ("send", "custom")])
        # A journal recorded before the change replays the old path; one recorded with the
        # marker, the new one; each agrees.
        old = [
            {"seq": 0, "name": "fetch", "kind": "custom", "status": "completed", "output": 1},
            {"seq": 1, "name": "send", "kind": "custom", "status": "completed", "output": 2},
        ]
        r = replay_journal(svc, "onboard", {}, old)
        self.assertTrue(r.agrees, r.answer)
        self.assertEqual(r.answer, {"type": "output", "output": {"checked": False}})
        new = [
            {"seq": 0, "name": "fetch", "kind": "custom", "status": "completed", "output": 1},
            {"seq": 1, "name": "check-first", "kind": "patch", "status": "completed", "output": True},
            {"seq": 2, "name": "check", "kind": "custom", "status": "completed", "output": True},
        ]
        r = replay_journal(svc, "onboard", {}, new)
        self.assertTrue(r.agrees, r.answer)
        self.assertEqual(r.answer, {"type": "step", "seq": 3, "name": "send"})

    def test_replay_journal_diverges_on_an_input_the_code_cannot_decode(self):
        journal = [
            {"seq": 0, "name": "lookup", "kind": "custom", "status": "completed", "output": {"order": "A"}},
        ]
        # The recorded input lacks a field the kind's input type now requires.
        r = replay_journal(refund_service.svc, "refund_agent", {"effect_url": "x"}, journal)
        self.assertFalse(r.agrees, r.answer)
        self.assertEqual(r.answer["class"], "non_retryable")
        self.assertIn("order", r.answer["message"])


if __name__ == "__main__":
    unittest.main()


class ExampleEffectTest(unittest.TestCase):
    """The example's unsafe step and reconcile against a real (local) payments endpoint."""

    def test_one_refund_through_every_crash_point(self):
        import json
        import threading
        import urllib.parse
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        done, posts = {}, []

        class Effects(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def reply(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                posts.append(body["key"])
                done.setdefault(body["key"], {"refunded": body["order"], "id": len(done)})
                self.reply(done[body["key"]])

            def do_GET(self):
                key = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)["key"][0]
                self.reply({"happened": key in done, "output": done.get(key)})

        server = ThreadingHTTPServer(("127.0.0.1", 0), Effects)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        url = f"http://127.0.0.1:{server.server_address[1]}/refunds"
        report = (Tester(refund_service.svc, "refund_agent", {"order": "A-17", "effect_url": url})
                  .approve().run())
        report.assert_ok()
        # Every crash point is an operation of its own, with a key of its own: the endpoint
        # holds one refund per timeline (the first run's first), each posted once, and the
        # reconcile was asked about that timeline's refund only.
        self.assertEqual(len(posts), len(set(posts)), posts)
        self.assertEqual(len(done), report.crash_points + 1)
        self.assertEqual(report.output["refund"], {"refunded": "A-17", "id": 0})
