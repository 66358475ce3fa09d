"""rnnserve on a real local Ray cluster: two replicas behind Serve's proxy.

`ray_scenario.py` runs inside a network namespace of its own with only
loopback (`unshare --net`, `ip link set lo up`; root), where Ray and Serve
bind and talk on 127.0.0.1 alone, and in a PID namespace of its own, so
everything Ray starts ends with it. The dashboard is off. It starts the real
`rnnserve serve --ray --replicas 2`, and records what the proxy, the node's
metrics export, the replica logs and a SIGTERM drain gave; the tests here
check the record; a second scenario has Ray itself stop a replica. Skipped, with the reason, when Ray Serve is not installed
(`pip install -e '.[ray]'`; .ci/run installs it) or when namespaces cannot be
made (not root, no unshare).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[ray]' (.ci/run installs it)")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from server_support import save_tiny_model, sse_payloads  # noqa: E402
from test_deploy import promql_grouping_labels, promql_metric_names  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RAY_DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "rnnserve-ray.json"
SCENARIO_SECONDS = 1200  # start-up 25-160 s here, the drain up to 300 s; everything inside is bounded


def namespace_command() -> list[str]:
    if os.geteuid() != 0:
        pytest.skip("the Ray test needs root for its own network namespace (unshare --net); CI runs as root")
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            pytest.skip(f"the Ray test needs `{tool}` (util-linux / iproute2) for its network namespace")
    return [
        "unshare",
        "--net",
        "--pid",
        "--fork",
        "--mount-proc",
        "--",
        "sh",
        "-c",
        'ip link set lo up && exec "$0" "$@"',
    ]


def run_scenario(mode: str, folder: Path) -> dict:
    """What ray_scenario.py MODE saw, inside its own network and PID namespaces."""
    weights = folder / "weights"
    weights.mkdir()
    save_tiny_model(weights, "digits-linear", "linear", "mnist")
    save_tiny_model(weights, "text-softmax", "softmax", "text")
    if mode == "ray-stop":  # GPT-2 small's width and depth: a load that takes the replica a while
        save_tiny_model(weights, "text-large", "softmax", "text", d_model=768, n_layers=12, n_heads=12, d_ff=3072)
    out = folder / "seen.json"
    command = namespace_command() + [
        sys.executable,
        str(ROOT / "tests" / "ray_scenario.py"),
        mode,
        str(weights),
        str(out),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=SCENARIO_SECONDS)
    assert out.exists(), f"the scenario wrote nothing (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    record = json.loads(out.read_text())
    assert "error" not in record, f"{record['error']}\nserver log:\n{record['server_log']}"
    return record


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    return run_scenario("serve", tmp_path_factory.mktemp("ray"))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict:
    return run_scenario("ray-stop", tmp_path_factory.mktemp("ray-stop"))


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text + "\n")}


def test_non_streamed_text_and_image_through_the_proxy(seen):
    for text in seen["text"]:
        assert text["status"] == 200, text["body"]
        body = json.loads(text["body"])
        assert body["usage"]["completion_tokens"] == 6 and body["model"] == "text-softmax"
    image = seen["image"]
    assert image["status"] == 200, image["body"]
    data = json.loads(image["body"])["data"]
    assert [d["index"] for d in data] == [0, 1]
    assert all(row == [(r * 28 + c) % 256 for c in range(28)] for d in data for r, row in enumerate(d["pixels"][:14]))


def test_streamed_text_and_image_through_the_proxy(seen):
    assert seen["text_stream"]["status"] == 200
    chunks = sse_payloads(seen["text_stream"]["body"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert seen["image_stream"]["status"] == 200
    events = sse_payloads(seen["image_stream"]["body"])
    rows = [(e["index"], e["row"]) for e in events if e["object"] == "image.completion.row"]
    assert sorted(rows) == [(i, r) for i in range(2) for r in range(14, 28)]  # rows 0-13 were given
    assert events[-1]["object"] == "image.completion.usage"


def test_health_through_the_proxy_answers_starting_until_ready(stopped):
    """While the replica loads its models (one of GPT-2 small's size) the proxy routes /health to it, and it
    answers at once: 503 `starting` with Retry-After, never a hang, until the first 200."""
    watched = stopped["health_while_starting"]
    assert watched and watched[-1]["status"] == 200, watched
    assert not any(w.get("error") == "timeout" for w in watched), f"/health hung while starting: {watched}"
    answered = [w for w in watched[:-1] if "status" in w]
    starting = [w for w in answered if w["status"] == 503 and w["code"] == "starting" and w["retry_after"]]
    assert starting, f"no 503 `starting` seen before ready: {watched}"
    before = answered[: answered.index(starting[0])]
    assert all(w["status"] == 404 for w in before), f"before the app is deployed only Serve's 404: {watched}"
    assert all(w["status"] == 503 and w["code"] == "starting" for w in answered[len(before) :]), watched


def test_requests_reach_both_replicas(seen):
    replicas = [a["replica"] for a in seen["text"]]
    assert all(replicas), "every answer names its replica (X-Rnnserve-Replica)"
    assert len(set(replicas)) == 2, f"16 requests all went to {set(replicas)}"


def test_requests_sharing_a_prefix_go_to_the_replica_that_caches_it(seen):
    """Prefix routing (on by default): every request of a group goes to one replica, and every one after the
    first finds the shared part in that replica's prefix cache."""
    for group in seen["shared_prefixes"]:
        assert all(a["status"] == 200 for a in group), [a["body"] for a in group]
        assert len({a["replica"] for a in group}) == 1, [a["replica"] for a in group]
        cached = [json.loads(a["body"])["usage"]["prompt_tokens_details"]["cached_tokens"] for a in group]
        assert all(c > 0 for c in cached[1:]), cached


def test_metrics_through_the_proxy_are_not_routed(seen):
    answer = seen["metrics_through_proxy"]
    assert answer["status"] == 404
    error = json.loads(answer["body"])["error"]
    assert error["code"] == "metrics_not_routed" and "ray_rnnserve_" in error["message"]


def test_node_export_has_every_replicas_series_with_their_types(seen):
    exported = families(seen["node_metrics"])
    replicas = {a["replica"] for a in seen["text"]}
    expected = {
        "ray_rnnserve_generated_tokens": "counter",
        "ray_rnnserve_requests": "counter",
        "ray_rnnserve_time_to_first_token_seconds": "histogram",
        "ray_rnnserve_inter_token_latency_seconds": "histogram",
        "ray_rnnserve_running_sequences": "gauge",
        "ray_rnnserve_decode_state_allocated_bytes": "gauge",
        "ray_rnnserve_waiting_sequences": "gauge",
    }
    for name, kind in expected.items():
        assert name in exported and exported[name].type == kind, f"{name}: {exported.get(name)}"
        labelled = {s.labels.get("replica") for s in exported[name].samples}
        assert replicas <= labelled, f"{name} lacks replicas {replicas - labelled}"
    tokens = sum(
        s.value
        for s in exported["ray_rnnserve_generated_tokens"].samples
        if s.name.endswith("_total") and s.labels["model"] == "text-softmax"
    )
    assert tokens == 6 * (17 + 16), "16 + 1 streamed + 16 shared-prefix text requests of 6 tokens, both replicas"
    allocated = [s.value for s in exported["ray_rnnserve_decode_state_allocated_bytes"].samples]
    assert allocated and all(value > 0 for value in allocated), allocated


def test_ray_dashboard_queries_only_what_the_node_exports(seen):
    labels: dict[str, set[str]] = {}
    for family in families(seen["node_metrics"]).values():
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    dashboard = json.loads(RAY_DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for expr in exprs:
        for name in promql_metric_names(expr):
            assert name in labels, f"the Ray dashboard queries {name}, which the node does not export"
            assert promql_grouping_labels(expr) <= labels[name] | {"le"}, f"{name} lacks labels in {expr}"


def test_each_replica_logs_the_apps_lines(seen):
    """Both model replicas; the prefix-routing front (`rnnserve-front`) has a log of its own and loads no model."""
    logs = {name: text for name, text in seen["replica_logs"].items() if "rnnserve-front" not in name}
    assert len(logs) == 2 and len(seen["replica_logs"]) == 3, sorted(seen["replica_logs"])
    for name, text in logs.items():
        assert "serving digits-linear, text-softmax" in text, f"{name} has no rnnserve line"


def test_ray_status_says_what_runs_without_the_dashboard(seen):
    status = seen["ray_status"]
    assert status["exit"] == 0 and status["json_exit"] == 0, status
    app = json.loads(status["json"])["applications"]["rnnserve"]
    assert app["status"] == "RUNNING"
    models, front = app["deployments"]["rnnserve"], app["deployments"]["rnnserve-front"]  # prefix routing's front
    assert models["status"] == "HEALTHY" and models["replicas"] == {"RUNNING": 2}, models
    assert front["status"] == "HEALTHY" and front["replicas"] == {"RUNNING": 1}, front
    assert status["lines"][0] == "application rnnserve: RUNNING", status["lines"]
    assert "  deployment rnnserve: HEALTHY, replicas: 2 RUNNING" in status["lines"][1:], status["lines"]


def test_sigterm_drains_the_replicas_and_exits_0(seen):
    drain = seen["drain"]
    assert drain["health"]["status"] == 503 and json.loads(drain["health"]["body"])["error"]["code"] == "shutting_down"
    assert drain["new_request"]["status"] == 503
    assert "server is shutting down" in json.loads(drain["new_request"]["body"])["error"]["message"]
    assert len(drain["streams"]) == 6
    for stream in drain["streams"].values():  # all finished within --drain-seconds 300: whole images
        assert stream["status"] == 200, stream["body"]
        events = sse_payloads(stream["body"])
        assert all("error" not in e for e in events), [e for e in events if "error" in e]
        rows = sorted((e["index"], e["row"]) for e in events if e["object"] == "image.completion.row")
        assert rows == [(i, r) for i in range(4) for r in range(28)]
    assert drain["exit_code"] == 0, seen["server_log"]


def test_a_replica_that_ray_stops_drains_like_the_server(stopped):
    """Ray's own stop (here `serve.delete`; also scale-down, redeploy): streams that finish within
    --drain-seconds 1 are whole, the rest end with the shutdown error and [DONE]; none is cut."""
    record = stopped
    streams = record["streams"]
    assert all(s is not None and s["status"] == 200 for s in streams), streams
    ended = [sse_payloads(s["body"])[-1] for s in streams]  # each ends with exactly one [DONE]
    failed = [e for e in ended if "error" in e]
    assert failed, f"twelve 784-step images queued on one slot cannot all finish in a 1 s drain: {ended}"
    assert all("server is shutting down" in e["error"]["message"] for e in failed)
    assert all(e["object"] == "image.completion.usage" for e in ended if "error" not in e)
    assert any("drained (past the deadline)" in text for text in record["replica_logs"].values())
    assert record["exit_code"] == 0, record["server_log"]
