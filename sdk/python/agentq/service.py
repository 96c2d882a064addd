"""A service: the kinds it serves, its manifest, and the step protocol's invoke handler (the one
function both HTTP servers and the replay tester call)."""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import re
import sys
import threading
import typing
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .context import Context, NonRetryable, OperationInfo, Tool, _jsonable, _Stop, error_text
from .schema import InputError, decode, encode_json, schema_of
from .signing import Refused, Secret, parse_secrets, sign_headers, verify

__all__ = ["Service", "PROTOCOL", "MAX_ANSWER_BYTES", "MAX_REQUEST_BYTES"]

PROTOCOL = 1
MAX_ANSWER_BYTES = 4 * 1024 * 1024
MAX_REQUEST_BYTES = 64 * 1024 * 1024
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

MANIFEST_PATH = "/agentq/manifest"
INVOKE_PATH = "/agentq/invoke"


@dataclass
class KindDef:
    name: str
    version: str
    description: Optional[str]
    fn: Callable
    input_type: Any
    takes_input: bool

    def manifest(self) -> dict:
        out = {"name": self.name, "version": self.version}
        if self.description:
            out["description"] = self.description
        out["input_schema"] = schema_of(self.input_type) if self.takes_input else {}
        return out


class _Sessions:
    """The journals (and inputs) of recent sessions, least recently used dropped first."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._items: "collections.OrderedDict[str, Tuple[Any, List[dict]]]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, session: str) -> Optional[Tuple[Any, List[dict]]]:
        with self._lock:
            item = self._items.get(session)
            if item is not None:
                self._items.move_to_end(session)
            return item

    def put(self, session: str, input: Any, journal: List[dict]) -> None:
        with self._lock:
            self._items[session] = (input, journal)
            self._items.move_to_end(session)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def drop(self, session: str) -> None:
        with self._lock:
            self._items.pop(session, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class BadRequest(Exception):
    """A request that is not a step protocol request (HTTP 400)."""


def _problem(status: int, title: str, detail: str) -> Tuple[int, List[Tuple[str, str]], bytes]:
    body = json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail}).encode()
    return status, [("content-type", "application/problem+json"),
                    ("content-length", str(len(body)))], body


class Service:
    """An agentq service: a name, the kinds it serves, and the secret agentq signs with.

    ``secret`` is the ``whsec_…`` secret ``agentq services add`` printed (usually
    ``os.environ.get("AGENTQ_SERVICE_SECRET")``); several, space separated, are all accepted
    (a rotation), and answers are signed with the first. Without one, every invoke is refused
    (401)."""

    def __init__(self, name: str, secret: Any = None, *, max_sessions: int = 1024):
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"a service name is 1-64 letters, digits, '_', '-', '.': {name!r}")
        self.name = name
        self._secrets: List[Secret] = parse_secrets(secret)
        self._kinds: Dict[Tuple[str, str], KindDef] = {}
        self._tools: Dict[str, Tool] = {}
        self.sessions = _Sessions(max_sessions)

    # --- kinds ----------------------------------------------------------------------------------

    def kind(self, name: str, version: str = "1", description: Optional[str] = None) -> Callable:
        """Registers an async function ``(ctx, input) -> output`` as ``name`` at ``version``.
        The input's type is the second parameter's annotation: a dataclass, a pydantic model,
        ``dict`` or none/``Any``. A function of ``ctx`` alone takes no input."""
        version = str(version)
        for what, v in (("kind name", name), ("kind version", version)):
            if not isinstance(v, str) or not _NAME.match(v):
                raise ValueError(f"a {what} is 1-64 letters, digits, '_', '-', '.': {v!r}")

        def register(fn: Callable) -> Callable:
            if not inspect.iscoroutinefunction(fn):
                raise TypeError(f"kind {name!r}: {getattr(fn, '__name__', fn)!r} must be an async function")
            if (name, version) in self._kinds:
                raise ValueError(f"kind {name!r} version {version!r} is registered already")
            params = list(inspect.signature(fn).parameters.values())
            if not params or len(params) > 2:
                raise TypeError(f"kind {name!r}: the function takes (ctx) or (ctx, input)")
            takes_input = len(params) == 2
            input_type: Any = Any
            if takes_input:
                try:
                    hints = typing.get_type_hints(fn)
                except Exception:
                    hints = {}
                input_type = hints.get(params[1].name, Any)
            desc = description
            if desc is None and fn.__doc__:
                desc = inspect.cleandoc(fn.__doc__).split("\n\n")[0].replace("\n", " ")
            self._kinds[(name, version)] = KindDef(name, version, desc, fn, input_type, takes_input)
            return fn

        return register

    def tool(self, name: str, replay: str = "unsafe", description: Optional[str] = None) -> Callable:
        """Registers a function as the tool ``name``: ``replay="unsafe"`` (the default: an effect
        that must happen once; the function takes the step's idempotency key first) or
        ``"safe"``. Returns a :class:`Tool`; give an unsafe one a reconcile with
        ``@tool.reconciler``, call it from a kind with ``await ctx.call(tool, …)``."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"a tool name is 1-64 letters, digits, '_', '-', '.': {name!r}")
        if replay not in ("safe", "unsafe"):
            raise ValueError(f"a tool's replay is 'safe' or 'unsafe', not {replay!r}")
        if name in self._tools:
            raise ValueError(f"tool {name!r} is registered already")

        def register(fn: Callable) -> Tool:
            desc = description
            if desc is None and fn.__doc__:
                desc = inspect.cleandoc(fn.__doc__).split("\n\n")[0].replace("\n", " ")
            tool = Tool(name, fn, replay, desc)
            self._tools[name] = tool
            return tool

        return register

    def tools(self) -> List[Tool]:
        return list(self._tools.values())

    def kinds(self) -> List[KindDef]:
        return list(self._kinds.values())

    def manifest(self) -> dict:
        return {
            "protocol": PROTOCOL,
            "service": self.name,
            "kinds": [k.manifest() for k in self._kinds.values()],
            "tools": [t.manifest() for t in self._tools.values()],
        }

    # --- the step protocol ----------------------------------------------------------------------

    async def invoke_async(self, request: Any, *, _unsafe_override: Optional[Callable] = None,
                           _dry: bool = False) -> dict:
        """Answers one step protocol request (already verified): replays the kind against the
        journal and returns the answer. Raises :class:`BadRequest` for a request that is not one."""
        req = _check_request(request)
        op = req["operation"]
        session = req["session"]
        journal = req["journal"]
        base = journal["base"]
        entries = journal["entries"]
        if base == 0:
            input_value = req.get("input")
            if input_value is None:
                # A later request of the session whose first entry changed: the spec says it
                # carries the input again; if it does not, the session's is the same operation's.
                cached = self.sessions.get(session)
                if cached is not None:
                    input_value = cached[0]
            full = list(entries)
        else:
            cached = self.sessions.get(session)
            if cached is None or len(cached[1]) < base:
                return {"type": "resend"}
            input_value = cached[0]
            full = cached[1][:base] + list(entries)
        self.sessions.put(session, input_value, full)

        kind = self._kinds.get((op["kind"], op["version"]))
        if kind is None:
            served = ", ".join(f"{k} {v}" for k, v in self._kinds) or "nothing"
            return {"type": "error", "class": "non_retryable",
                    "message": f"service {self.name!r} does not serve kind {op['kind']!r} version "
                               f"{op['version']!r} (it serves: {served})"}
        info = OperationInfo(
            id=str(op.get("id", "")), kind=op["kind"], version=op["version"],
            tenant=str(op.get("tenant", "")), attempt=int(op.get("attempt") or 1), session=session,
        )
        ctx = Context(info, full, run=req.get("run"), reconcile=req.get("reconcile"),
                      unsafe_override=_unsafe_override)
        ctx._dry = _dry
        return await _run_kind(kind, ctx, input_value)

    def invoke(self, request: Any) -> dict:
        """:meth:`invoke_async` from synchronous code (not from inside a running event loop)."""
        return asyncio.run(self.invoke_async(request))

    # --- HTTP -----------------------------------------------------------------------------------

    async def handle_http_async(
        self, method: str, path: str, headers: Dict[str, str], body: bytes
    ) -> Tuple[int, List[Tuple[str, str]], bytes]:
        """One HTTP exchange: ``headers`` with lower-case names; returns (status, headers,
        body). ``GET /agentq/manifest`` (not signed) and signed ``POST /agentq/invoke``."""
        path = path.split("?", 1)[0]
        if path == MANIFEST_PATH:
            if method not in ("GET", "HEAD"):
                return _problem(405, "Method Not Allowed", "GET /agentq/manifest")
            data = encode_json(self.manifest())
            return 200, [("content-type", "application/json"), ("content-length", str(len(data)))], data
        if path != INVOKE_PATH:
            return _problem(404, "Not Found", "this service answers GET /agentq/manifest and POST /agentq/invoke")
        if method != "POST":
            return _problem(405, "Method Not Allowed", "POST /agentq/invoke")
        if len(body) > MAX_REQUEST_BYTES:
            return _problem(413, "Payload Too Large", "a request may carry at most 64 MiB")
        if not self._secrets:
            return _problem(401, "Unauthorized",
                            "this service has no secret: AGENTQ_SERVICE_SECRET is not set (start it "
                            "with the secret `agentq services add` printed)")
        msg_id = headers.get("webhook-id")
        try:
            verify(self._secrets, msg_id, headers.get("webhook-timestamp"),
                   headers.get("webhook-signature"), body)
        except Refused as e:
            return _problem(401, "Unauthorized", f"the request's signature does not verify: {e}")
        try:
            request = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            return _problem(400, "Bad Request", f"the body is not JSON: {e}")
        try:
            answer = await self.invoke_async(request)
        except BadRequest as e:
            return _problem(400, "Bad Request", str(e))
        data = encode_answer(answer)
        out = [("content-type", "application/json"), ("content-length", str(len(data)))]
        out.extend(sign_headers(self._secrets[0], str(msg_id), data).items())
        return 200, out, data

    def handle_http(self, method: str, path: str, headers: Dict[str, str], body: bytes):
        """:meth:`handle_http_async` from synchronous code."""
        return asyncio.run(self.handle_http_async(method, path, headers, body))

    def asgi(self) -> Callable:
        """An ASGI application (mount it in FastAPI/Starlette, or run it with any ASGI server)."""
        from .http import asgi_app

        return asgi_app(self)

    def make_server(self, host: str = "127.0.0.1", port: int = 8000):
        """A ``ThreadingHTTPServer`` bound to ``host:port`` (port 0: any free one), not yet
        serving."""
        from .http import make_server

        return make_server(self, host, port)

    def serve(self, host: str = "127.0.0.1", port: int = 8000) -> None:
        """Serves until interrupted, printing ``agentq service NAME listening on
        http://HOST:PORT`` once it accepts connections."""
        server = self.make_server(host, port)
        h, p = server.server_address[:2]
        if not self._secrets:
            print("agentq: AGENTQ_SERVICE_SECRET is not set: every invoke will be refused (401)",
                  file=sys.stderr, flush=True)
        print(f"agentq service {self.name} listening on http://{h}:{p}", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()


def encode_answer(answer: dict) -> bytes:
    """The answer's JSON; one over 4 MiB becomes an error answer saying so."""
    try:
        data = encode_json(answer)
    except (TypeError, ValueError) as e:
        answer = {"type": "error", "class": "non_retryable",
                  "message": f"the answer is not JSON: {error_text(e)}"}
        data = encode_json(answer)
    if len(data) <= MAX_ANSWER_BYTES:
        return data
    t = answer.get("type")
    msg = (f"the {t} answer is {len(data)} bytes; an answer carries at most 4 MiB "
           f"(keep large data outside the journal and pass references)")
    if t == "step":
        small = {"type": "step", "seq": answer.get("seq"), "name": answer.get("name"),
                 "error": {"message": f"step {answer.get('name')}: {msg}", "retryable": False,
                           "no_effect": False}}
    else:
        small = {"type": "error", "class": "non_retryable", "message": msg}
    return encode_json(small)


def _check_request(req: Any) -> dict:
    if not isinstance(req, dict):
        raise BadRequest("a step protocol request is a JSON object")
    if req.get("protocol") != PROTOCOL:
        raise BadRequest(f"this SDK speaks step protocol {PROTOCOL}, the request says {req.get('protocol')!r}")
    op = req.get("operation")
    if not isinstance(op, dict) or not isinstance(op.get("kind"), str) or not isinstance(op.get("version"), str):
        raise BadRequest("operation: an object with kind and version is required")
    if not isinstance(req.get("session"), str) or not req["session"]:
        raise BadRequest("session: a string is required")
    j = req.get("journal")
    if not isinstance(j, dict):
        raise BadRequest("journal: an object with base and entries is required")
    base = j.get("base")
    if isinstance(base, bool) or not isinstance(base, int) or base < 0:
        raise BadRequest("journal.base: a non-negative integer is required")
    entries = j.get("entries")
    if entries is None:
        entries = []
        j["entries"] = entries
    if not isinstance(entries, list):
        raise BadRequest("journal.entries: an array is required")
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise BadRequest(f"journal.entries[{i}]: an object is required")
        seq = e.get("seq")
        if seq is not None and seq != base + i:
            raise BadRequest(f"journal.entries[{i}].seq is {seq}, but its position is {base + i}")
    for d in ("run", "reconcile"):
        v = req.get(d)
        if v is not None and (not isinstance(v, dict) or not isinstance(v.get("seq"), int)
                              or v.get("key") is None):
            raise BadRequest(f"{d}: null or an object with seq and key")
    return req


async def _run_kind(kind: KindDef, ctx: Context, input_value: Any) -> dict:
    args: List[Any] = [ctx]
    if kind.takes_input:
        try:
            args.append(decode(kind.input_type, input_value))
        except InputError as e:
            return {"type": "error", "class": "non_retryable",
                    "message": f"the input does not fit kind {kind.name} version {kind.version}: {e}"}
    try:
        output = await kind.fn(*args)
    except _Stop as stop:
        return ctx._answer or stop.answer
    except NonRetryable as e:
        if ctx._answer is not None:
            return ctx._answer
        return {"type": "error", "class": "non_retryable", "message": str(e) or "NonRetryable"}
    except Exception as e:
        if ctx._answer is not None:
            return ctx._answer
        return {"type": "error", "class": "retryable", "message": error_text(e)}
    if ctx._answer is not None:  # the kind caught the stop and returned anyway
        return ctx._answer
    try:
        return {"type": "output", "output": _jsonable(output)}
    except (TypeError, ValueError) as e:
        return {"type": "error", "class": "non_retryable",
                "message": f"the output of kind {kind.name} is not JSON: {error_text(e)}"}
