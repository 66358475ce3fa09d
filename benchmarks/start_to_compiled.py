"""From `make serve` to the first image at compiled speed, watching for compilers: `python -m benchmarks.start_to_compiled`.

Starts the server as a user does (default `make serve ARGS="--port PORT"`, in the working directory), then every
0.2 s: asks /health, reads /v1/models, and lists the server's process tree for C++ compiler processes (cc1plus,
g++, c++, gcc, as, ld, collect2). Reports when /health first said ready, when each model's decode steps were
compiled, whether any compiler ran after /health said ready, and how long the README's first image request took
once `--model` was compiled (sent then). Stops the server with SIGTERM. Talks only to 127.0.0.1; every wait is
bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from model.attention.classes import kinds_where

COMPILERS = frozenset({"cc1plus", "cc1", "g++", "c++", "gcc", "as", "ld", "collect2"})
POLL_SECONDS = 0.2


def process_tree(root: int) -> list[tuple[int, str]]:
    """(pid, name) of `root` and all its descendants, from /proc."""
    parents: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        parents.setdefault(int(rest[1]), []).append(int(entry.name))
        names[int(entry.name)] = name
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append((pid, names.get(pid, "?")))
        todo.extend(parents.get(pid, []))
    return found


# Inductor runs `g++ --version` in every process that loads its graphs (to name the compiler in its cache keys):
# a query, not a compile. A compile names its output or input: one of these flags or a source or object file.
COMPILE_FLAGS = frozenset({"-c", "-o", "-E", "-S"})
COMPILED_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".s", ".o", ".so")


def compiling(root: int) -> set[str]:
    """Names of the compiler processes in `root`'s tree that compile (not version queries). A process gone before
    its command line is read lived too short to be a compile (those take seconds: a later look finds them)."""
    found = set()
    for pid, name in process_tree(root):
        if name not in COMPILERS:
            continue
        try:
            args = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")[1:]
        except OSError:
            continue
        if any(a in COMPILE_FLAGS or a.endswith(COMPILED_SUFFIXES) for a in args):
            found.add(name)
    return found


def image_request(url: str, model: str, example: Path) -> float:
    started = time.monotonic()
    with example.open("rb") as image:
        answer = httpx.post(
            f"{url}/v1/images/completions",
            headers={"Accept": "image/png"},
            timeout=600,
            files={"image": image},
            data={"model": model, "n": "4", "seed": "1"},
        )
    answer.raise_for_status()
    return time.monotonic() - started


def watch(args: argparse.Namespace) -> dict:
    port = args.port
    command = args.command or ["make", "serve", f"ARGS=--port {port}"]
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ready_at, compiled_at, compilers_after_ready, image_seconds, image_sent_at = None, {}, set(), None, None
    try:
        deadline = started + args.seconds
        while time.monotonic() < deadline:
            now = time.monotonic() - started
            seen = compiling(server.pid)
            if ready_at is not None:
                compilers_after_ready |= seen
            try:
                if ready_at is None and httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    ready_at = now
                cards = httpx.get(f"{url}/v1/models", timeout=1).json()["data"] if ready_at is not None else []
            except (httpx.TransportError, ValueError, KeyError):
                cards = []
            for card in cards:
                if card["compiled_decode"] and card["id"] not in compiled_at:
                    compiled_at[card["id"]] = now
            if image_seconds is None and args.model in compiled_at:
                image_sent_at = time.monotonic() - started
                image_seconds = image_request(url, args.model, args.example)
            compilable = [c for c in cards if c["attention"] in kinds_where(lambda k: k.compilable)]
            if (
                image_seconds is not None
                and compilable
                and all(c["id"] in compiled_at for c in compilable)
                and now - max(compiled_at.values()) > args.settle
            ):
                break
            time.sleep(POLL_SECONDS)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    return {
        "command": command,
        "health_ready_s": ready_at,
        "compiled_s": compiled_at,
        "compiler_processes_after_ready": sorted(compilers_after_ready),
        "image_model": args.model,
        "image_sent_s": image_sent_at,
        "image_seconds": image_seconds,
        "first_compiled_image_done_s": None if image_seconds is None else image_sent_at + image_seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18126)
    parser.add_argument("--model", default="mnist-linear", help="the model of the README's first image request")
    parser.add_argument("--example", type=Path, default=Path("examples/occluded-digit.png"))
    parser.add_argument("--seconds", type=float, default=1200.0, help="give up after this long")
    parser.add_argument("--settle", type=float, default=10.0, help="keep watching this long after the last compile")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("command", nargs="*", help="the server command (default: make serve on --port)")
    args = parser.parse_args(argv)
    result = watch(args)
    print(json.dumps(result, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
