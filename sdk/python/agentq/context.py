"""The context a kind's code calls (``ctx.step``, ``ctx.model``, …) and the replay that backs it.

Each invoke runs the kind's coroutine from the top against the journal agentq sent. A call whose
position holds a ``completed`` entry of the same name and kind returns the recorded output; the
first call at a position that is not completed stops the coroutine (by raising
:class:`_Stop`, a ``BaseException`` so that ``except Exception`` in the kind does not swallow
it) and the SDK answers with what that call asks for. See docs/protocol.md.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import inspect
import json
import math
import uuid as _uuid
from typing import Any, Awaitable, Callable, Iterable, List, Optional, Tuple, Union

from .schema import encode_json, parse_datetime

__all__ = [
    "Context",
    "NonRetryable",
    "NoEffect",
    "Signal",
    "ChildOutcome",
    "OperationInfo",
]

Seconds = Union[int, float, _dt.timedelta]


class NonRetryable(Exception):
    """Raised from a kind: the operation fails at once (dead-lettered, class ``non_retryable``).
    Raised from a step's function: the step's error says ``retryable: false``."""


class NoEffect(Exception):
    """Raised from an unsafe step's function: its effect certainly did not happen, so the step
    may run again (``no_effect: true``). Any other failure leaves its outcome unknown, and the
    next run reconciles it."""


class _Stop(BaseException):
    """Stops the kind's coroutine at the first position the journal does not hold. Not an
    ``Exception``: a kind's ``except Exception`` must not swallow it."""

    def __init__(self, answer: dict):
        super().__init__("agentq: the run stops here; agentq resumes it")
        self.answer = answer


@dataclasses.dataclass(frozen=True)
class OperationInfo:
    """The operation a run is for."""

    id: str
    kind: str
    version: str
    tenant: str
    attempt: int
    session: str


class Signal:
    """What ``ctx.wait_for_signal`` returns: the signal's ``payload`` and ``sent_by``, or
    ``timed_out`` when the timeout passed first. ``approved`` is the approval convention
    (``agentq approve``: a payload ``{"approved": true, …}``)."""

    __slots__ = ("payload", "sent_by", "timed_out", "raw")

    def __init__(self, raw: Any):
        raw = raw if isinstance(raw, dict) else {}
        self.raw = raw
        self.timed_out = bool(raw.get("timed_out", False))
        self.payload = raw.get("payload")
        self.sent_by = raw.get("sent_by")

    @property
    def approved(self) -> bool:
        return (not self.timed_out and isinstance(self.payload, dict)
                and self.payload.get("approved") is True)

    def __getitem__(self, key: str) -> Any:
        return {"payload": self.payload, "sent_by": self.sent_by, "timed_out": self.timed_out}[key]

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def to_json(self) -> dict:
        return dict(self.raw)

    def __repr__(self) -> str:
        if self.timed_out:
            return "Signal(timed_out=True)"
        return f"Signal(sent_by={self.sent_by!r}, payload=…)"


class ChildOutcome:
    """One child's outcome, as ``ctx.join`` returns it."""

    __slots__ = ("op_id", "kind", "status", "result", "error_class", "error_message", "raw")

    def __init__(self, raw: dict):
        raw = raw if isinstance(raw, dict) else {}
        self.raw = raw
        self.op_id = raw.get("op_id")
        self.kind = raw.get("kind")
        self.status = raw.get("status")
        self.result = raw.get("result")
        self.error_class = raw.get("error_class")
        self.error_message = raw.get("error_message")

    @property
    def succeeded(self) -> bool:
        return self.status == "succeeded"

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def to_json(self) -> dict:
        return dict(self.raw)

    def __repr__(self) -> str:
        return f"ChildOutcome(op_id={self.op_id!r}, kind={self.kind!r}, status={self.status!r})"


def _seconds(value: Seconds, what: str) -> int:
    if isinstance(value, _dt.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise TypeError(f"{what} must be a number of seconds or a timedelta")
    if value < 0:
        raise ValueError(f"{what} must not be negative")
    return int(math.ceil(value))


def error_text(e: BaseException) -> str:
    """``TypeName: message`` (no traceback)."""
    msg = str(e)
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


async def _call(fn: Callable, *args: Any) -> Any:
    out = fn(*args)
    if inspect.isawaitable(out):
        out = await out
    return out


def _jsonable(value: Any) -> Any:
    return json.loads(encode_json(value))


def normalize_reconciled(result: Any) -> Tuple[bool, Any]:
    """A reconcile function's result: ``None`` or ``False`` (the effect did not happen), or
    ``(happened, output)``."""
    if result is None or result is False:
        return False, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        return result[0], (result[1] if result[0] else None)
    raise TypeError(
        "a reconcile function returns None (the effect did not happen) or a tuple "
        f"(happened: bool, output), not {type(result).__name__}"
    )


class Tool:
    """A tool of a service: a named effect with its replay policy (``safe``: repeating a call is
    harmless; ``unsafe``: it must happen once) and, for an unsafe one, how to ask whether a call
    happened. Made by :meth:`agentq.Service.tool`, listed in the service's manifest (``agentq
    services list`` shows them) and called from a kind with :meth:`Context.call`.

    An unsafe tool's function takes the step's idempotency key first, then the call's
    arguments; its reconcile, registered with :meth:`Tool.reconciler`, takes the same and
    returns ``None`` (did not happen) or ``(True, output)``. A safe tool's function takes the
    arguments only."""

    def __init__(self, name: str, fn: Callable, replay: str, description: Optional[str]):
        self.name = name
        self.fn = fn
        self.replay = replay
        self.description = description or ""
        self.reconcile: Optional[Callable] = None

    def reconciler(self, fn: Callable) -> Callable:
        """Registers ``fn(key, *args, **kwargs)`` as the tool's reconcile."""
        if self.replay != "unsafe":
            raise TypeError(f"tool {self.name!r} is safe: only an unsafe tool has a reconcile")
        self.reconcile = fn
        return fn

    def manifest(self) -> dict:
        return {"name": self.name, "description": self.description, "replay": self.replay,
                "reconcile": self.reconcile is not None}

    def __repr__(self) -> str:
        return f"Tool({self.name!r}, replay={self.replay!r})"


class Context:
    """What a kind's code calls. Every method is a journaled step; call them one at a time (not
    concurrently, e.g. not under ``asyncio.gather``): positions are given in call order."""

    def __init__(
        self,
        info: OperationInfo,
        journal: List[dict],
        run: Optional[dict] = None,
        reconcile: Optional[dict] = None,
        unsafe_override: Optional[Callable] = None,
    ):
        self.info = info
        self._journal = journal
        self._run = run
        self._reconcile = reconcile
        self._override = unsafe_override
        self._seq = 0
        self._answer: Optional[dict] = None
        self._in_step = False
        self._dry = False  # replay_journal: stop at the first open position, run nothing

    # --- what the kind sees -------------------------------------------------------------------

    @property
    def op_id(self) -> str:
        return self.info.id

    @property
    def tenant(self) -> str:
        return self.info.tenant

    @property
    def attempt(self) -> int:
        return self.info.attempt

    @property
    def replaying(self) -> bool:
        """Whether the next call's position is journaled as completed already."""
        e = self._entry(self._seq)
        return e is not None and e.get("status") == "completed"

    # --- the machinery --------------------------------------------------------------------------

    def _entry(self, seq: int) -> Optional[dict]:
        return self._journal[seq] if seq < len(self._journal) else None

    def _stop(self, answer: dict) -> "_Stop":
        if self._answer is None:
            self._answer = answer
        return _Stop(self._answer)

    def _next(self, name: str, kind: str) -> Tuple[int, Optional[dict]]:
        """Takes the next position: returns ``(seq, entry)`` where ``entry`` is the completed
        entry to replay, or ``None`` when the call must be asked for (stopping is the caller's)."""
        self._check_callable(kind if kind != "custom" else "step", name)
        self._pass_patch_markers()
        seq = self._seq
        self._seq += 1
        entry = self._entry(seq)
        if entry is not None:
            jn, jk = entry.get("name"), entry.get("kind")
            if jn != name or jk != kind:
                raise self._stop({
                    "type": "error",
                    "class": "nondeterminism",
                    "message": f"step {seq}: the journal recorded {jn} ({jk}), the code asked for "
                               f"{name} ({kind})",
                })
            if entry.get("status") == "completed":
                return seq, entry
        return seq, None

    def _check_callable(self, call: str, name: str) -> None:
        """Refuses a context call the run may not make now: after it stopped (the kind caught the
        stop and went on: stop again, with the first answer), or inside a step's function."""
        if self._answer is not None:
            raise _Stop(self._answer)
        if self._in_step:
            raise RuntimeError(
                f"ctx.{call}({name!r}) was called inside a step's function: a step's function "
                "must not call the context"
            )

    def _pass_patch_markers(self) -> None:
        """Passes over patch markers at the next position: a ``patched`` call removed from the
        code (its old path deleted once no operation needed it) leaves its marker behind, and
        nothing asks for it (as the worker's runner does)."""
        while True:
            entry = self._entry(self._seq)
            if entry is None or entry.get("kind") != "patch" or entry.get("status") != "completed":
                return
            self._seq += 1

    async def _run_fn(self, fn: Callable, *args: Any) -> Any:
        self._in_step = True
        try:
            return await _call(fn, *args)
        finally:
            self._in_step = False

    def _output_or_stop(self, seq: int, name: str, raw: Any) -> Any:
        try:
            return _jsonable(raw)
        except (TypeError, ValueError) as e:
            raise self._stop(_step_error(
                seq, name, f"the output of step {name} is not JSON: {error_text(e)}", retryable=False))

    # --- steps ----------------------------------------------------------------------------------

    async def step(self, name: str, fn: Callable[[], Any]) -> Any:
        """A safe step: ``fn()`` (sync or async) runs here, once per completed journal entry; a
        replay returns its recorded output. Safe means running it again after a crash is
        harmless (a read, a computation, an idempotent write)."""
        seq, entry = self._next(name, "custom")
        if entry is not None:
            return entry.get("output")
        if self._dry:
            raise self._stop({"type": "step", "seq": seq, "name": name})
        try:
            raw = await self._run_fn(fn)
        except NonRetryable as e:
            raise self._stop(_step_error(seq, name, str(e) or "NonRetryable", retryable=False))
        except NoEffect as e:
            raise self._stop(_step_error(seq, name, error_text(e), no_effect=True))
        except Exception as e:
            raise self._stop(_step_error(seq, name, error_text(e)))
        output = self._output_or_stop(seq, name, raw)
        raise self._stop({"type": "step", "seq": seq, "name": name, "output": output})

    async def unsafe_step(
        self,
        name: str,
        fn: Callable[[str], Any],
        reconcile: Optional[Callable[[str], Any]] = None,
    ) -> Any:
        """An unsafe step: an effect that must never happen twice (a payment, an email).

        ``fn(key)`` runs at most once per journal entry, with ``key`` the step's idempotency key
        (stable across crashes: pass it to the outside system). If a crash leaves the step's
        outcome unknown, agentq asks ``reconcile(key)`` instead of running it again; it returns
        ``None`` when the effect did not happen (the step then runs) or ``(True, output)`` when
        it did (``output`` is journaled as the step's). Without a reconcile such a step stops
        the operation as ``unknown_side_effect`` for a human. Raise :class:`NoEffect` from
        ``fn`` when the effect certainly did not happen."""
        seq, entry = self._next(name, "custom")
        if entry is not None:
            return entry.get("output")
        if self._dry:
            raise self._stop({"type": "unsafe", "seq": seq, "name": name, "reconcile": reconcile is not None})
        if self._override is not None:
            fn, reconcile = self._override(name, fn, reconcile)
        run = self._run if isinstance(self._run, dict) and self._run.get("seq") == seq else None
        rec = (self._reconcile if isinstance(self._reconcile, dict)
               and self._reconcile.get("seq") == seq else None)
        if run is not None:
            key = str(run.get("key"))
            try:
                raw = await self._run_fn(fn, key)
            except NoEffect as e:
                raise self._stop(_step_error(seq, name, error_text(e), no_effect=True))
            except NonRetryable as e:
                raise self._stop(_step_error(seq, name, str(e) or "NonRetryable", retryable=False))
            except Exception as e:
                raise self._stop(_step_error(seq, name, error_text(e)))
            output = self._output_or_stop(seq, name, raw)
            raise self._stop({"type": "step", "seq": seq, "name": name, "output": output})
        if rec is not None:
            if reconcile is None:
                raise self._stop({"type": "reconciled", "seq": seq, "unsupported": True})
            key = str(rec.get("key"))
            try:
                happened, output = normalize_reconciled(await self._run_fn(reconcile, key))
                output = _jsonable(output) if happened else None
            except Exception as e:
                raise self._stop({
                    "type": "error",
                    "class": "retryable",
                    "message": f"the reconcile of step {name} failed: {error_text(e)}",
                })
            if happened:
                raise self._stop({"type": "reconciled", "seq": seq, "happened": True, "output": output})
            raise self._stop({"type": "reconciled", "seq": seq, "happened": False})
        raise self._stop({"type": "unsafe", "seq": seq, "name": name, "reconcile": reconcile is not None})

    async def call(self, tool: "Tool", *args: Any, **kwargs: Any) -> Any:
        """Calls a tool of the service (:meth:`agentq.Service.tool`) as a step named after it:
        a safe tool as :meth:`step`, an unsafe one as :meth:`unsafe_step` with its reconcile.
        The arguments must be what the code would pass again on a replay."""
        if not isinstance(tool, Tool):
            raise TypeError(f"ctx.call takes a Tool (from @svc.tool), not {type(tool).__name__}")
        if tool.replay == "safe":
            return await self.step(tool.name, lambda: tool.fn(*args, **kwargs))
        reconcile = tool.reconcile
        return await self.unsafe_step(
            tool.name,
            lambda key: tool.fn(key, *args, **kwargs),
            reconcile=(lambda key: reconcile(key, *args, **kwargs)) if reconcile else None,
        )

    async def model(self, name: str, request: Optional[dict] = None, **fields: Any) -> dict:
        """A model call through agentq's gate (breaker, limits, budgets, usage): ``request`` is
        ``{"messages": [...], "model"?, "max_tokens"?, "temperature"?, "tools"?, "tool_choice"?}``
        (keyword arguments are merged into it). Returns the response dict (``content``,
        ``model``, ``finish_reason``, ``usage``, ``tool_calls``?)."""
        req = dict(request or {})
        req.update(fields)
        if not isinstance(req.get("messages"), list):
            raise TypeError("ctx.model needs a request with a list of messages")
        seq, entry = self._next(name, "model")
        if entry is not None:
            return entry.get("output")
        raise self._stop({"type": "model", "seq": seq, "name": name, "request": _jsonable(req)})

    async def sleep(self, seconds: Seconds) -> None:
        """A durable sleep (whole seconds, rounded up): the operation parks ``sleeping`` and a
        later run resumes after it."""
        secs = _seconds(seconds, "ctx.sleep's duration")
        seq, entry = self._next("sleep", "sleep")
        if entry is not None:
            return None
        raise self._stop({"type": "sleep", "seq": seq, "seconds": secs})

    async def wait_for_signal(self, name: str, timeout: Seconds) -> Signal:
        """Waits (parked ``waiting``, holding no worker) for the signal ``name`` (``agentq signal
        OP NAME``; ``agentq approve`` sends ``approval``) or until ``timeout`` seconds pass."""
        secs = _seconds(timeout, "ctx.wait_for_signal's timeout")
        seq, entry = self._next(f"signal:{name}", "signal")
        if entry is not None:
            return Signal(entry.get("output"))
        raise self._stop({"type": "signal", "seq": seq, "name": name, "timeout_seconds": secs})

    async def spawn(self, kind: str, input: Any = None) -> str:
        """Starts a child operation of ``kind`` (checked as an enqueue is); returns its id."""
        seq, entry = self._next(f"spawn:{kind}", "spawn")
        if entry is not None:
            return str(entry.get("output"))
        raise self._stop({"type": "spawn", "seq": seq, "kind": kind, "input": _jsonable(input)})

    async def join(self, children: Iterable[Union[str, _uuid.UUID]]) -> List[ChildOutcome]:
        """Parks until every named child finished; returns their outcomes in the order asked
        (a dead or cancelled child is an outcome, not an error)."""
        ids: List[str] = []
        for c in children:
            s = str(c)
            if s not in ids:
                ids.append(s)
        seq, entry = self._next("join", "join")
        if entry is not None:
            return [ChildOutcome(o) for o in (entry.get("output") or [])]
        raise self._stop({"type": "join", "seq": seq, "children": ids})

    async def patched(self, change_id: str) -> bool:
        """Whether this execution takes the new path of a change made without a new version:
        ``if await ctx.patched("fetch-before-review"): ...``. True on a first execution of this
        point (agentq journals a ``patch`` marker named ``change_id`` there) and on replays of
        journals recorded with the marker; False when replaying a journal recorded before the
        change (another step recorded here: the old path replays it). Keep both paths until
        ``agentq versions`` shows no operation older than the change (docs/versions.md)."""
        self._check_callable("patched", change_id)
        seq = self._seq
        while True:
            entry = self._entry(seq)
            if entry is None or entry.get("status") == "failed":
                break
            if entry.get("kind") == "patch" and entry.get("name") == change_id:
                self._seq = seq + 1
                return True
            if entry.get("kind") == "patch":
                seq += 1  # another change's marker, its call removed or moved: look past it
                continue
            return False  # recorded before the change: the old path
        self._seq = seq + 1
        raise self._stop({"type": "patch", "seq": seq, "name": change_id})

    async def now(self) -> _dt.datetime:
        """The worker's clock, journaled (an aware UTC datetime)."""
        seq, entry = self._next("now", "now")
        if entry is not None:
            return parse_datetime(str(entry.get("output")))
        raise self._stop({"type": "now", "seq": seq})

    async def uuid(self) -> _uuid.UUID:
        """A random UUID, journaled."""
        seq, entry = self._next("uuid", "now")
        if entry is not None:
            return _uuid.UUID(str(entry.get("output")))
        raise self._stop({"type": "uuid", "seq": seq})


def _step_error(seq: int, name: str, message: str, retryable: bool = True,
                no_effect: bool = False) -> dict:
    return {
        "type": "step",
        "seq": seq,
        "name": name,
        "error": {"message": message, "retryable": retryable, "no_effect": no_effect},
    }
