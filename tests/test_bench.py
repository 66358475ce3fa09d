"""`rnnserve bench`: the in-process benchmark end to end on tiny models, and the
HTTP load generator against a real `rnnserve serve` process.

No timing is asserted: only that every kind is measured, the numbers are
consistent with each other, and state sizes follow from the model's shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from benchmarks import (
    decode,
    decode_environment,
    decode_images,
    decode_models,
    decode_positions,
    decode_settings,
    tables,
)
from benchmarks.decode_no_cache import _interpolated_sum, _later_positions
from benchmarks.decode_positions import FLAT_ROUNDS, FLAT_STEPS_PER_ROUND, choose_positions
from benchmarks.decode_workers import rows_per_worker, threads_per_worker
from benchmarks.load import LoadSettings, run_load
from benchmarks.roofline import attention_cost, dense_flops, probe_machine, roofline, token_cost
from benchmarks.run import add_arguments, run
from model.kernels.loader import packed_linear_wins
from model import ModelConfig, build_model
from model.attention.classes import capabilities
from model.io.weights import save_model
from conftest import CONSTANT_STATE_KINDS, KINDS
from kernel_support import compiler_on_path, needs_compiler
from server_support import free_port, metric_value, save_tiny_model, stop_process, wait_healthy

REPO = Path(__file__).resolve().parents[1]
FLOAT32 = 4


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real console entry point; one thread keeps it fast on a shared 2-core machine."""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "server", "bench", "--threads", "1", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("bench")
    done = bench("--quick", "--json-out", str(out / "bench.json"), "--plot", str(out / "bench.png"))
    assert done.returncode == 0, done.stderr
    return json.loads((out / "bench.json").read_text()), out, done.stdout


def test_quick_bench_measures_every_kind_at_every_batch(quick_result):
    result, _, _ = quick_result
    batches = result["settings"]["batch_sizes"]
    measured = {(r["kind"], r["batch"]) for r in result["images"]}
    assert measured == {(k, b) for k in KINDS for b in batches}
    tokens = result["settings"]["image_tokens"]
    for r in result["images"]:
        assert r["images_per_s"] > 0
        assert r["images_per_s"] == pytest.approx(r["batch"] / r["seconds"])
        assert r["tokens_per_s"] == pytest.approx(r["images_per_s"] * tokens)
        assert r["images_per_cpu_s"] == pytest.approx(r["batch"] / r["cpu_seconds"])
        assert r["vs_softmax_cache"] == pytest.approx(
            r["images_per_s"]
            / next(s["images_per_s"] for s in result["images"] if s["kind"] == "softmax" and s["batch"] == r["batch"])
        )
    assert set(result["positions"]) == set(KINDS)
    assert result["command"].startswith("rnnserve bench")


def test_state_bytes_follow_the_model_shapes(quick_result):
    result, _, _ = quick_result
    cfg = result["models"]["linear"]["config"]
    layers, heads, d_head = cfg["n_layers"], cfg["n_heads"], cfg["d_model"] // cfg["n_heads"]
    linear = [p["state_bytes_per_sequence"] for p in result["positions"]["linear"]]
    assert linear == [layers * heads * (d_head * d_head + d_head) * FLOAT32] * len(linear)  # S and Z, flat
    linformer = {p["state_bytes_per_sequence"] for p in result["positions"]["linformer"]}
    assert len(linformer) == 1
    for p in result["positions"]["softmax"]:  # K and V for every position so far
        assert p["state_bytes_per_sequence"] == p["position"] * layers * 2 * cfg["d_model"] * FLOAT32
    reformer = [p["state_bytes_per_sequence"] for p in result["positions"]["reformer"]]
    assert reformer == sorted(reformer) and reformer[0] < reformer[-1]


def test_no_cache_baseline_is_labelled_and_consistent(quick_result):
    result, _, stdout = quick_result
    settings = result["settings"]
    assert [n["batch"] for n in result["no_cache"]] == list(settings["batch_sizes"])
    for n in result["no_cache"]:
        assert n["extrapolated"] is True
        assert n["measured_pixels"] == settings["nocache_pixels"]
        assert n["seconds"] > n["measured_seconds"] > 0
        assert all(settings["nocache_pixels"] <= s["position"] < settings["image_tokens"] for s in n["sampled_steps"])
    assert "extrapolated" in stdout


def test_table_targets_and_plot_are_written(quick_result):
    result, out, stdout = quick_result
    names = [t["name"] for t in result["targets"]]
    assert any("softmax-with-cache" in n for n in names) and any("state bytes identical" in n for n in names)
    assert next(t for t in result["targets"] if "state bytes identical" in t["name"])["met"] is True
    for kind in KINDS:
        assert re.search(rf"^\| {kind} \| 4 \|", stdout, re.MULTILINE), stdout
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _peers_installed() -> bool:
    try:
        import fast_transformers.builders  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(
    not _peers_installed(),
    reason="the peers are not installed in this environment "
    "(benchmarks/install_peers.sh builds fast-transformers in about 6 minutes; make install does not)",
)
def test_compiled_kinds_their_eager_path_and_the_peers_run_side_by_side():
    """One in-process run: the compiled kind beside its eager path and every peer, each checked
    for batch x tokens tokens, and the ratios are those of the rows."""
    settings = decode_settings.DecodeSettings(
        kinds=("linear", "reformer"),
        preset="tiny",
        batch_sizes=(2,),
        image_tokens=16,
        positions=(8, 16),
        steps_per_position=2,
        nocache_pixels=2,
        nocache_samples=1,
        compiled=True,
        peers=True,
    )
    report = decode.run_decode_bench(settings, progress=lambda line: None)
    rows = {r.kind: r for r in report.images}
    assert all(rows[kind].compiled and rows[kind].group == "rnnserve" for kind in ("linear", "reformer"))
    assert rows["linear (eager)"].group == "eager" and rows["linear (eager)"].rival == "linear"
    peers = [r for r in report.images if r.group == "peer"]
    assert {r.kind for r in peers} == {f"peer: {p.name}" for p in __import__("benchmarks.peers").peers.PEERS}
    assert report.compile_seconds["linear batch 2"]  # compiled outside the timings, and logged
    for c in report.comparisons:
        assert c["ratio"] == pytest.approx(rows[c["rnnserve"]].images_per_s / rows[c["against"]].images_per_s)
    assert {c["against"] for c in report.comparisons} >= {
        "linear (eager)",
        "peer: fast-transformers recurrent linear",
        "peer: HF Reformer generate, LSH cache",
    }
    assert set(report.load["before"]) == set(report.load["after"]) == {"load_1min", "load_5min", "load_15min"}
    # The kernel's 15-minute average, read minutes ago: it moves by a small part of the load's swings since.
    assert report.load["after"]["load_15min"] == pytest.approx(os.getloadavg()[2], abs=1.0)


@pytest.mark.skipif(
    not _peers_installed(), reason="the peers are not installed in this environment (benchmarks/install_peers.sh)"
)
def test_peers_run_in_the_bench_dtype_like_rnnserve():
    """A bfloat16 bench compares bfloat16 with bfloat16: every peer's weights are cast, and it still
    generates every token."""
    from benchmarks.peers import build_peers

    for peer in build_peers("tiny", 8, 0, torch.bfloat16):
        assert peer.dtype == torch.bfloat16, peer.spec.name
        decode_images.check_generated(peer.spec.name, peer.run(2, 8), 2, 8)


def _layout_settings(**changes) -> decode_settings.DecodeSettings:
    base = decode_settings.DecodeSettings(
        kinds=("linear",),
        preset="tiny",
        batch_sizes=(1, 3),
        image_tokens=12,
        positions=(8,),
        steps_per_position=2,
        nocache_pixels=2,
        nocache_samples=1,
        compiled=False,
    )
    return dataclasses.replace(base, **changes)


@needs_compiler
@pytest.mark.skipif(not packed_linear_wins(), reason="this CPU's route keeps PyTorch's linear layers: no one-call step")
def test_the_report_names_the_kinds_whose_steps_are_one_call():
    """The tiny preset's linear and hybrid heads (16 numbers) are whole vectors on every route: their compiled steps
    are one C++ call (model/decode/compiled/one_call.py), and the machine line says so; eager runs have none."""
    settings = _layout_settings(kinds=("linear", "hybrid", "softmax"), compiled=True)
    models = {kind: model for kind, (model, _) in decode_models.image_models(settings).items()}
    assert decode_environment.one_call_kinds(models, settings) == ["linear", "hybrid"]
    assert decode_environment.one_call_kinds(models, dataclasses.replace(settings, compiled=False)) == []
    assert tables.one_call_text({"one_call_steps": ["linear"]}) == "; linear steps as one C++ call"
    assert tables.one_call_text({}) == ""  # a report of before the call existed


def test_rows_are_shared_over_workers_and_no_worker_is_left_without_rows():
    assert rows_per_worker(64, 2) == [32, 32]
    assert rows_per_worker(7, 3) == [3, 2, 2]
    assert rows_per_worker(1, 2) == [1]  # one request: one worker busy, as in the server
    assert threads_per_worker(2, 2) == 1 and threads_per_worker(8, 3) == 2 and threads_per_worker(1, 4) == 1


def test_the_worker_layout_times_each_batch_in_processes_of_their_own():
    """--workers 2: every timed run of a batch of 3 is generated by two processes (2 rows and 1), each
    checked for rows x tokens tokens; a batch of 1 keeps one worker of a worker's threads."""
    torch.set_num_threads(2)
    report = decode.run_decode_bench(_layout_settings(workers=2), progress=lambda line: None)
    rows = {r.batch: r for r in report.images}
    assert (rows[3].workers, rows[3].threads_per_worker) == (2, 1)
    assert (rows[1].workers, rows[1].threads_per_worker) == (1, 1)
    assert decode_images.layout(rows[3]) == "2 processes x 1 thread"
    assert rows[3].images_per_s == pytest.approx(3 / rows[3].seconds)
    assert report.settings["workers"] == 2


def test_a_worker_that_cannot_build_its_contestants_stops_the_bench_with_its_reason(tmp_path):
    from benchmarks.decode_workers import WorkerPool

    settings = _layout_settings(weights=str(tmp_path / "missing"))
    with pytest.raises(
        decode.BenchError, match=r"bench worker process failed: BenchError: --weights .*not a directory"
    ):
        WorkerPool(settings, "rnnserve", 2, 2, 2, decode_images.worker_contestants, decode_images.check_generated)
    assert not multiprocessing.active_children()  # the failed worker was not left behind


@pytest.mark.skipif(
    not _peers_installed(), reason="the peers are not installed in this environment (benchmarks/install_peers.sh)"
)
def test_the_peers_are_timed_in_each_layout_and_targets_compare_like_with_like():
    torch.set_num_threads(2)
    settings = _layout_settings(batch_sizes=(2,), workers=2, peer_workers=(1, 2), peers=True)
    report = decode.run_decode_bench(settings, progress=lambda line: None)
    ft = [r for r in report.images if r.kind == "peer: fast-transformers recurrent linear"]
    assert sorted(decode_images.layout(r) for r in ft) == ["2 processes x 1 thread", "in-process"]
    ours = next(r for r in report.images if r.kind == "linear")
    against = {c["against_layout"]: c for c in report.comparisons if c["against"] == ft[0].kind}
    for layout_name, r in zip((decode_images.layout(r) for r in ft), ft):
        assert against[layout_name]["ratio"] == pytest.approx(ours.images_per_s / r.images_per_s)
    target = next(t for t in report.targets if "fast-transformers" in t["name"])
    assert "both 2 processes x 1 thread" in target["name"]
    assert target["measured"] == pytest.approx(against["2 processes x 1 thread"]["ratio"])


def test_the_roofline_costs_weights_and_products_in_the_bench_dtype():
    """bfloat16 weights move half the bytes, and the FLOP rate is probed in bfloat16."""
    cfg = ModelConfig(attention="linear", task="mnist", d_model=32, n_layers=2, n_heads=4, d_ff=64, max_len=784)
    assert token_cost(cfg, 100, 8, 2)["weight_bytes_per_token"] * 2 == token_cost(cfg, 100, 8)["weight_bytes_per_token"]
    machine = probe_machine(torch.bfloat16)
    assert machine["matmul_dtype"] == "bfloat16" and machine["bytes_per_weight"] == 2
    assert machine["matmul_flops"] == max(machine["matmul_flops_by_route"].values())  # the faster route sets it
    assert (
        roofline(cfg, 784, 8, machine)["weight_bytes_per_token"] == token_cost(cfg, 392, 8, 2)["weight_bytes_per_token"]
    )


def test_a_product_route_the_cpu_cannot_take_is_skipped_with_its_reason(monkeypatch):
    """What a CPU without AVX-512 does with oneDNN's bfloat16 products (it refuses to pack the weights): the
    roofline takes its rate from the route that works and says why the other was left out."""
    from benchmarks.roofline import ONEDNN, probe_machine

    def refuse(*args, **kwargs):
        raise RuntimeError("mkldnn bf16 path needs the cpu support avx512bw, avx512vl and avx512dq\nmore")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    machine = probe_machine(torch.bfloat16)
    assert list(machine["matmul_flops_by_route"]) == ["torch.mm"] and machine["matmul_route"] == "torch.mm"
    assert machine["matmul_routes_skipped"] == {
        ONEDNN: "mkldnn bf16 path needs the cpu support avx512bw, avx512vl and avx512dq"
    }


def test_both_product_routes_compute_the_same_product():
    from benchmarks.roofline import product_routes

    a = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    products = {route: product() for route, product in product_routes(a).items()}
    for route, got in products.items():
        torch.testing.assert_close(got, a @ a.T, msg=route)


def test_a_run_that_does_not_produce_every_token_is_refused():
    decode_images.check_generated("ok", torch.zeros(2, 5, dtype=torch.long), 2, 5)
    with pytest.raises(decode.BenchError, match=r"stopped early produced \(2, 4\) tokens .* not 2 x 5 tokens"):
        decode_images.check_generated("stopped early", torch.zeros(2, 4, dtype=torch.long), 2, 5)
    with pytest.raises(decode.BenchError, match=r"in \[0, 300\]"):
        decode_images.check_generated("out of vocabulary", torch.tensor([[0, 300]]), 1, 2)


def test_peers_without_their_packages_say_how_to_install_them(monkeypatch):
    from benchmarks.peers import build_peers

    monkeypatch.setitem(sys.modules, "fast_transformers", None)  # as if it were not installed: import fails
    with pytest.raises(decode.BenchError, match="install them with benchmarks/install_peers.sh"):
        build_peers("tiny", 16, 0)


def test_bench_uses_trained_weights_from_a_folder(tmp_path):
    for kind in ("linear", "softmax"):
        cfg = ModelConfig(attention=kind, task="mnist", d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=784)
        save_model(build_model(cfg), tmp_path / f"mnist-{kind}.safetensors", {"note": "test"})
    done = bench(
        "--quick",
        "--weights",
        str(tmp_path),
        "--kinds",
        "linear,softmax",
        "--batch-sizes",
        "2",
        "--json-out",
        str(tmp_path / "out.json"),
    )
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert set(result["models"]) == {"linear", "softmax"}
    for kind, info in result["models"].items():
        assert info["source"].endswith(f"mnist-{kind}.safetensors")
        assert info["config"]["d_model"] == 16
    assert {r["batch"] for r in result["images"]} == {2}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch-sizes", "1,zero"], "comma-separated integers"),
        (["--batch-sizes", "0"], "positive integers"),
        (["--kinds", "softmax,lstm"], "unknown attention kind"),
        (["--weights", "/nonexistent-folder"], "not a directory"),
        (["--url", "ftp://127.0.0.1:1"], "expected http://HOST:PORT"),
        (["--url", "http://127.0.0.1:1", "--concurrency", "0"], "--concurrency must be between"),
        (["--url", "http://127.0.0.1:1", "--duration", "5", "--ramp-up", "5"], "--ramp-up must be in"),
        (["--positions", "500,100"], "--positions must be increasing"),
        (["--workers", "0"], "--workers must be >= 1, got 0"),
        (["--workers", "2", "--peer-workers", "2,0"], "--peer-workers: expected positive integers"),
    ],
)
def test_bad_flags_say_what_is_expected(args, message, capsys):
    parser = argparse.ArgumentParser(prog="rnnserve bench")
    add_arguments(parser)
    try:  # argparse rejects malformed values itself; run() rejects unusable ones before measuring
        code = run(parser.parse_args(args))
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_later_positions_and_interpolated_sum():
    assert _later_positions(8, 64, 2) == [8, 63]
    # Steps measured 1 s each up to position 3, then 1 s at 4 and 5 s at 8: linear in between.
    sampled = [{"position": 4, "seconds": 1.0}, {"position": 8, "seconds": 5.0}]
    assert _interpolated_sum([1.0] * 4, sampled, 4, 9) == pytest.approx(1 + 2 + 3 + 4 + 5)


@pytest.mark.parametrize("kind", KINDS)
def test_roofline_state_traffic_matches_the_models_own_state(kind):
    """The per-token byte formulas agree with the state the model really allocates."""
    cfg = ModelConfig(
        attention=kind,
        task="text",
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        max_len=512,
        linformer_k=8,
        reformer_rounds=2,
        reformer_buckets=4,
        reformer_local_window=16,
    )
    model = build_model(cfg)
    t = 256
    _, moved = attention_cost(cfg, t)
    if capabilities(kind).constant_state:  # the whole fixed-size state is read and written
        assert moved == 2 * model.state_bytes_per_sequence(t)
    elif kind == "softmax":  # K, V of t positions read, one position written
        assert moved == model.state_bytes_per_sequence(t) + model.state_bytes_per_sequence(1)
    else:  # the expected bucket share of the cached keys and values, per round, and every position's bucket ids
        kv_per_position = 2 * cfg.d_model * FLOAT32 * cfg.n_layers
        window = cfg.reformer_local_window
        ids_per_position = cfg.n_layers * cfg.n_heads * cfg.reformer_rounds  # one byte each
        assert moved == kv_per_position * (cfg.reformer_rounds * t / cfg.reformer_buckets + window + 1) + (
            ids_per_position * (t + 1)
        )
    # Dense FLOPs are two per weight of the blocks and the output head.
    matrices = sum(
        p.numel()
        for n, p in model.named_parameters()
        if p.dim() == 2 and n.endswith(".weight") and not n.startswith(("tok_emb", "pos_emb"))
    )
    assert dense_flops(cfg) == 2 * matrices


def test_default_positions_include_the_issue_targets():
    positions = choose_positions(16_384)
    assert positions[0] == 100 and 16_000 in positions and positions[-1] == 16_384
    assert choose_positions(256) == sorted(set(choose_positions(256))) and max(choose_positions(256)) == 256


# ---------------------------------------------------------------- load generator against a real server


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """`python -m server serve` as a separate process on a free loopback port, tiny linear models."""
    folder = tmp_path_factory.mktemp("weights")
    save_tiny_model(folder, "mnist-linear", "linear", "mnist")
    save_tiny_model(folder, "text-linear", "linear", "text")
    port = free_port()
    log = folder / "server.log"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server",
                "serve",
                "--weights",
                str(folder),
                "--port",
                str(port),
                "--log-level",
                "warning",
                "--no-compile-decode",
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log)
        yield url
    finally:
        stop_process(process)


def _metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def test_image_load_counts_match_the_servers_counters(server_url):
    before = _metrics(server_url)
    result = run_load(
        LoadSettings(
            url=server_url, kind="image", concurrency=3, duration=2.0, max_requests=1000, keep_rows=20, timeout=60
        )
    )
    after = _metrics(server_url)

    def delta(name, **labels):
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert result["completed"] >= 1
    assert result["outcomes"] == {"200": result["sent"]}
    assert delta("rnnserve_requests_total", endpoint="/v1/images/completions", outcome="ok") == result["completed"]
    assert delta("rnnserve_completed_images_total", model="mnist-linear") == result["images"] == result["completed"]
    assert result["tokens"] == result["images"] * (28 - 20) * 28  # only the occluded rows are generated
    assert delta("rnnserve_generated_tokens_total", model="mnist-linear") == result["tokens"]
    assert result["latency_s"]["count"] == result["completed"]


def test_engine_split_accounts_for_a_load_run(server_url, tmp_path):
    """benchmarks/engine_split.py: from /metrics around a run, the engine's busy share, rows and step time."""
    from benchmarks.engine_split import main as engine_split

    (tmp_path / "before").write_text(_metrics(server_url))
    result = run_load(
        LoadSettings(
            url=server_url, kind="image", concurrency=3, duration=1.5, max_requests=1000, keep_rows=24, timeout=60
        )
    )
    (tmp_path / "after").write_text(_metrics(server_url))
    (tmp_path / "load.json").write_text(json.dumps(result))
    engine_split(
        [str(tmp_path / name) for name in ("before", "after", "load.json")] + ["--append", str(tmp_path / "e.jsonl")]
    )
    figures = json.loads((tmp_path / "e.jsonl").read_text())
    assert figures["rows_per_step"] * figures["steps"] == pytest.approx(result["tokens"])  # only this run decoded
    assert 1 <= figures["rows_per_step"] <= 3  # three clients
    assert 0 < figures["busy_share"] <= 1 and figures["step_ms"] > 0


def test_ramp_up_spreads_the_workers_first_requests(server_url):
    """With --ramp-up R and c workers, worker i sends its first request R * i / c seconds in (all at once by default:
    equal-length requests then finish and return together, in lockstep)."""
    result = run_load(
        LoadSettings(
            url=server_url,
            kind="image",
            concurrency=4,
            duration=2.0,
            ramp_up=1.2,
            max_requests=1000,
            keep_rows=26,
            timeout=60,
        )
    )
    assert result["outcomes"] == {"200": result["sent"]}
    starts = result["first_sends_s"]
    assert len(starts) == 4 and all(start >= 0.3 * i for i, start in enumerate(starts)), starts
    assert starts[-1] < 1.2 + 0.5, starts  # the last worker is not held back past its turn (bounded slack)
    together = run_load(
        LoadSettings(
            url=server_url, kind="image", concurrency=4, duration=0.5, max_requests=4, keep_rows=26, timeout=60
        )
    )
    assert together["first_sends_s"][-1] < 0.3, together["first_sends_s"]


def test_text_stream_load_stops_at_the_request_budget(server_url):
    before = _metrics(server_url)
    result = run_load(
        LoadSettings(
            url=server_url,
            kind="text",
            concurrency=2,
            duration=120.0,
            max_requests=5,
            max_tokens=12,
            prompt="Hi",
            timeout=60,
        )
    )
    after = _metrics(server_url)
    assert result["sent"] == result["completed"] == 5
    assert (
        metric_value(after, "rnnserve_requests_total", endpoint="/v1/completions", outcome="ok")
        - metric_value(before, "rnnserve_requests_total", endpoint="/v1/completions", outcome="ok")
        == 5
    )
    assert result["tokens"] == 5 * 12
    assert (
        metric_value(after, "rnnserve_generated_tokens_total", model="text-linear")
        - metric_value(before, "rnnserve_generated_tokens_total", model="text-linear")
        == 5 * 12
    )
    assert result["ttft_s"]["count"] == 5
    # One gap between consecutive events; bytes of a split UTF-8 character arrive together.
    assert 0 < result["inter_token_s"]["count"] <= 5 * (12 - 1)


def test_load_errors_are_counted_by_status(server_url):
    before = _metrics(server_url)
    result = run_load(
        LoadSettings(
            url=server_url, kind="text", concurrency=2, duration=60.0, max_requests=4, model="no-such-model", timeout=30
        )
    )
    after = _metrics(server_url)
    assert result["completed"] == 0
    assert result["outcomes"] == {"404": 4}
    assert (
        metric_value(after, "rnnserve_requests_total", endpoint="/v1/completions", outcome="not_found")
        - metric_value(before, "rnnserve_requests_total", endpoint="/v1/completions", outcome="not_found")
        == 4
    )


def test_requests_past_their_timeout_are_counted_as_timeouts(server_url):
    # A whole image is 784 decoding steps: far longer than a millisecond.
    result = run_load(
        LoadSettings(
            url=server_url, kind="image", concurrency=2, duration=30.0, max_requests=3, keep_rows=0, timeout=0.001
        )
    )
    assert result["sent"] == 3 and result["completed"] == 0
    assert result["outcomes"] == {"timeout": 3}


def test_load_against_a_closed_port_reports_connection_errors():
    result = run_load(
        LoadSettings(
            url=f"http://127.0.0.1:{free_port()}", kind="image", concurrency=2, duration=30.0, max_requests=3, timeout=5
        )
    )
    assert result["sent"] == 3 and result["completed"] == 0
    assert result["outcomes"] == {"connect_error": 3}


def test_flatness_alternates_two_states_of_each_constant_state_kind(quick_result):
    result, _, stdout = quick_result
    positions = [p["position"] for p in result["positions"]["linear"]]
    near, far = min(positions, key=lambda p: abs(p - 100)), max(positions)  # quick sweep ends below 16,000
    assert [f["kind"] for f in result["flatness"]] == list(CONSTANT_STATE_KINDS)
    for f in result["flatness"]:
        assert (f["near"], f["far"]) == (near, far) and f["steps"] == FLAT_ROUNDS * FLAT_STEPS_PER_ROUND
        assert (
            0 < f["near_seconds_min"] <= f["near_seconds_median"]
            and 0 < f["far_seconds_min"] <= f["far_seconds_median"]
        )
        assert f["ratio"] == pytest.approx(f["far_seconds_median"] / f["near_seconds_median"])
    target = next(t for t in result["targets"] if t["name"].startswith("linear step time"))
    assert target["measured"] == result["flatness"][0]["ratio"] and target["met"] == (target["measured"] <= 1.10)
    assert "alternating steps" in stdout


def test_flatness_steps_run_without_autograd(monkeypatch):
    """Autograd on would add a fixed cost to every step and pull the ratio towards 1."""
    seen = []
    real = decode_positions._time_steps
    monkeypatch.setattr(
        decode_positions,
        "_time_steps",
        lambda decoder, steps: seen.append(torch.is_inference_mode_enabled()) or real(decoder, steps),
    )
    model = build_model(decode_models.preset_config("tiny", "linear", task="text", max_len=512)).eval()
    settings = decode_settings.DecodeSettings(compiled=False)  # eager steps: what is checked is the mode they run in
    (result,) = decode_positions.measure_flatness({"linear": model}, 10, 200, settings, lambda line: None)
    assert seen and all(seen) and result.steps == FLAT_ROUNDS * FLAT_STEPS_PER_ROUND


def test_step_kernel_forms_compute_the_same_thing():
    """The forms `python -m benchmarks.step_kernels` times of one kind are one computation: same output, and
    for the recurrent kinds the same state after the update (in its own layout), as the kind's first form."""
    from benchmarks.step_kernels import cases

    groups: dict[str, list] = {}
    for name, form in cases(batch=3, prefix=9).items():
        groups.setdefault(name.split(",")[0], []).append(form)
    assert sorted(len(forms) for forms in groups.values()) == [2, 2, 3]
    for (first, first_args), *others in groups.values():
        with torch.inference_mode():
            out_first = first(*first_args)
        for second, second_args in others:
            with torch.inference_mode():
                out_second = second(*second_args)
            torch.testing.assert_close(out_first.reshape(out_second.shape), out_second, rtol=1e-5, atol=1e-5)
            for a, b in zip(
                first_args, second_args
            ):  # states updated alike (a transposed layout has another shape: k != D)
                torch.testing.assert_close(a, b if a.shape == b.shape else b.transpose(-1, -2))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--duty", "0"], "--duty must be in (0, 1), got 0.0"),
        (["--duty", "1.5"], "--duty must be in (0, 1), got 1.5"),
        (["--steps", "900"], "--steps must be in [1, 784] (the preset's positions), got 900"),
    ],
)
def test_gil_contention_flags_say_what_is_expected(args, message, capsys):
    from benchmarks.gil_contention import main

    with pytest.raises(SystemExit):
        main(args)
    assert message in capsys.readouterr().err


def test_the_gpt2_benchmark_imports_a_save_pretrained_folder_and_linearizes_every_weight(tmp_path):
    pytest.importorskip("transformers", reason="writes the GPT-2 folder (make test installs it)")
    from benchmarks.gpt2_small import TINY, linearized, write_gpt2_folder
    from model.io.hf_import import import_folder
    from model.io.weights import load_model

    write_gpt2_folder(tmp_path / "hf", TINY, seed=0)
    import_folder(tmp_path / "hf", tmp_path / "gpt2.safetensors")
    softmax, _ = load_model(tmp_path / "gpt2.safetensors")
    assert (softmax.config.vocab_size, softmax.config.n_layers) == (TINY["vocab_size"], TINY["n_layer"])
    linear = linearized(softmax)
    assert (linear.config.attention, linear.config.linear_feature_map) == ("linear", "hedgehog")
    kept = dict(softmax.named_parameters())
    for name, value in linear.named_parameters():
        assert torch.equal(value, kept[name]) if name in kept else "feature_map" in name, name


@pytest.mark.parametrize(
    "hardware, capability, forced, route, measured",
    [
        ("AVX-512", "avx2", None, "avx2", "AVX2, emulated on an AVX-512 CPU"),
        ("AVX-512", None, None, "avx512", "AVX-512"),
        # kernels forced past PyTorch's cap: not an AVX2 run, and not a plain AVX-512 one
        (
            "AVX-512",
            "avx2",
            "avx512",
            "avx512",
            "AVX-512, capped or forced (ATEN_CPU_CAPABILITY=avx2; kernels' route avx512)",
        ),
        (
            "AVX-512",
            "default",
            None,
            "scalar",
            "AVX-512, capped or forced (ATEN_CPU_CAPABILITY=default; kernels' route scalar)",
        ),
        ("AVX2", None, "generic", "generic", "AVX2, capped or forced (RNNSERVE_CPU_ROUTE; kernels' route generic)"),
    ],
)
def test_a_capped_run_is_kept_apart_from_the_class_it_stands_for(
    monkeypatch, hardware, capability, forced, route, measured
):
    for name in decode_environment.VECTOR_CAPS:
        monkeypatch.delenv(name, raising=False)
    if capability is not None:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    if forced is None:
        monkeypatch.delenv("RNNSERVE_CPU_ROUTE", raising=False)
    else:
        monkeypatch.setenv("RNNSERVE_CPU_ROUTE", forced)
    assert decode_environment.measured_class(hardware, route) == measured


def test_the_fma_probe_measures_each_vector_width_the_cpu_has():
    from benchmarks import fma_peak
    from model.kernels.cpu_features import read_cpu_features

    flags = read_cpu_features().flags
    if not {"avx2", "fma"} <= flags:
        pytest.skip("the FMA probe is x86-only (AVX2 and FMA)")
    if not compiler_on_path():
        pytest.skip("no C++ compiler on PATH")
    result = fma_peak.measure()
    assert result["avx2_gflops"] > 0
    assert ("avx512_gflops" in result) == ("avx512f" in flags)


def test_the_fma_probe_says_why_it_cannot_run_on_a_cpu_without_avx2(monkeypatch):
    from benchmarks import fma_peak, roofline
    from model.kernels.cpu_features import CpuFeatures

    monkeypatch.setattr(fma_peak, "read_cpu_features", lambda: CpuFeatures(frozenset({"asimd"})))
    with pytest.raises(fma_peak.ProbeUnavailable, match="no AVX2 and FMA .*ARM NEON.*x86-only"):
        fma_peak.measure()
    with pytest.raises(SystemExit, match="no AVX2 and FMA .*ARM NEON.*x86-only"):
        fma_peak.main([])
    # The bench records why, rather than stopping: its run goes on without the figure.
    roofline._fma_peak_or_why.cache_clear()
    try:
        assert roofline.fma_peak_or_why() == {
            "fma_peak_skipped": "this CPU has no AVX2 and FMA (its class: ARM NEON): the probe is x86-only"
        }
    finally:
        roofline._fma_peak_or_why.cache_clear()


def test_a_probe_that_cannot_start_says_so_rather_than_stopping_the_bench(tmp_path):
    from benchmarks import fma_peak

    with pytest.raises(fma_peak.ProbeUnavailable, match="could not run: FileNotFoundError"):
        fma_peak._run_probe(str(tmp_path / "no-such-compiler"), wide=False)


def test_the_bench_records_the_core_s_fma_peak_beside_its_product_rate():
    from benchmarks import roofline
    from model.kernels.cpu_features import read_cpu_features

    machine = roofline.probe_machine(torch.float32)
    flags = read_cpu_features().flags
    if not {"avx2", "fma"} <= flags or not compiler_on_path():
        assert "fma_peak_skipped" in machine and "fma_peak" not in machine
        return
    assert "fma_peak" in machine, machine.get("fma_peak_skipped")  # x86 with a compiler: the probe runs
    peak = machine["fma_peak"]
    assert peak["avx2_gflops"] > 0 and ("avx512_gflops" in peak) == ("avx512f" in flags)
    machine["fma_peak"]["avx2_gflops"] = -1.0  # the caller's copy: the next probe's figures are the measured ones
    assert roofline.fma_peak_or_why()["fma_peak"]["avx2_gflops"] > 0


def test_the_softmax_kernel_benchmark_refuses_to_time_a_wrong_kernel(monkeypatch):
    from benchmarks import softmax_kernel
    from model.kernels.loader import load_kernels

    if not load_kernels().ok:
        pytest.skip("the CPU kernels do not build here")
    right = softmax_kernel.measure(position=20, layers=1)
    assert right["max_error"] < 1e-4 and right["bytes_per_step"] == 2 * 64 * 4 * 21 * 32 * 4  # K and V, 21 positions
    monkeypatch.setattr(softmax_kernel, "reference_attention", lambda q, k, v, last: torch.zeros_like(q))
    with pytest.raises(SystemExit, match="from PyTorch's: not timing a wrong result"):
        softmax_kernel.measure(position=20, layers=1)
