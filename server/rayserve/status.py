"""`rnnserve ray-status`: what a running `rnnserve serve --ray` serves, without Ray's dashboard.

Ray's `serve status` asks the dashboard, which `rnnserve serve --ray` leaves off (it serves on loopback-only
machines too). This command joins the cluster as a second driver instead and asks Serve's controller: each
application's state, and each deployment's state and replicas by state. Exit 0 when every application is
RUNNING, 1 when one is not, 2 when there is no cluster to ask or it does not answer in time.

Ray's client waits minutes for a head that is listed but gone (a cluster being torn down, a stale address
file), so the head is probed first and the whole call runs under a deadline.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default="auto",
        help="the Ray cluster: 'auto' (default) finds the one started on this machine "
        "(set RAY_TMPDIR as the server had it, if it had one), or HOST:PORT of its head",
    )
    parser.add_argument("--json", action="store_true", help="print the status as one JSON object")
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=30.0,
        help="seconds to wait for the cluster to answer before giving up with exit code 2 (default 30)",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        print("rnnserve ray-status: Ray Serve is not installed: pip install 'rnnserve[ray]'", file=sys.stderr)
        return 2
    unreachable = _unreachable_head(args.address, args.timeout)
    if unreachable:
        return _no_cluster(args.address, unreachable)
    # Ray's client blocks in native code, where no Python exception reaches it: only leaving the process does.
    deadline = threading.Timer(args.timeout, _give_up, (args.address, args.timeout))
    deadline.daemon = True
    deadline.start()
    try:
        ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        deadline.cancel()
        return _no_cluster(args.address, _first_line(exc))
    try:
        status = summary(serve.status())
    finally:
        deadline.cancel()
        ray.shutdown()
    print(json.dumps(status) if args.json else "\n".join(lines(status)))
    return 0 if status["applications"] and all(a["status"] == "RUNNING" for a in status["applications"].values()) else 1


def _unreachable_head(address: str, timeout: float) -> str | None:
    """Why the cluster's head cannot be reached, or None when it can (or cannot be located: Ray then says why)."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # a Ray without this helper: the deadline alone bounds the wait
        return None
    try:
        head = canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError, OSError):
        return None
    if head is None:
        return None
    host, _, port = head.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout, 3.0)).close()
    except (OSError, ValueError) as exc:
        return f"nothing answers at {head}: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
    return None


def _no_cluster(address: str, reason: str) -> int:
    print(
        f"rnnserve ray-status: no Ray cluster at {address!r} ({reason}); is `rnnserve serve --ray` "
        "running on this machine?",
        file=sys.stderr,
    )
    return 2


def _give_up(address: str, timeout: float) -> None:
    print(
        f"rnnserve ray-status: the Ray cluster at {address!r} did not answer within {timeout:g} s; "
        "is it starting or shutting down? (--timeout sets the wait)",
        file=sys.stderr,
        flush=True,
    )
    os._exit(2)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


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
