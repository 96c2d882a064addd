"""``python -m agentq serve module:attr [--host H] [--port P]``: serves a :class:`Service`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .service import Service


def load(target: str) -> Service:
    """The Service at ``module:attr`` (``attr`` may be dotted; ``module`` alone takes its one
    Service)."""
    module_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    if attr:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    else:
        found = [v for v in vars(module).values() if isinstance(v, Service)]
        if len(found) != 1:
            raise SystemExit(f"agentq: name the service: {module_name}:ATTR ({len(found)} services in the module)")
        obj = found[0]
    if not isinstance(obj, Service):
        raise SystemExit(f"agentq: {target} is a {type(obj).__name__}, not an agentq.Service")
    return obj


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentq", description="agentq Python SDK")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a Service over HTTP (stdlib threaded server)")
    serve.add_argument("target", help="module:attr of the agentq.Service")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    man = sub.add_parser("manifest", help="print a Service's manifest as JSON")
    man.add_argument("target", help="module:attr of the agentq.Service")
    args = parser.parse_args(argv)
    svc = load(args.target)
    if args.command == "manifest":
        import json

        print(json.dumps(svc.manifest(), indent=2))
        return 0
    svc.serve(host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
