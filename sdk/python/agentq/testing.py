"""The replay tester: checks a kind against every crash it can meet, in memory.

:meth:`Tester.run` plays agentq's worker through the step protocol (the same handler the HTTP
servers call, signing bypassed): it runs the kind to its end against a scripted model, scripted
signals and child outcomes, journaling every answer as agentq would, and records every durable
write and every unsafe effect. Then it crashes the run at every one of those points (including
right after an unsafe step's function ran and before its output was journaled). Each crash
point is an operation of its own, with a new operation id (so its own idempotency keys, which
are derived from the operation id, the step's position and its name): the tester runs it for
real up to the crash point, drops everything durable after it (the run stops at its next
step), then resumes it, with the same id and a new session, from what the crash left: the
journal and the effects that happened. An outside system a real step reaches therefore holds
only that timeline's effects, under that timeline's keys, and what a real reconcile answers can
be checked against what happened in it. A :class:`Report` lists what went wrong:

- **nondeterminism**: a run asked for other steps than the first (a name or a branch that
  depends on something the journal does not hold: the clock, a random number, a global);
- **ran again**: an unsafe step's function ran twice for one idempotency key;
- **no reconcile**: an unsafe step a crash interrupted has no reconcile, so the operation would
  stop as ``unknown_side_effect`` and wait for a human;
- **wrong reconcile**: an unsafe step's reconcile answered that the effect happened when, in
  its timeline, the crash came before the effect (the step would be recorded as done and the
  effect never made), or answered with another output than the effect returned;
- **failed**: a run ended otherwise than the first (or the first ended retryable/protocol).

The same checks as agentq's Rust tester (``agentq::testing``). What it cannot see: an effect
made outside a step (nothing records it, so nothing finds it happening twice), and whether the
real outside system answers as the stand-in a test points a real reconcile at. When an unsafe
step's function raised (other than :class:`~agentq.NoEffect`), the tester cannot know whether its
effect happened, so a reconcile's "happened" for that key is not judged.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime as _dt
import json
import uuid as _uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from .service import Service, encode_answer

__all__ = ["Tester", "Report", "Violation", "End", "ChildEnd", "Check", "replay_journal",
           "JournalReplay"]

ATTEMPTS = 5
MAX_PARKS = 1000
MAX_REQUESTS = 200_000


class Check:
    NONDETERMINISM = "nondeterminism"
    RAN_AGAIN = "ran again"
    NO_RECONCILE = "no reconcile"
    WRONG_RECONCILE = "wrong reconcile"
    FAILED = "failed"


@dataclasses.dataclass
class End:
    """How a run ended: ``succeeded`` with ``output``, or ``failed`` with ``error_class`` and
    ``message``."""

    status: str
    output: Any = None
    error_class: Optional[str] = None
    message: Optional[str] = None

    @property
    def class_name(self) -> str:
        return "succeeded" if self.status == "succeeded" else str(self.error_class)

    def __str__(self) -> str:
        if self.status == "succeeded":
            return "succeeded"
        return f"failed ({self.error_class}: {self.message})"


def _succeeded(output: Any) -> End:
    return End("succeeded", output=output)


def _failed(cls: str, message: str) -> End:
    return End("failed", error_class=cls, message=message)


@dataclasses.dataclass
class Violation:
    check: str
    seq: Optional[int]
    step: str
    at: str
    message: str

    def __str__(self) -> str:
        if self.seq is not None:
            return f"[{self.check}] step {self.seq} ({self.step}) at {self.at}: {self.message}"
        return f"[{self.check}] at {self.at}: {self.message}"


@dataclasses.dataclass
class Report:
    """What :meth:`Tester.run` found."""

    outcome: End
    steps: List[Tuple[int, str, str]]
    crash_points: int = 0
    violations: List[Violation] = dataclasses.field(default_factory=list)

    def note(self, v: Violation) -> None:
        if not any(o.check == v.check and o.seq == v.seq and o.step == v.step for o in self.violations):
            self.violations.append(v)

    @property
    def output(self) -> Any:
        """The first run's output (``None`` unless it succeeded)."""
        return self.outcome.output if self.outcome.status == "succeeded" else None

    @property
    def ok(self) -> bool:
        """Nothing went wrong: no problem found, and the first run did not fail (a kind meant
        to fail is checked with ``outcome`` and ``found``)."""
        return not self.violations and self.outcome.status != "failed"

    def is_ok(self) -> bool:
        return self.ok

    def found(self, check: str) -> List[Violation]:
        return [v for v in self.violations if v.check == check]

    def assert_ok(self) -> None:
        """Raises ``AssertionError`` with the report unless nothing went wrong (``ok``: a failed
        run raises too)."""
        if not self.ok:
            raise AssertionError(str(self))

    def __str__(self) -> str:
        n = len(self.violations)
        lines = [f"replay tester: {len(self.steps)} steps, {self.outcome}, {self.crash_points} crash "
                 f"points replayed, {n} {'problem' if n == 1 else 'problems'}"]
        lines += [f"  {v}" for v in self.violations]
        return "\n".join(lines)


class ChildEnd:
    """How a spawned child ends in a test."""

    def __init__(self, status: str, result: Any = None, error_class: Optional[str] = None,
                 error_message: Optional[str] = None):
        self.status, self.result = status, result
        self.error_class, self.error_message = error_class, error_message

    @classmethod
    def succeeded(cls, result: Any = None) -> "ChildEnd":
        return cls("succeeded", result=result)

    @classmethod
    def dead(cls, error_class: str = "non_retryable", message: str = "failed") -> "ChildEnd":
        return cls("dead", error_class=error_class, error_message=message)

    @classmethod
    def cancelled(cls) -> "ChildEnd":
        return cls("cancelled")

    def outcome(self, op_id: str, kind: str) -> dict:
        out = {"op_id": op_id, "kind": kind, "status": self.status}
        if self.status == "succeeded":
            out["result"] = self.result
        if self.error_class is not None:
            out["error_class"] = self.error_class
        if self.error_message is not None:
            out["error_message"] = self.error_message
        return out


@dataclasses.dataclass
class _Fake:
    respond: Callable[[str], Any]
    reconciles: bool


def _response(r: Any) -> dict:
    if isinstance(r, str):
        r = {"content": r}
    out = dict(r)
    out.setdefault("content", "")
    out.setdefault("model", "replay-tester")
    out.setdefault("finish_reason", "stop")
    out.setdefault("usage", {"prompt_tokens": 0, "completion_tokens": 0})
    return out


def _echo(request: dict, n: int) -> dict:
    content = ""
    for m in request.get("messages") or []:
        if isinstance(m, dict) and m.get("role") == "user":
            c = m.get("content")
            content = c if isinstance(c, str) else json.dumps(c)
    return _response(content)


def _now_text() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _key(op_id: str, seq: int, name: str) -> str:
    """An unsafe step's idempotency key, as agentq derives it."""
    return f"{op_id}/{seq}/{name}"


def _json_text(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


class _Memory:
    """One run's journal, the effects that happened (by key), and what it saw.

    A recording run (``record``: the first run, or a timeline's run up to its crash point) keeps
    its timeline of durable writes and effects; with ``crash_after``, it crashes once that
    timeline holds so many events: every write after it is lost and the run stops before its
    next request. A resumed run (not recording) checks what a reconcile answers against
    ``happened``, the effects its timeline made before the crash (unless ``check_reconciles`` is
    off); ``unsure`` holds the keys whose function raised after it may have made its effect (the
    tester cannot know whether it happened, so a reconcile's "happened" for one is not judged).
    """

    def __init__(self, journal: List[dict], happened: Dict[str, Any], fakes: Dict[str, _Fake],
                 record: bool, crash_after: Optional[int] = None, check_reconciles: bool = True,
                 unsure: Optional[set] = None):
        self.journal = journal
        self.happened = happened
        self.fakes = fakes
        self.record = record
        self.crash_after = crash_after
        self.crashed = crash_after == 0
        self.check_reconciles = check_reconciles
        self.unsure = set(unsure or ())
        self.timeline: List[Tuple[str, Any, Any, str]] = []
        self.violations: List[Violation] = []

    def override(self, name: str, fn: Callable, reconcile: Optional[Callable]):
        fake = self.fakes.get(name)
        if fake is None:
            return fn, reconcile

        def fake_reconcile(key: str):
            if key in self.happened:
                return True, self.happened[key]
            return None

        return fake.respond, (fake_reconcile if fake.reconciles else None)

    def _crash_if_due(self) -> None:
        if self.crash_after is not None and len(self.timeline) >= self.crash_after:
            self.crashed = True

    def write(self, seq: int, entry: dict) -> None:
        if self.crashed:  # lost with the crash
            return
        entry = dict(entry, seq=seq)
        self.journal[seq:] = [entry]
        if self.record:
            self.timeline.append(("durable", copy.deepcopy(self.journal), None,
                                  f"after step {seq} ({entry['name']}) was written {entry['status']}"))
            self._crash_if_due()

    def effect(self, key: str, seq: int, step: str, output: Any) -> None:
        if self.crashed:  # nothing runs after the crash (the driver stops before asking)
            return
        if key in self.happened:
            self.violations.append(Violation(
                Check.RAN_AGAIN, seq, step, "",
                "the unsafe step's function ran again for the same idempotency key after a crash: "
                "its effect would happen twice (its reconcile must say the effect happened when it "
                "did)"))
        self.happened[key] = output
        if self.record:
            self.timeline.append(("effect", key, output,
                                  f"after the effect of {step}, before its journal write"))
            self._crash_if_due()

    def unknown(self, key: str) -> None:
        """The function of the step with ``key`` raised: its effect may have happened."""
        if not self.crashed:
            self.unsure.add(key)

    def reconciled(self, key: str, seq: int, step: str, output: Any) -> None:
        """A reconcile answered that the effect of the step with ``key`` happened, with
        ``output``: checked against what happened in this timeline before its crash."""
        if self.record or not self.check_reconciles:
            return
        if key not in self.happened:
            if key in self.unsure:
                return
            message = ("its reconcile answered that the effect happened, but in this timeline the "
                       "crash came before it: the step would be recorded as done and the effect "
                       "never made (a reconcile must look the effect up by the idempotency key)")
        elif _json_text(output) != _json_text(self.happened[key]):
            message = ("its reconcile answered with another output than the effect's: "
                       f"{_json_text(output)} where the effect returned "
                       f"{_json_text(self.happened[key])}")
        else:
            return
        self.violations.append(Violation(Check.WRONG_RECONCILE, seq, step, "", message))

    def left(self) -> Tuple[List[dict], Dict[str, Any], set]:
        """What a crash left: the journal, the effects that happened, the unsure keys."""
        return copy.deepcopy(self.journal), copy.deepcopy(self.happened), set(self.unsure)

    def first_open(self) -> int:
        for i, e in enumerate(self.journal):
            if e.get("status") != "completed":
                return i
        return len(self.journal)


def _completed(journal: List[dict]) -> List[Tuple[int, str, str]]:
    return [(e["seq"], e["name"], e["kind"]) for e in journal if e.get("status") == "completed"]


class Tester:
    """Runs ``kind`` of ``service`` with ``input``, then, for every crash point of that run, an
    operation of its own (a new id, so its own idempotency keys) up to the crash point and again
    from what the crash left (see the module docs). Configure it with the chained methods, then
    :meth:`run`."""

    def __init__(self, service: Service, kind: str, input: Any = None, *,
                 version: Optional[str] = None, tenant: str = "test"):
        self.service = service
        self.kind = kind
        self.input = input
        self.version_ = version
        self.tenant = tenant
        self._model: Callable[[dict, int], dict] = _echo
        self._signals: Dict[str, List[dict]] = {}
        self._children_fn: Optional[Callable[[str, Any], ChildEnd]] = None
        self._child_ends: List[ChildEnd] = []
        self._fakes: Dict[str, _Fake] = {}

    def version(self, version: str) -> "Tester":
        """Tests that version of the kind (default: the newest the service registers)."""
        self.version_ = str(version)
        return self

    def model(self, replies: Optional[List[Any]] = None,
              fn: Optional[Callable[[dict, int], Any]] = None) -> "Tester":
        """What the model answers: ``replies`` in order (the n-th model step of the operation gets
        the n-th; past the end, the last; each a response dict or a content string), or
        ``fn(request, n)``. Default: it echoes the last user message."""
        if fn is not None:
            self._model = lambda req, n: _response(fn(req, n))
        elif replies is not None:
            rs = [_response(r) for r in replies]
            if not rs:
                raise ValueError("model(replies=[]) needs at least one reply")
            self._model = lambda req, n: copy.deepcopy(rs[min(n, len(rs) - 1)])
        return self

    def signal(self, name: str, payload: Any = None, sent_by: str = "tester") -> "Tester":
        """The waits on ``name`` get these signals in order; a wait with none left times out."""
        self._signals.setdefault(name, []).append({"payload": payload, "sent_by": sent_by})
        return self

    def approve(self, by: str = "tester", reason: Optional[str] = None) -> "Tester":
        """``agentq approve``: the signal ``approval`` with ``{"approved": true, …}``."""
        return self.signal("approval", {"approved": True, "by": by, "reason": reason}, sent_by=by)

    def reject(self, by: str = "tester", reason: Optional[str] = None) -> "Tester":
        """``agentq reject``: the signal ``approval`` with ``{"approved": false, …}``."""
        return self.signal("approval", {"approved": False, "by": by, "reason": reason}, sent_by=by)

    def child(self, end: ChildEnd) -> "Tester":
        """The next spawned child (in spawn order) ends so; children past the list succeed with
        null, unless :meth:`children` decides."""
        self._child_ends.append(end)
        return self

    def children(self, fn: Callable[[str, Any], ChildEnd]) -> "Tester":
        """How each spawned child ends, from its kind and input."""
        self._children_fn = fn
        return self

    def fake_unsafe(self, name: str, respond: Callable[[str], Any], reconciles: bool = True) -> "Tester":
        """Replaces the unsafe step ``name``'s function with ``respond(key)`` while testing; with
        ``reconciles``, its reconcile says the effect happened (with what ``respond`` returned)
        exactly when it happened in the timeline before the crash the tester simulates (without,
        the step has no reconcile). Without a fake, the real function and reconcile run: each
        crash point is an operation of its own with keys of its own, so a stand-in of the outside
        system that keeps effects by key holds only that timeline's, and the reconcile's answers
        are checked against them (``wrong reconcile``)."""
        self._fakes[name] = _Fake(respond, reconciles)
        return self

    # --- running --------------------------------------------------------------------------------

    def run(self) -> Report:
        """:meth:`run_async` from synchronous code."""
        return asyncio.run(self.run_async())

    async def run_async(self) -> Report:
        versions = sorted((k.version for k in self.service.kinds() if k.name == self.kind),
                          key=_natural)
        if not versions:
            return _broken(f"kind {self.kind!r} is not served by service {self.service.name!r}")
        version = self.version_ or versions[-1]
        if version not in versions:
            return _broken(f"kind {self.kind!r} has no version {version!r} (it has {', '.join(versions)})")
        op_id = str(_uuid.uuid4())
        children: Dict[str, Tuple[str, Any, int]] = {}

        first = _Memory([], {}, self._fakes, record=True)
        ended = await self._drive(op_id, version, first, children)
        report = Report(outcome=ended, steps=[(e["seq"], e["name"], e["kind"]) for e in first.journal])
        for v in first.violations:
            v.at = "the first run"
            report.note(v)
        if ended.status == "failed":
            if ended.error_class == "nondeterminism":
                report.note(Violation(Check.NONDETERMINISM, None, "", "the first run", ended.message or ""))
            elif ended.error_class != "non_retryable":
                report.note(Violation(Check.FAILED, None, "", "the first run",
                                      f"the operation ended {ended.error_class}: {ended.message}"))
        expected = _completed(first.journal)

        for n, (journal, happened, events, after) in enumerate(_crash_points(first.timeline)):
            report.crash_points += 1
            label = f"crash point {n + 1} ({after})"
            # Each timeline is an operation of its own (a new id, so keys of its own), run for
            # real up to its crash point: the outside systems its effects reach hold this
            # timeline's effects under its own keys, so what a reconcile answers can be checked
            # against what happened in it.
            timeline_id = str(_uuid.uuid4())
            timeline_children: Dict[str, Tuple[str, Any, int]] = {}
            prefix = _Memory([], {}, self._fakes, record=True, crash_after=events)
            await self._drive(timeline_id, version, prefix, timeline_children)
            if prefix.crashed:
                run_id, run_children = timeline_id, timeline_children
                left_journal, left_happened, unsure = prefix.left()
                mem = _Memory(left_journal, left_happened, self._fakes, record=False, unsure=unsure)
            else:
                # It ended before its crash point: it took another path than the first run (the
                # comparison below says why). Resume from the first run's journal instead, under
                # the first run's keys; outside systems hold the first run's effects whatever the
                # crash, so reconciles are not judged here.
                run_id, run_children = op_id, children
                mem = _Memory(copy.deepcopy(journal), dict(happened), self._fakes, record=False,
                              check_reconciles=False)
            again = await self._drive(run_id, version, mem, run_children)
            for v in mem.violations:
                v.at = label
                report.note(v)
            if again.status == "failed" and again.error_class == "unknown_side_effect":
                row = next((e for e in mem.journal if e.get("status") == "unknown"), None)
                report.note(Violation(
                    Check.NO_RECONCILE, row["seq"] if row else None, row["name"] if row else "", label,
                    "an unsafe step a crash interrupted cannot be reconciled: the operation would stop "
                    "as unknown_side_effect and wait for a human (give it a reconcile that asks the "
                    "outside system by the idempotency key, or make the step safe if repeating it is "
                    "harmless)"))
                continue
            if again.status == "failed" and again.error_class == "nondeterminism":
                report.note(Violation(Check.NONDETERMINISM, None, "", label, again.message or ""))
                continue
            got = _completed(mem.journal)
            if got != expected:
                diff = next(((a, b) for a, b in zip(expected, got) if a != b), None)
                if diff is not None:
                    seq, was, now = diff[0][0], f"{diff[0][1]} ({diff[0][2]})", f"{diff[1][1]} ({diff[1][2]})"
                else:
                    k = min(len(expected), len(got))
                    name = lambda s: f"{s[k][1]} ({s[k][2]})" if k < len(s) else "nothing"  # noqa: E731
                    seq, was, now = k, name(expected), name(got)
                report.note(Violation(
                    Check.NONDETERMINISM, seq, was, label,
                    f"step {seq} was {was} in the first run but {now} after this crash: the steps "
                    "depend on something the journal does not hold (the clock, a random number, a "
                    "global); take it from a step (ctx.now, ctx.uuid, ctx.step)"))
            if again.class_name != ended.class_name:
                report.note(Violation(Check.FAILED, None, "", label,
                                      f"the first run {ended} but this one {again}"))
        return report

    def _child_end(self, index: int, kind: str, input: Any) -> ChildEnd:
        if index < len(self._child_ends):
            return self._child_ends[index]
        if self._children_fn is not None:
            return self._children_fn(kind, input)
        return ChildEnd.succeeded(None)

    async def _drive(self, op_id: str, version: str, mem: _Memory,
                     children: Dict[str, Tuple[str, Any, int]]) -> End:
        """Runs the operation ``op_id`` from ``mem``'s journal to its end, through parks and
        retries, as agentq's workers and scheduler would (each claim a new session); a run with
        a crash point stops once it has reached it (``End("crashed")``)."""
        attempt, parks, requests = 1, 0, 0
        while True:
            session = str(_uuid.uuid4())
            sent: Optional[List[dict]] = None
            directive: Optional[Tuple[str, int]] = None
            resent = False
            next_claim = None  # "retry" | "park"
            while next_claim is None:
                if mem.crashed:  # a run up to its crash point stops there
                    return End("crashed")
                requests += 1
                if requests > MAX_REQUESTS:
                    return _failed("tester", f"more than {MAX_REQUESTS} requests")
                if sent is None:
                    base, entries, inp = 0, mem.journal, self.input
                else:
                    base = 0
                    while base < len(sent) and base < len(mem.journal) and sent[base] == mem.journal[base]:
                        base += 1
                    entries, inp = mem.journal[base:], (self.input if base == 0 else None)
                request = {
                    "protocol": 1,
                    "operation": {"id": op_id, "kind": self.kind, "version": version,
                                  "tenant": self.tenant, "attempt": attempt},
                    "session": session,
                    "input": inp,
                    "journal": {"base": base, "entries": entries[:] if sent is not None else entries},
                    "run": None,
                    "reconcile": None,
                }
                if directive is not None:
                    what, dseq = directive
                    request[what] = {"seq": dseq, "key": _key(op_id, dseq, mem.journal[dseq]["name"])}
                wire = json.loads(json.dumps(request))
                sent = copy.deepcopy(mem.journal)
                raw = await self.service.invoke_async(wire, _unsafe_override=mem.override)
                answer = json.loads(encode_answer(raw))
                t = answer.get("type")
                if t == "resend":
                    if resent:
                        return _failed("protocol", "the service answered resend to a whole journal")
                    resent, sent = True, None
                    continue
                resent = False
                if t == "output":
                    if directive is not None:
                        return _failed("protocol", f"a {directive[0]} request for step {directive[1]} "
                                                   "was answered with the operation's output")
                    return _succeeded(answer.get("output"))
                if t == "error":
                    cls, msg = str(answer.get("class")), str(answer.get("message"))
                    if cls == "retryable" and attempt < ATTEMPTS:
                        attempt += 1
                        next_claim = "retry"
                        continue
                    return _failed(cls, msg)
                seq = answer.get("seq")
                expect = mem.first_open()
                if seq != expect:
                    return _failed("protocol", f"the service answered step {seq} but the journal asks "
                                               f"for step {expect}")
                if directive is not None and (directive[1] != seq or t not in ("step", "reconciled")):
                    return _failed("protocol", f"a {directive[0]} request for step {directive[1]} was "
                                               f"answered with {t}")
                name_kind = _name_kind(answer)
                entry = mem.journal[seq] if seq < len(mem.journal) else None
                if name_kind is not None and entry is not None and (entry["name"], entry["kind"]) != name_kind:
                    return _failed("nondeterminism", f"step {seq}: the journal recorded {entry['name']} "
                                                     f"({entry['kind']}), the code asked for "
                                                     f"{name_kind[0]} ({name_kind[1]})")
                outcome = await self._apply(op_id, mem, children, answer, directive, entry)
                if isinstance(outcome, End):
                    if (outcome.status == "failed" and outcome.error_class == "retryable"
                            and attempt < ATTEMPTS):
                        attempt += 1
                        next_claim = "retry"
                        continue
                    return outcome
                if outcome == "park":
                    parks += 1
                    if parks > MAX_PARKS:
                        return _failed("tester", f"parked more than {MAX_PARKS} times")
                    self._wake(mem, children)
                    next_claim = "park"
                    continue
                directive = outcome if isinstance(outcome, tuple) else None

    async def _apply(self, op_id, mem: _Memory, children, answer: dict, directive, entry):
        """Does what an answer asks; returns None (call again), a directive tuple, "park", or
        an End (the run's)."""
        t, seq = answer["type"], answer["seq"]
        if t == "step":
            name = answer.get("name")
            unsafe = directive is not None
            base = {"name": name, "kind": "custom", "replay": "unsafe" if unsafe else "safe"}
            err = answer.get("error")
            if err is None:
                if unsafe:
                    mem.effect(_key(op_id, seq, name), seq, name, answer.get("output"))
                mem.write(seq, dict(base, status="completed", output=answer.get("output"), error=None))
                return None
            retryable = bool(err.get("retryable", True))
            status = "unknown" if unsafe and not err.get("no_effect") else "failed"
            if status == "unknown":
                mem.unknown(_key(op_id, seq, name))
            mem.write(seq, dict(base, status=status, output=None, error=err.get("message")))
            return _failed("retryable" if retryable else "non_retryable",
                           f"step {name} failed: {err.get('message')}")
        if t == "unsafe":
            name = answer.get("name")
            if entry is not None and entry.get("status") in ("started", "unknown"):
                return ("reconcile", seq)
            mem.write(seq, {"name": name, "kind": "custom", "replay": "unsafe", "status": "started",
                            "output": None, "error": None})
            return ("run", seq)
        if t == "reconciled":
            if directive is None or directive[0] != "reconcile":
                return _failed("protocol", "a reconciled answer to a request that asked no reconcile")
            if answer.get("unsupported"):
                row = mem.journal[seq]
                mem.write(seq, dict(row, status="unknown"))
                return _failed("unknown_side_effect",
                               f"step {seq} ({row['name']}): an unsafe step's outcome is unknown and it "
                               "has no reconcile")
            if answer.get("happened"):
                row = mem.journal[seq]
                mem.reconciled(_key(op_id, seq, row["name"]), seq, row["name"], answer.get("output"))
                mem.write(seq, dict(row, status="completed", output=answer.get("output"), error=None))
                return None
            return ("run", seq)
        if t == "model":
            n = sum(1 for e in mem.journal[:seq] if e.get("kind") == "model")
            response = self._model(answer.get("request") or {}, n)
            mem.write(seq, {"name": answer.get("name"), "kind": "model", "replay": "safe",
                            "status": "completed", "output": json.loads(json.dumps(response)),
                            "error": None})
            return None
        if t == "sleep":
            mem.write(seq, {"name": "sleep", "kind": "sleep", "replay": "safe", "status": "started",
                            "output": None, "error": None})
            return "park"
        if t == "signal":
            mem.write(seq, {"name": f"signal:{answer.get('name')}", "kind": "signal", "replay": "safe",
                            "status": "started", "output": None, "error": None})
            return "park"
        if t == "spawn":
            kind = answer.get("kind")
            child_id = str(_uuid.uuid5(_uuid.NAMESPACE_URL, f"agentq-child:{op_id}/{seq}"))
            if child_id not in children:
                children[child_id] = (kind, answer.get("input"), len(children))
            mem.write(seq, {"name": f"spawn:{kind}", "kind": "spawn", "replay": "safe",
                            "status": "completed", "output": child_id, "error": None})
            return None
        if t == "join":
            ids = [str(c) for c in answer.get("children") or []]
            for c in ids:
                if c not in children:
                    return _failed("non_retryable", f"join names {c}, which is not this operation's child")
            mem.write(seq, {"name": "join", "kind": "join", "replay": "safe", "status": "started",
                            "output": {"children": ids}, "error": None})
            return "park"
        if t == "now":
            mem.write(seq, {"name": "now", "kind": "now", "replay": "safe", "status": "completed",
                            "output": _now_text(), "error": None})
            return None
        if t == "uuid":
            mem.write(seq, {"name": "uuid", "kind": "now", "replay": "safe", "status": "completed",
                            "output": str(_uuid.uuid4()), "error": None})
            return None
        if t == "patch":
            mem.write(seq, {"name": answer.get("name"), "kind": "patch", "replay": "safe",
                            "status": "completed", "output": True, "error": None})
            return None
        return _failed("protocol", f"an answer of unknown type {t!r}")

    def _wake(self, mem: _Memory, children) -> None:
        """What the scheduler and senders do while the operation is parked."""
        seq = mem.first_open()
        row = mem.journal[seq]
        if row["kind"] == "sleep":
            mem.write(seq, dict(row, status="completed", output=None))
        elif row["kind"] == "signal":
            name = row["name"][len("signal:"):]
            k = sum(1 for e in mem.journal[:seq] if e.get("name") == row["name"])
            queue = self._signals.get(name, [])
            out = dict(queue[k]) if k < len(queue) else {"timed_out": True}
            mem.write(seq, dict(row, status="completed", output=out))
        elif row["kind"] == "join":
            outcomes = []
            for c in (row.get("output") or {}).get("children", []):
                kind, inp, index = children[c]
                outcomes.append(self._child_end(index, kind, inp).outcome(c, kind))
            mem.write(seq, dict(row, status="completed", output=json.loads(json.dumps(outcomes))))


def _name_kind(answer: dict) -> Optional[Tuple[str, str]]:
    t = answer.get("type")
    if t in ("step", "unsafe"):
        return str(answer.get("name")), "custom"
    if t == "model":
        return str(answer.get("name")), "model"
    if t == "sleep":
        return "sleep", "sleep"
    if t == "signal":
        return f"signal:{answer.get('name')}", "signal"
    if t == "spawn":
        return f"spawn:{answer.get('kind')}", "spawn"
    if t == "join":
        return "join", "join"
    if t == "now":
        return "now", "now"
    if t == "uuid":
        return "uuid", "now"
    if t == "patch":
        return str(answer.get("name")), "patch"
    return None


def _crash_points(timeline) -> List[Tuple[List[dict], Dict[str, Any], int, str]]:
    """Every point of the first run's ``timeline`` where a crash leaves a different state: the
    journal and the effects it leaves, how many of the timeline's events came before it, and
    the last thing that happened."""
    points: List[Tuple[List[dict], Dict[str, Any], int, str]] = [([], {}, 0, "before the first step")]
    journal: List[dict] = []
    happened: Dict[str, Any] = {}
    for n, (what, a, b, after) in enumerate(timeline):
        if what == "durable":
            journal = a
        else:
            happened = dict(happened)
            happened[a] = b
        last = points[-1]
        if last[0] == journal and last[1] == happened:
            continue
        points.append((journal, happened, n + 1, after))
    return points


def _natural(v: str):
    import re

    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", v) if p]


def _broken(why: str) -> Report:
    return Report(outcome=_failed("tester", why), steps=[],
                  violations=[Violation(Check.FAILED, None, "", "the start", why)])


@dataclasses.dataclass
class JournalReplay:
    """What :func:`replay_journal` found: ``agrees`` (the code asks for the journal's steps up to
    its end, or finishes; any error answer, such as nondeterminism or an input it can no longer
    decode, diverges, as in ``agentq replay``), the ``answer`` it stopped with, and the
    journal's length."""

    agrees: bool
    answer: dict
    steps: int


def replay_journal(service: Service, kind: str, input: Any, journal: "List[dict] | str",
                   version: Optional[str] = None) -> JournalReplay:
    """Replays a recorded journal (e.g. the lines of ``agentq steps OP --json``) against the code
    at hand without running anything (no step function, no reconcile): whether a deploy would
    replay the operations that wait today."""
    versions = sorted((k.version for k in service.kinds() if k.name == kind), key=_natural)
    version = version or (versions[-1] if versions else "1")
    if isinstance(journal, str):  # the JSON Lines of `agentq steps OP --json`
        journal = [json.loads(line) for line in journal.splitlines() if line.strip()]
    entries = []
    for i, e in enumerate(sorted(journal, key=lambda e: e.get("seq", 0))):
        entries.append({"seq": i, "name": e.get("name"), "kind": e.get("kind"),
                        "replay": e.get("replay", "safe"), "status": e.get("status"),
                        "output": e.get("output"), "error": e.get("error")})
    request = {"protocol": 1,
               "operation": {"id": str(_uuid.uuid4()), "kind": kind, "version": version,
                             "tenant": "replay", "attempt": 1},
               "session": str(_uuid.uuid4()), "input": input,
               "journal": {"base": 0, "entries": entries}, "run": None, "reconcile": None}

    async def go():
        return await service.invoke_async(request, _dry=True)

    answer = json.loads(encode_answer(asyncio.run(go())))
    service.sessions.drop(request["session"])
    # As `agentq replay` decides: any error (a step asked for differently, an input the code
    # can no longer decode, the kind raising) is a divergence.
    agrees = answer.get("type") != "error"
    return JournalReplay(agrees=agrees, answer=answer, steps=len(entries))
