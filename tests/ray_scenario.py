"""What tests/test_ray.py checks, observed inside a loopback-only network namespace.

Run as `python tests/ray_scenario.py MODE WEIGHTS_DIR OUT.json` by test_ray.py
under `unshare --net --pid --fork --mount-proc` (root), after `ip link set lo up`.
MODE `serve`: the real `rnnserve serve --ray` with two replicas; text and image
requests (streamed and not) through Serve's proxy; the replicas' series in the
node's metrics export; the replica log files; then SIGTERM with a stream in
flight, and the drain. MODE `ray-stop`: one replica with one decode slot and a
1 s drain, twelve streams queued, and Ray itself stopping the replica
(`serve.delete` from a second driver). It only records what it saw (JSON);
the assertions are in test_ray.py. Every wait is bounded; the namespace's PID
1 is this script, so whatever Ray leaves behind is killed with it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PORT, METRICS_PORT = 8000, 8080
URL, METRICS_URL = f"http://127.0.0.1:{PORT}", f"http://127.0.0.1:{METRICS_PORT}/metrics"
READY_LINE = "rnnserve: serving through Ray Serve"
START_SECONDS, METRICS_SECONDS, EXIT_SECONDS = 300, 90, 120
# The drain test: about 3 s of decoding on an idle machine, over 100 s on a loaded one, where Ray's
# niced workers get little of the CPU; the drain must outlast it (the probes need only its first second).
DRAIN_SECONDS = 300
TEXT_TOKENS = 6  # per text request: the model has no stop, so each generates all of them
ROUTED_REQUESTS = 16
PREFIX_GROUPS, PREFIX_GROUP_SIZE = 4, 4
PREFIX_CHARS = 16
STOPPED_STREAMS = 12  # queued on one slot: about 10 s of decoding against a 1 s drain
DIGIT = [[(r * 28 + c) % 256 if r < 14 else 0 for c in range(28)] for r in range(28)]


SERVE_FLAGS = {
    "serve": [
        *("--replicas", "2", "--max-batch", "4", "--drain-seconds", str(DRAIN_SECONDS)),
        *("--ray-prefix-chars", str(PREFIX_CHARS)),  # the tiny text model's context is 64 tokens
    ],
    "ray-stop": ["--replicas", "1", "--max-batch", "1", "--drain-seconds", "1"],
}


def start_server(mode: str, weights: Path, ray_tmp: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_TMPDIR": str(ray_tmp), "RAY_DEDUP_LOGS": "0"}
    command = [
        str(Path(sys.executable).parent / "rnnserve"),
        "serve",
        "--ray",
        "--weights",
        str(weights),
        "--port",
        str(PORT),
        "--ray-metrics-port",
        str(METRICS_PORT),
        "--cpus-per-replica",
        "1",
        "--device",
        "cpu",
        "--no-compile-decode",
        *SERVE_FLAGS[mode],
    ]
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


def wait_ready(server: subprocess.Popen, log: Path) -> float:
    started = time.monotonic()
    while READY_LINE not in log.read_text(errors="replace"):
        if server.poll() is not None or time.monotonic() - started > START_SECONDS:
            raise RuntimeError(f"server not ready (exit {server.poll()})")
        time.sleep(0.5)
    return time.monotonic() - started


class HealthWatch:
    """/health through the proxy from the server's start until it says ready: every answer, or why none came.

    Consecutive equal answers are kept once with a count. A 10 s timeout per probe tells a hang (the
    proxy holding /health while a replica starts) from an answer."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while not self.done.is_set() and time.monotonic() < deadline:
            self._record(self._probe())
            if self.seen[-1].get("status") == 200:
                return
            time.sleep(0.05)

    @staticmethod
    def _probe() -> dict:
        try:
            response = httpx.get(f"{URL}/health", timeout=10)
        except httpx.TimeoutException:
            return {"error": "timeout"}
        except httpx.TransportError as exc:
            return {"error": type(exc).__name__}
        try:
            code = response.json().get("error", {}).get("code")
        except ValueError:
            code = None
        return {"status": response.status_code, "code": code, "retry_after": response.headers.get("retry-after")}

    def _record(self, probe: dict) -> None:
        if self.seen and {k: v for k, v in self.seen[-1].items() if k != "count"} == probe:
            self.seen[-1]["count"] += 1
        else:
            self.seen.append({**probe, "count": 1})


def answer(response: httpx.Response) -> dict:
    return {
        "status": response.status_code,
        "body": response.text,
        "replica": response.headers.get("x-rnnserve-replica"),
    }


def requests_through_proxy(client: httpx.Client) -> dict:
    text = {"model": "text-softmax", "max_tokens": TEXT_TOKENS, "seed": 1}
    image = {"model": "digits-linear", "pixels": DIGIT, "keep_rows": 14, "n": 2, "seed": 1}
    return {
        # different prompts, so that prefix routing spreads them over the replicas
        "text": [
            answer(client.post("/v1/completions", json={**text, "prompt": f"hello {i}"}))
            for i in range(ROUTED_REQUESTS)
        ],
        "shared_prefixes": shared_prefix_requests(client),
        "text_stream": answer(client.post("/v1/completions", json={**text, "stream": True})),
        "image": answer(client.post("/v1/images/completions", json=image)),
        "image_stream": answer(client.post("/v1/images/completions", json={**image, "stream": True})),
        "metrics_through_proxy": answer(client.get("/metrics")),
    }


def shared_prefix_requests(client: httpx.Client) -> list[list[dict]]:
    """Groups of requests whose prompts start with the group's long shared part, the first being that part
    alone: each group's answers, in order (prefix routing sends a group to one replica, whose cache holds it)."""
    groups = []
    for group in range(PREFIX_GROUPS):
        shared = f"group {group}: the shared system prompt. "  # over --ray-prefix-chars; within the tiny context
        prompts = [shared] + [f"{shared}q{i}?" for i in range(PREFIX_GROUP_SIZE - 1)]
        body = {"model": "text-softmax", "max_tokens": TEXT_TOKENS, "seed": 1}
        groups.append([answer(client.post("/v1/completions", json={**body, "prompt": p})) for p in prompts])
    return groups


def node_metrics(replicas: set[str], text_tokens: float) -> str:
    """The node's export once every replica's token counter is in it, the text model's counters add up to
    the tokens the answers reported, and the image requests' counter is in it too (Ray reports each worker's
    series every few seconds, and a slow machine may report the image's counter in a later round)."""
    deadline, text = time.monotonic() + METRICS_SECONDS, ""
    while time.monotonic() < deadline:
        try:
            text = httpx.get(METRICS_URL, timeout=10).text
        except httpx.TransportError:
            text = ""
        lines = text.splitlines()
        counters = [line for line in lines if line.startswith("ray_rnnserve_generated_tokens_total{")]
        text_total = sum(float(line.rsplit(" ", 1)[1]) for line in counters if 'model="text-softmax"' in line)
        images = any(line.startswith("ray_rnnserve_completed_images_total{") for line in lines)
        if (
            all(any(f'replica="{r}"' in line for line in counters) for r in replicas)
            and text_total >= text_tokens
            and images
        ):
            break
        time.sleep(1)
    return "\n".join(line for line in text.splitlines() if "rnnserve_" in line)


def replica_logs(ray_tmp: Path) -> dict[str, str]:
    files = {p.resolve() for p in ray_tmp.rglob("replica_*.log")}  # session_latest links to the session
    return {p.name: p.read_text(errors="replace") for p in files}


def drain(server: subprocess.Popen, client: httpx.Client) -> dict:
    """SIGTERM with streams in flight: what /health, a new request and the streams get; the exit status.

    Six streams of four blank digits on two replicas of four slots: three whole generations per
    replica, seconds of work, so the drain is still on while /health and a new request are tried;
    the --drain-seconds 300 let them finish however loaded the machine is.
    """
    seen: dict = {"streams": {}}
    body = {"model": "digits-linear", "pixels": [[0] * 28] * 28, "keep_rows": 0, "n": 4, "seed": 2, "stream": True}
    first_event = threading.Event()

    def stream(i: int) -> None:
        # A stream queued behind others sends nothing until its turn: wait as long as the drain may last.
        try:
            with httpx.stream("POST", f"{URL}/v1/images/completions", json=body, timeout=DRAIN_SECONDS) as response:
                chunks = []
                for chunk in response.iter_text():
                    chunks.append(chunk)
                    first_event.set()
                seen["streams"][i] = {"status": response.status_code, "body": "".join(chunks)}
        except httpx.HTTPError as exc:
            seen["streams"][i] = {"status": None, "body": f"{type(exc).__name__}: {exc}"}

    readers = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(6)]
    for reader in readers:
        reader.start()
    first_event.wait(60)
    server.send_signal(signal.SIGTERM)
    seen["health"] = first_refusal(client)
    seen["new_request"] = first_refused_request(client)
    for reader in readers:
        reader.join(DRAIN_SECONDS + EXIT_SECONDS)
    seen["exit_code"] = server.wait(EXIT_SECONDS)
    return seen


def first_refused_request(client: httpx.Client) -> dict:
    """A new completion until one is refused: each replica sees the drain flag on its own next look
    (every 0.25 s, longer under load), so one that has not looked yet may still serve a request."""
    deadline = time.monotonic() + 10
    while True:
        reply = answer(client.post("/v1/completions", json={"model": "text-softmax", "prompt": "x", "max_tokens": 1}))
        if reply["status"] != 200 or time.monotonic() > deadline:
            return reply
        time.sleep(0.05)


def first_refusal(client: httpx.Client) -> dict:
    """/health until it stops answering 200: the replicas look at the drain flag every 0.25 s."""
    deadline = time.monotonic() + 10
    while True:
        health = answer(client.get("/health"))
        if health["status"] != 200 or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def ray_stops_the_replica(server: subprocess.Popen, ray_tmp: Path) -> dict:
    """Twelve streams on a replica with one slot, then Ray deletes the app: what each stream got.

    A 784-step generation of the tiny model takes 0.6-1.5 s here, so most of the twelve are
    still queued at the 1 s drain's deadline (all finishing would need under 0.2 s each)."""
    import ray
    from ray import serve

    streams: dict[int, dict] = {}
    body = {"model": "digits-linear", "pixels": [[0] * 28] * 28, "keep_rows": 0, "n": 1, "seed": 3, "stream": True}

    def stream(i: int) -> None:
        response = httpx.post(f"{URL}/v1/images/completions", json=body, timeout=120)
        streams[i] = {"status": response.status_code, "body": response.text}

    ray.init(address="auto")  # a second driver on the same cluster, connected before the streams start
    readers = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(STOPPED_STREAMS)]
    for reader in readers:
        reader.start()
        time.sleep(0.02)
    time.sleep(0.5)  # all queued, the first one running
    serve.delete("rnnserve")  # Ray stops the replica: its drain, not our SIGTERM
    for reader in readers:
        reader.join(EXIT_SECONDS)
    logs = replica_logs(ray_tmp)
    server.send_signal(signal.SIGTERM)  # nothing left to drain: the launcher just stops Ray
    return {
        "streams": [streams.get(i) for i in range(STOPPED_STREAMS)],
        "replica_logs": logs,
        "exit_code": server.wait(EXIT_SECONDS),
    }


def ray_status() -> dict:
    """`rnnserve ray-status`, plain and --json, as a user runs it beside the server (RAY_TMPDIR as the server's)."""
    command = [str(Path(sys.executable).parent / "rnnserve"), "ray-status"]
    plain = subprocess.run(command, capture_output=True, text=True, timeout=120)
    as_json = subprocess.run(command + ["--json"], capture_output=True, text=True, timeout=120)
    return {
        "exit": plain.returncode,
        "lines": plain.stdout.splitlines(),
        "stderr": plain.stderr[-2000:],
        "json_exit": as_json.returncode,
        "json": as_json.stdout,
    }


def observe(mode: str, server: subprocess.Popen, ray_tmp: Path) -> dict:
    if mode == "ray-stop":
        return ray_stops_the_replica(server, ray_tmp)
    seen: dict = {}
    with httpx.Client(base_url=URL, timeout=120) as client:
        seen.update(requests_through_proxy(client))
        # the non-streamed ones, the streamed one and the shared-prefix ones
        text_tokens = TEXT_TOKENS * (len(seen["text"]) + 1 + PREFIX_GROUPS * PREFIX_GROUP_SIZE)
        seen["node_metrics"] = node_metrics({a["replica"] for a in seen["text"] if a["replica"]}, text_tokens)
        seen["replica_logs"] = replica_logs(ray_tmp)
        seen["ray_status"] = ray_status()
        seen["drain"] = drain(server, client)
    return seen


def main(mode: str, weights: Path, out: Path) -> None:
    ray_tmp = Path(tempfile.mkdtemp(prefix="rnnray-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    os.environ["RAY_TMPDIR"] = str(ray_tmp)  # the second driver of ray-stop finds the cluster there
    log = ray_tmp / "server.log"
    seen: dict = {}
    server = start_server(mode, weights, ray_tmp, log)
    health = HealthWatch()
    health.thread.start()
    try:
        seen["ready_seconds"] = wait_ready(server, log)
        health.thread.join(START_SECONDS)
        seen["health_while_starting"] = health.seen
        seen.update(observe(mode, server, ray_tmp))
    except Exception as exc:  # recorded: test_ray.py reports it with the server's log
        seen["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        health.done.set()
        if server.poll() is None:
            server.kill()
        seen["server_log"] = log.read_text(errors="replace")[-20000:]
        out.write_text(json.dumps(seen))
        shutil.rmtree(ray_tmp, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
