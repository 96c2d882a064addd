"""The two HTTP front ends of a service: an ASGI application and a stdlib threaded server. Both
hand each exchange to :meth:`Service.handle_http_async`. Nothing here logs a request, an
answer or a header."""

from __future__ import annotations

import asyncio
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Callable, Dict

from .service import MAX_REQUEST_BYTES, _problem

if TYPE_CHECKING:  # pragma: no cover
    from .service import Service


def asgi_app(service: "Service") -> Callable:
    async def app(scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "") or ""
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        headers = {}
        for k, v in scope.get("headers", []):
            headers[k.decode("latin-1").lower()] = v.decode("latin-1")
        declared = headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
            status, out, body = _problem(413, "Payload Too Large", "a request may carry at most 64 MiB")
        else:
            chunks, size, too_big = [], 0, False
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                part = message.get("body", b"")
                size += len(part)
                if size > MAX_REQUEST_BYTES:
                    too_big = True
                elif part:
                    chunks.append(part)
                if not message.get("more_body", False):
                    break
            if too_big:
                status, out, body = _problem(413, "Payload Too Large", "a request may carry at most 64 MiB")
            else:
                status, out, body = await service.handle_http_async(
                    scope.get("method", "GET"), path, headers, b"".join(chunks))
        await send({
            "type": "http.response.start",
            "status": status,
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in out],
        })
        await send({"type": "http.response.body",
                    "body": b"" if scope.get("method") == "HEAD" else body})

    return app


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server_version = "agentq-python"
    service: "Service"

    def log_message(self, format: str, *args: Any) -> None:  # never log requests
        pass

    def _read_body(self):
        """The body, or None when it is over the limit (the connection is then closed)."""
        if "chunked" in (self.headers.get("transfer-encoding") or "").lower():
            chunks, size = [], 0
            while True:
                line = self.rfile.readline(65537)
                n = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if n == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                size += n
                if size > MAX_REQUEST_BYTES:
                    return None
                chunks.append(self.rfile.read(n))
                self.rfile.readline(65537)
            return b"".join(chunks)
        length = int(self.headers.get("content-length") or 0)
        if length > MAX_REQUEST_BYTES:
            return None
        return self.rfile.read(length) if length > 0 else b""

    def _handle(self) -> None:
        try:
            body = self._read_body()
        except ValueError:
            self.close_connection = True
            self._send(*_problem(400, "Bad Request", "a malformed body"))
            return
        if body is None:
            self.close_connection = True
            self._send(*_problem(413, "Payload Too Large", "a request may carry at most 64 MiB"))
            return
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            result = asyncio.run(self.server.service.handle_http_async(  # type: ignore[attr-defined]
                self.command, self.path, headers, body))
        except Exception as e:  # a bug of the SDK: answer 500 without details of the payload
            result = _problem(500, "Internal Server Error", type(e).__name__)
        self._send(*result)

    def _send(self, status: int, headers, body: bytes) -> None:
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("connection", "close")
        # Headers and body in one write (no Nagle / delayed-ACK stall between them).
        self._headers_buffer.append(b"\r\n")
        if self.command != "HEAD":
            self._headers_buffer.append(body)
        self.wfile.write(b"".join(self._headers_buffer))
        self._headers_buffer = []

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def make_server(service: "Service", host: str, port: int) -> ThreadingHTTPServer:
    server = _Server((host, port), _Handler)
    server.service = service  # type: ignore[attr-defined]
    return server
