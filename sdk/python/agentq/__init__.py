"""agentq's Python SDK: write agentq kinds in Python, served over the step protocol
(docs/protocol.md), with a replay tester (:mod:`agentq.testing`)."""

from .context import ChildOutcome, Context, NoEffect, NonRetryable, OperationInfo, Signal, Tool
from .service import Service
from .signing import Secret

__version__ = "0.1.0"

__all__ = [
    "Service",
    "Context",
    "NonRetryable",
    "NoEffect",
    "Signal",
    "ChildOutcome",
    "OperationInfo",
    "Secret",
    "Tool",
    "__version__",
]
