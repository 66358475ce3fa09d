"""`python -m benchmarks.prefix_routing_ray`: the prefix cache's hit rate on two Ray Serve replicas, with
prefix-aware routing (`--ray-prefix-chars`, server/rayserve/router.py) against Serve's default router.

`rnnserve serve --ray --replicas 2` is started once per router on the shipped weights/ (or, with --quick, a tiny
random text model); a shared-prefix workload (groups of requests whose prompts start with the group's long shared
part, the first being that part alone, the groups interleaved) goes through Serve's proxy; the hit rate is the
prompt tokens the replicas' caches gave over all prompt tokens, from each answer's
`usage.prompt_tokens_details.cached_tokens`. One replica's figure is measured too, as what two should approach.
Needs the Ray extra (`pip install -e '.[ray]'`), two free CPUs and ports 8000 and 8080-8082.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .decode_environment import environment, machine_load
from .decode_settings import DecodeSettings
from .report_cli import progress, report_parser, write_report

ROOT = Path(__file__).resolve().parents[1]
READY_LINE = "rnnserve: serving through Ray Serve"
# (replicas, --ray-prefix-chars): the key must lie within the shared part (the shipped text models read 256 tokens)
ROUTERS = {"one replica": ("1", "64"), "prefix-aware": ("2", "64"), "Serve's default": ("2", "0")}


def workload(groups: int, per_group: int, shared_chars: int) -> list[str]:
    """Groups' prompts, interleaved: each group's shared part alone first, then with a question after it."""
    shared = [
        f"Conversation {g}. " + "The system prompt every turn repeats. " * (shared_chars // 38) for g in range(groups)
    ]
    return [shared[g] + (f"Question {i}?" if i else "") for i in range(per_group) for g in range(groups)]


def hit_rate(client: httpx.Client, model: str, prompts: list[str], tokens: int) -> dict:
    prompt_tokens = cached = 0
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
        usage = client.post("/v1/completions", json=body).raise_for_status().json()["usage"]
        prompt_tokens += usage["prompt_tokens"]
        cached += usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"requests": len(prompts), "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "hit_rate": cached / prompt_tokens}  # fmt: skip


def serve_on_ray(weights: Path, replicas: str, prefix_chars: str, log: Path, port: int) -> subprocess.Popen:
    command = [str(Path(sys.executable).parent / "rnnserve"), "serve", "--ray", "--weights", str(weights),
               "--port", str(port), "--replicas", replicas, "--ray-prefix-chars", prefix_chars,
               "--cpus-per-replica", "1", "--device", "cpu", "--no-compile-decode"]  # fmt: skip
    out = log.open("wb")
    # Ray's files beside the log (a short path: Ray's socket paths have a length limit), not a shared /tmp/ray
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_TMPDIR": str(log.parent)}
    server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while READY_LINE not in log.read_text(errors="replace"):
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"rnnserve serve --ray did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(1)
    return server


def tiny_weights(folder: Path) -> None:
    from model import ModelConfig, build_model
    from model.io.weights import save_model

    config = ModelConfig(attention="linear", task="text", d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=512)
    save_model(build_model(config).eval(), folder / "text-linear.safetensors", {})


def run(quick: bool, model: str, port: int, progress=print) -> dict:
    groups, per_group, shared_chars, tokens = (4, 3, 120, 4) if quick else (16, 8, 180, 16)
    prompts = workload(groups, per_group, shared_chars)
    report = {"environment": environment(DecodeSettings()) | machine_load(), "model": model,
              "workload": {"groups": groups, "per_group": per_group, "shared_chars": shared_chars}, "routers": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="rnnray-") as tmp:
        weights = ROOT / "weights"
        if quick:
            weights = Path(tmp) / "weights"
            weights.mkdir()
            tiny_weights(weights)
        for name, (replicas, prefix_chars) in ROUTERS.items():
            server = serve_on_ray(weights, replicas, prefix_chars, Path(tmp) / f"{prefix_chars}-{replicas}.log", port)
            try:
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
                    report["routers"][name] = hit_rate(client, model, prompts, tokens)
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(timeout=600)
            progress(f"{name}: hit rate {report['routers'][name]['hit_rate']:.3f}")
    report["load_after"] = machine_load()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = report_parser("benchmarks.prefix_routing_ray", __doc__, "a tiny random model and a small workload")
    parser.add_argument("--model", default="shakespeare-linear", help="the weights/ model to ask (not with --quick)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    model = "text-linear" if args.quick else args.model
    report = run(args.quick, model, args.port, progress)
    write_report(report, "benchmarks.prefix_routing_ray", argv, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
