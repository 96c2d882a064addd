import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def request(kind, journal=None, *, base=0, input=None, session="s1", version="1", run=None,
            reconcile=None, attempt=1):
    entries = []
    for i, e in enumerate(journal or []):
        e = dict(e)
        e.setdefault("seq", base + i)
        e.setdefault("replay", "safe")
        e.setdefault("status", "completed")
        e.setdefault("error", None)
        entries.append(e)
    return {
        "protocol": 1,
        "operation": {"id": "op-1", "kind": kind, "version": version, "tenant": "t", "attempt": attempt},
        "session": session,
        "input": input,
        "journal": {"base": base, "entries": entries},
        "run": run,
        "reconcile": reconcile,
    }


def entry(name, kind="custom", output=None, status="completed", replay="safe"):
    return {"name": name, "kind": kind, "output": output, "status": status, "replay": replay}
