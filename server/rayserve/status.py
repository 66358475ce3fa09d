"""`rnnserve ray-status`: what a running `rnnserve serve --ray` serves, without Ray's dashboard.

Ray's `serve status` asks the dashboard, which `rnnserve serve --ray` leaves off (it serves on loopback-only
machines too). This command joins the cluster as a second driver instead and asks Serve's controller: each
application's state, and each deployment's state and replicas by state. Exit 0 when every application is
RUNNING, 1 when one is not, 2 when there is no cluster to ask.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default="auto",
        help="the Ray cluster: 'auto' (default) finds the one started on this machine "
        "(set RAY_TMPDIR as the server had it, if it had one), or HOST:PORT of its head",
    )
    parser.add_argument("--json", action="store_true", help="print the status as one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        print("rnnserve ray-status: Ray Serve is not installed: pip install 'rnnserve[ray]'", file=sys.stderr)
        return 2
    try:
        ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(
            f"rnnserve ray-status: no Ray cluster at {args.address!r} ({first}); is `rnnserve serve --ray` "
            "running on this machine?",
            file=sys.stderr,
        )
        return 2
    try:
        status = summary(serve.status())
    finally:
        ray.shutdown()
    print(json.dumps(status) if args.json else "\n".join(lines(status)))
    return 0 if status["applications"] and all(a["status"] == "RUNNING" for a in status["applications"].values()) else 1


def summary(status: Any) -> dict:
    """Serve's status as plain data: applications, their deployments, replicas counted by state."""
    return {
        "applications": {
            name: {
                "status": _plain(app.status),
                "message": app.message,
                "deployments": {
                    d_name: {
                        "status": _plain(d.status),
                        "message": d.message,
                        "replicas": {_plain(state): count for state, count in d.replica_states.items()},
                    }
                    for d_name, d in app.deployments.items()
                },
            }
            for name, app in status.applications.items()
        }
    }


def _plain(value: Any) -> str:
    """An enum of Serve's (a str Enum) as its value: RUNNING, not ApplicationStatus.RUNNING."""
    return str(getattr(value, "value", value))


def lines(status: dict) -> list[str]:
    if not status["applications"]:
        return ["no application is deployed"]
    out = []
    for name, app in status["applications"].items():
        out.append(f"application {name}: {app['status']}" + (f" ({app['message']})" if app["message"] else ""))
        for d_name, d in app["deployments"].items():
            replicas = ", ".join(f"{count} {state}" for state, count in d["replicas"].items()) or "no replicas"
            out.append(
                f"  deployment {d_name}: {d['status']}, replicas: {replicas}"
                + (f" ({d['message']})" if d["message"] else "")
            )
    return out
