"""`rnnserve bench`: in-process decoding benchmark, or an HTTP load generator with --url."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

from model.attention.kinds import attention_kinds
from training.presets import PRESETS

from .errors import BenchError

QUICK = {  # a tiny model and a few steps of each measurement: seconds, for tests; explicit flags still win
    "preset": "tiny",
    "batch_sizes": (1, 4),
    "image_tokens": 64,
    "max_position": 256,
    "steps_per_position": 2,
    "nocache_pixels": 8,
    "nocache_samples": 2,
    "compiled": False,  # compiling takes tens of seconds per graph
}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,8,64, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers such as 1,8,64, got {text!r}")
    return values


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in attention_kinds()]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"unknown attention kind(s) {', '.join(unknown) or text!r}; expected some of {','.join(attention_kinds())}"
        )
    return kinds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", help="benchmark a running server at this address (http://HOST:PORT) instead of in-process"
    )
    parser.add_argument("--json-out", type=Path, help="write the full results as JSON to this file")
    ins = parser.add_argument_group("in-process benchmark")
    # Defaults of None: the value comes from DecodeSettings, or from QUICK with --quick.
    ins.add_argument("--preset", choices=sorted(PRESETS), help="architecture of the random-weight models (default cpu)")
    ins.add_argument("--weights", help="folder of .safetensors files: bench its MNIST models instead of a preset")
    ins.add_argument("--kinds", type=_kinds, help="comma-separated attention kinds (default all)")
    ins.add_argument("--batch-sizes", type=_int_list, help="e.g. 1,8,64 (the default)")
    ins.add_argument("--image-tokens", type=int, help="tokens per generation (default 784, a whole image)")
    ins.add_argument("--repeats", type=int, help="timed runs per generation measurement; the best is kept (default 1)")
    ins.add_argument("--max-position", type=int, help="largest position of the step-time sweep (default 16384)")
    ins.add_argument("--positions", type=_int_list, help="explicit sweep positions, increasing")
    ins.add_argument("--steps-per-position", type=int, help="timed decoding steps at each position (default 16)")
    ins.add_argument("--position-batch", type=int, help="sequences per step in the position sweep (default 1)")
    ins.add_argument("--nocache-pixels", type=int, help="pixels of the no-cache baseline really run (default 64)")
    ins.add_argument("--nocache-samples", type=int, help="later positions timed for its extrapolation (default 4)")
    ins.add_argument("--seed", type=int)
    ins.add_argument("--device", default="cpu", help="cpu, cuda, or auto")
    ins.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="model weights (default float32)")
    ins.add_argument(
        "--kv-cache-dtype",
        choices=("float32", "bfloat16"),
        help="the numbers softmax models cache keys and values in, and hybrid models their ring (not its sums), "
        "as the server's flag (default: as --dtype); "
        "the peers keep theirs in --dtype",
    )
    ins.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        help="on CUDA, replay decode steps of graphable kinds (linear, Linformer) as CUDA graphs (default on)",
    )
    ins.add_argument(
        "--compile-decode",
        dest="compiled",
        action=argparse.BooleanOptionalAction,
        help="on the CPU, decode compilable kinds (softmax, linear, Linformer, Reformer) through torch.compile, as "
        "the server does (default on; --quick: off)",
    )
    ins.add_argument(
        "--eager-too",
        action=argparse.BooleanOptionalAction,
        help="with --compile-decode, also time each compiled kind's eager path (default on)",
    )
    ins.add_argument(
        "--peers",
        action="store_true",
        help="also time fast-transformers, a plain PyTorch recurrence, HF GPT-2 and HF Reformer at the "
        "preset's sizes (install: benchmarks/install_peers.sh)",
    )
    ins.add_argument("--peer-batch-sizes", type=_int_list, help="batch sizes for the peers (default: the largest)")
    ins.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ins.add_argument(
        "--workers",
        type=int,
        help="time rnnserve as this many processes started together, each with threads/N threads and its share "
        "of the rows, as the server runs a small model on the CPU (default 1; 2 is the server's layout on 2 CPUs)",
    )
    ins.add_argument(
        "--peer-workers",
        type=_int_list,
        help="the peers' layouts, each timed in the same run: e.g. 1,2 (default: as --workers, like for like; "
        "1: one process on all the threads, as a library's users run it)",
    )
    ins.add_argument("--plot", type=Path, help="draw step time and state bytes against position to this PNG")
    ins.add_argument("--quick", action="store_true", help="tiny model, few steps: finishes in seconds (tests)")
    from .load import add_load_arguments

    add_load_arguments(parser.add_argument_group("load generator (with --url)"))


def run(args: argparse.Namespace) -> int:
    from model.io.weights import WeightsError

    try:
        return _run_load(args) if args.url else _run_decode(args)
    except (BenchError, WeightsError) as exc:
        print(f"rnnserve bench: error: {exc}", file=sys.stderr)
        return 2


def _run_decode(args: argparse.Namespace) -> int:
    import torch

    from .decode import run_decode_bench
    from .decode_settings import DecodeSettings
    from .tables import full_report

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    base = DecodeSettings(**QUICK) if args.quick else DecodeSettings()
    given = {
        f.name: getattr(args, f.name)
        for f in fields(DecodeSettings)
        if f.name != "device" and getattr(args, f.name, None) is not None
    }
    settings = replace(base, device=_device(args.device), **given)
    report = run_decode_bench(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(full_report(report))
    result = report.to_dict() | {"command": args.command_line}
    _write_json(args.json_out, result)
    if args.plot:
        from .plot import plot_decode

        plot_decode(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _run_load(args: argparse.Namespace) -> int:
    from .load import load_settings, run_load, summary_text

    result = run_load(load_settings(args))
    print(summary_text(result))
    _write_json(args.json_out, result | {"command": args.command_line})
    return 0 if result["completed"] > 0 else 1


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError(f"--device {name}: no CUDA device is available here; use --device cpu or auto")
    if name != "cpu" and not name.startswith("cuda"):
        raise BenchError(f"--device {name!r}: expected cpu, cuda, cuda:N or auto")
    return name


def _write_json(path: Path | None, data: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"wrote {path}")
