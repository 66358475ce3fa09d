"""`python -m benchmarks.linearize_cost`: what one training step of each way of linearizing costs on GPT-2 small's
shape, in seconds and peak memory.

A `GPT2LMHeadModel` of GPT-2 small's shape (12 layers, 768 dims, 12 heads, 1,024 positions; random weights, as
benchmarks/gpt2_small.py writes it) is imported with `rnnserve import hf`'s own function, and its hybrid twin (a
softmax window plus linear attention, `rnnserve linearize --kind hybrid`'s model, warm-started from its weights) is
trained one step at a time at batch 1 x 1,024 tokens, in each of the ways `rnnserve linearize` trains it:

- `full`: every weight trained (`rnnserve linearize` without --lora-rank), AdamW, distilled from the softmax model
  as linearize does by default (--no-teacher: the data's loss alone);
- `transfer`: the first stage's step (`--transfer-steps`, output-mse): each layer's attention output against the
  softmax model's, only the feature maps and the mix trained, under the same autocast;
- `lora`: the second stage's step (`--lora-rank 8`): adapters on q/k/v/o, the feature maps and the mix trained,
  every other weight frozen, distilled as `full` is.

Each configuration runs in a child process of its own, so that its peak memory is its own: the process's resident
set high-water mark (`getrusage`'s ru_maxrss), read once the models are built (before the first step) and after
the last. That mark counts everything the process held at its peak: Python, torch, both models (the softmax
teacher is loaded in every configuration, as linearize loads it), gradients, optimiser moments and the step's
activations. One warm-up step, then --steps timed steps; the table gives the median and best.

    python -m benchmarks.linearize_cost --threads 1 --out benchmarks/results/linearize-cost-DATE.json
    python -m benchmarks.linearize_cost --quick    # a two-layer model, a few seconds: checks the run, measures nothing

`python -m benchmarks.docs_tables` puts the newest `linearize-cost-DATE.json` into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .docs_tables import linearize_cost_lines

CONFIGURATIONS = ("full", "transfer", "lora")
TINY_LENGTH = 64  # --quick: tokens per row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.linearize_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="a two-layer model and short rows: checks the run")
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS), help="comma-separated, in this order")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration, after one warm-up")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads in each child")
    parser.add_argument("--batch", type=int, default=1, help="rows per step")
    parser.add_argument("--length", type=int, help="tokens per row (default: the model's context, 1,024)")
    parser.add_argument("--window", type=int, default=64, help="the hybrid's softmax window (--window)")
    parser.add_argument("--feature-map", default="hedgehog", choices=("hedgehog", "t2r"), help="as linearize's")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--no-teacher", action="store_true", help="full and lora without distillation")
    parser.add_argument("--autocast", choices=("auto", "bf16", "off"), default="auto", help="as `rnnserve train`")
    parser.add_argument("--child", choices=CONFIGURATIONS, help=argparse.SUPPRESS)  # one configuration, in-process
    parser.add_argument("--source", type=Path, help=argparse.SUPPRESS)  # the imported softmax model (children)
    args = parser.parse_args(argv)
    unknown = [c for c in args.configurations.split(",") if c not in CONFIGURATIONS]
    if unknown:
        parser.error(f"unknown configuration(s) {','.join(unknown)}; expected some of {','.join(CONFIGURATIONS)}")
    for flag in ("steps", "threads", "batch", "window", "lora_rank"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    return args


# ---------------------------------------------------------------- one configuration, in a child process


def high_water_mib() -> float:
    """The process's resident set high-water mark so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def hybrid_twin(source: Path, args: argparse.Namespace):
    """The softmax model (frozen, the teacher) and its hybrid twin on its weights, as linearize builds it."""
    from model.transformer import build_model
    from model.io.weights import load_model
    from training.warm_start import init_from

    teacher, _ = load_model(source)
    teacher.requires_grad_(False)
    teacher.eval()
    config = teacher.config.replace(attention="hybrid", hybrid_window=args.window, hybrid_feature_map=args.feature_map)
    student = build_model(config)
    init_from(str(source), student)
    return teacher, student.train()


def distillation_from(teacher, source: Path, args: argparse.Namespace):
    from training.distillation import DEFAULT_DISTILL_WEIGHT, Distillation

    if args.no_teacher:
        return None
    return Distillation((teacher,), (source.name,), ("",), ("",), DEFAULT_DISTILL_WEIGHT)


def step_function(configuration: str, teacher, student, source: Path, args: argparse.Namespace):
    """One optimiser step of `configuration` on a (B, T) batch, as linearize runs it."""
    from training import train
    from training.attention_transfer import output_step, taught_parameters
    from training.lora import add_lora

    autocast = train.autocast_context(torch.device("cpu"), args.autocast)
    if configuration == "transfer":  # training/attention_transfer.py's transfer(), one step
        parameters = taught_parameters(student)
        student.requires_grad_(False)
        for parameter in parameters:
            parameter.requires_grad_(True)
        opt = torch.optim.AdamW(parameters, lr=1e-3, weight_decay=0.0)

        def transfer_step(tokens: torch.Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            output_step(student, tokens, teacher, autocast)
            opt.step()

        return transfer_step
    if configuration == "lora":
        add_lora(student, args.lora_rank, 2.0 * args.lora_rank)  # train's default alpha
    opt = train.make_optimizer(student, 1e-4, 0.1)
    distillation = distillation_from(teacher, source, args)
    return lambda tokens: train.optimizer_step(student, opt, tokens, autocast, distillation)


def run_child(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    teacher, student = hybrid_twin(args.source, args)
    step = step_function(args.child, teacher, student, args.source, args)
    length = args.length or student.config.max_len
    tokens = torch.randint(0, student.config.vocab_size, (args.batch, length))  # (B, T)
    before_steps = high_water_mib()
    seconds, cpu_seconds = [], []
    for repeat in range(args.steps + 1):  # repeat 0 warms up
        wall, cpu = time.perf_counter(), time.process_time()
        step(tokens)
        if repeat:
            seconds.append(time.perf_counter() - wall)
            cpu_seconds.append(time.process_time() - cpu)
    return {
        "configuration": args.child,
        "trainable_parameters": sum(p.numel() for p in student.parameters() if p.requires_grad),
        "parameters": student.num_parameters(),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "median_s": statistics.median(seconds),
        "best_s": min(seconds),
        "peak_rss_mib": high_water_mib(),
        "peak_rss_before_steps_mib": before_steps,
        "autocast_bf16": train_uses_autocast(args.autocast),
        "distilled": args.child != "transfer" and not args.no_teacher,
    }


def train_uses_autocast(choice: str) -> bool:
    from training.train import uses_autocast

    return uses_autocast(torch.device("cpu"), choice)


# ---------------------------------------------------------------- the run


def imported_gpt2(folder: Path, quick: bool) -> Path:
    """GPT-2 small's shape (or --quick's tiny one) with random weights, imported as `rnnserve import hf` does."""
    from model.io.hf_import import import_folder

    from .gpt2_small import GPT2_SMALL, TINY, write_gpt2_folder

    write_gpt2_folder(folder / "hf", TINY if quick else GPT2_SMALL, seed=0)
    out = folder / "gpt2-small.safetensors"
    import_folder(folder / "hf", out)
    return out


def child_command(configuration: str, source: Path, args: argparse.Namespace) -> list[str]:
    flags = ["--child", configuration, "--source", str(source), "--steps", str(args.steps)]
    flags += ["--threads", str(args.threads), "--batch", str(args.batch), "--window", str(args.window)]
    flags += ["--feature-map", args.feature_map, "--lora-rank", str(args.lora_rank), "--autocast", args.autocast]
    flags += ["--length", str(args.length)] if args.length else []
    flags += ["--no-teacher"] if args.no_teacher else []
    return [sys.executable, "-m", "benchmarks.linearize_cost", *flags]


def run_configuration(configuration: str, source: Path, args: argparse.Namespace) -> dict:
    done = subprocess.run(child_command(configuration, source, args), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {configuration} child failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def environment(threads: int) -> dict:
    from .decode_environment import _cpu_name, machine_load

    return {
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "processor": _cpu_name(),
        "torch_threads": threads,
        "load": machine_load(),
    }


def print_table(report: dict) -> None:
    for line in linearize_cost_lines(report):
        print(line)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return 0
    if args.quick and args.length is None:
        args.length = TINY_LENGTH
    if args.quick:
        args.window = min(args.window, args.length // 4)  # older keys than the window in every row
    report = {
        "command": "python -m benchmarks.linearize_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": args.quick,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "child", "source")},
        "memory": "each child process's resident set high-water mark (getrusage ru_maxrss)",
        "environment_start": environment(args.threads),
        "results": [],
    }
    with tempfile.TemporaryDirectory(prefix="linearize-cost-") as tmp:
        source = imported_gpt2(Path(tmp), args.quick)
        for configuration in args.configurations.split(","):
            report["results"].append(run_configuration(configuration, source, args))
            result = report["results"][-1]
            print(
                f"{configuration}: {result['median_s']:.2f} s/step, peak {result['peak_rss_mib']:,.0f} MiB", flush=True
            )
    report["load_after"] = environment(args.threads)["load"]
    print_table(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
