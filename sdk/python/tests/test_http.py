import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import unittest

from _helpers import EXAMPLES, ROOT, SECRET, request
from agentq import Context, Service
from agentq.signing import Secret, sign_headers, verify


def make_service(secret=SECRET):
    svc = Service("billing", secret=secret)

    @svc.kind("echo", description="Echoes.")
    async def echo(ctx: Context, inp: dict):
        got = await ctx.step("copy", lambda: inp)
        return got

    return svc


def signed(body: bytes, msg_id="msg_1", secret=SECRET):
    h = sign_headers(Secret.parse(secret), msg_id, body)
    h["content-type"] = "application/json"
    return h


class ThreadedServerTest(unittest.TestCase):
    def setUp(self):
        self.svc = make_service()
        self.server = self.svc.make_server("127.0.0.1", 0)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def tearDown(self):
        self.server.shutdown()
        self.server.server_close()

    def call(self, method, path, body=b"", headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data

    def test_manifest_is_served_unsigned(self):
        status, headers, data = self.call("GET", "/agentq/manifest")
        self.assertEqual(status, 200)
        m = json.loads(data)
        self.assertEqual((m["protocol"], m["service"]), (1, "billing"))
        self.assertEqual(m["kinds"][0]["name"], "echo")
        self.assertEqual(self.call("GET", "/elsewhere")[0], 404)

    def test_a_signed_invoke_gets_a_signed_answer(self):
        body = json.dumps(request("echo", [], input={"a": 1})).encode()
        status, headers, data = self.call("POST", "/agentq/invoke", body, signed(body, "msg_42"))
        self.assertEqual(status, 200, data)
        self.assertEqual(headers["webhook-id"], "msg_42")
        verify([Secret.parse(SECRET)], headers["webhook-id"], headers["webhook-timestamp"],
               headers["webhook-signature"], data)
        self.assertEqual(json.loads(data), {"type": "step", "seq": 0, "name": "copy", "output": {"a": 1}})

    def test_refusals(self):
        body = json.dumps(request("echo", [], input={})).encode()
        status, headers, data = self.call("POST", "/agentq/invoke", body, {"content-type": "application/json"})
        self.assertEqual(status, 401)
        self.assertEqual(headers["content-type"], "application/problem+json")
        self.assertIn("missing webhook-id", json.loads(data)["detail"])
        other = Secret.generate().expose()
        self.assertEqual(self.call("POST", "/agentq/invoke", body, signed(body, secret=other))[0], 401)
        stale = signed(body)
        stale["webhook-timestamp"] = str(int(time.time()) - 400)
        self.assertEqual(self.call("POST", "/agentq/invoke", body, stale)[0], 401)
        bad = b"{not json"
        self.assertEqual(self.call("POST", "/agentq/invoke", bad, signed(bad))[0], 400)
        odd = json.dumps({"protocol": 7}).encode()
        self.assertEqual(self.call("POST", "/agentq/invoke", odd, signed(odd))[0], 400)
        self.assertEqual(self.call("GET", "/agentq/invoke")[0], 405)

    def test_a_body_over_64_mib_is_refused(self):
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(b"POST /agentq/invoke HTTP/1.1\r\nHost: x\r\nContent-Length: 70000000\r\n\r\n")
            data = s.recv(4096)
        self.assertIn(b" 413 ", data.split(b"\r\n")[0])

    def test_without_a_secret_every_invoke_is_refused(self):
        svc = make_service(secret=None)
        body = json.dumps(request("echo", [], input={})).encode()
        status, _, data = svc.handle_http("POST", "/agentq/invoke", signed(body), body)
        self.assertEqual(status, 401)
        self.assertIn("AGENTQ_SERVICE_SECRET is not set", json.loads(data)["detail"])
        self.assertEqual(svc.handle_http("GET", "/agentq/manifest", {}, b"")[0], 200)

    def test_keep_alive_serves_several_requests(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        for i in range(3):
            body = json.dumps(request("echo", [], input={"i": i}, session=f"k{i}")).encode()
            conn.request("POST", "/agentq/invoke", body=body, headers=signed(body, f"m{i}"))
            resp = conn.getresponse()
            self.assertEqual(json.loads(resp.read())["output"], {"i": i})
        conn.close()


class AsgiTest(unittest.TestCase):
    def exchange(self, app, method, path, body=b"", headers=None, root_path=""):
        sent = []
        chunks = [body[:10], body[10:]]

        async def receive():
            part = chunks.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(chunks)}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": root_path + path, "root_path": root_path,
                 "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()]}
        asyncio.run(app(scope, receive, send))
        start, resp = sent[0], sent[1]
        return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, resp["body"]

    def test_asgi_app(self):
        app = make_service().asgi()
        status, _, data = self.exchange(app, "GET", "/agentq/manifest", root_path="/billing")
        self.assertEqual((status, json.loads(data)["service"]), (200, "billing"))
        body = json.dumps(request("echo", [], input={"x": 1})).encode()
        status, headers, data = self.exchange(app, "POST", "/agentq/invoke", body, signed(body, "msg_9"))
        self.assertEqual(status, 200)
        self.assertEqual(headers["webhook-id"], "msg_9")
        self.assertEqual(json.loads(data)["output"], {"x": 1})
        self.assertEqual(self.exchange(app, "GET", "/other")[0], 404)

    def test_lifespan(self):
        app = make_service().asgi()
        msgs = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
        out = []

        async def receive():
            return msgs.pop(0)

        async def send(m):
            out.append(m["type"])

        asyncio.run(app({"type": "lifespan"}, receive, send))
        self.assertEqual(out, ["lifespan.startup.complete", "lifespan.shutdown.complete"])


class ProcessTest(unittest.TestCase):
    def start(self, args, cwd):
        env = dict(os.environ, PYTHONPATH=ROOT, AGENTQ_SERVICE_SECRET=SECRET, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        self.addCleanup(lambda: (proc.kill(), proc.wait(), proc.stdout.close(), proc.stderr.close()))
        line = proc.stdout.readline().strip()
        self.assertTrue(line.startswith("agentq service billing listening on http://127.0.0.1:"), line)
        return int(line.rsplit(":", 1)[1])

    def get_manifest(self, port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/agentq/manifest")
        m = json.loads(conn.getresponse().read())
        conn.close()
        return m

    def test_the_example_service(self):
        port = self.start([os.path.join(EXAMPLES, "refund_service.py"), "--port", "0"], ROOT)
        names = [k["name"] for k in self.get_manifest(port)["kinds"]]
        self.assertEqual(names, ["refund_agent", "ten_steps", "sleeper", "patched_steps"])
        body = json.dumps(request("ten_steps", [], input={"steps": 0})).encode()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("POST", "/agentq/invoke", body=body, headers=signed(body))
        resp = conn.getresponse()
        self.assertEqual(json.loads(resp.read()), {"type": "output", "output": {"steps": 0}})
        conn.close()

    def test_python_m_agentq_serve(self):
        port = self.start(["-m", "agentq", "serve", "refund_service:svc", "--port", "0"], EXAMPLES)
        self.assertEqual(self.get_manifest(port)["service"], "billing")


if __name__ == "__main__":
    unittest.main()
