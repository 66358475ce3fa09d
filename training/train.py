"""`rnnserve train`: train one model on MNIST or a text file and save it as .safetensors.

The learning rate warms up linearly, then follows a cosine over the run's
horizon: --steps, --minutes, or whichever ends first. A checkpoint (model,
optimiser, progress and RNG states; see training/checkpoint.py) is written
every --checkpoint-every steps and when SIGTERM or SIGINT stops the run, by
default to weights/checkpoints/NAME.ckpt beside --out; --resume continues
from it with the same schedule, data order and random state (bit for bit
with --checkpoint-precision float32). Steps are the resumable horizon: a
--minutes schedule depends on wall time, so it resumes, but not exactly.
At the end the weights are saved in 16-bit floats, evaluated from that very
file (MNIST test bits/dim or text validation loss), and the results are
stored in the file's metadata with the data used, examples seen, wall time
and device. The flags are defined in training/arguments.py.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from model import ModelConfig, Transformer, build_model
from model.config import ConfigError
from model.architecture import block_options
from model.attention.kinds import kind_options
from model.io.vocabulary import Vocabulary, vocabulary_for
from model.io.weights import WeightsError, read_chat_template, read_metadata, read_tokenizer, save_model, update_info

from .arguments import SAVE_DTYPE_NAMES
from .averaging import WeightAverage
from .checkpoint import CheckpointWriter, read_checkpoint
from .data import MNIST_PIXELS, DataError, load_mnist, load_text, random_shift
from .distillation import (
    DEFAULT_DISTILL_WEIGHT,
    Distillation,
    accept_file_digests,
    check_teacher_shares,
    load_distillation,
)
from .errors import TrainError
from .evaluate import device_description, evaluate_file, print_table, resolve_device
from .lineage import inherited_lineage
from .presets import PRESETS
from .lora import add_lora, merge_lora
from .resume import check_config, restore, run_changes
from .run_state import CURVE_COLUMNS, Progress, RunSettings
from .stop_signals import StopRequest, TrainingStopped, stop_on_signals
from .warm_start import init_from

SAVE_DTYPES = {name: getattr(torch, name) for name in SAVE_DTYPE_NAMES}
MIN_LR_FRACTION = 0.1  # the cosine ends at 10% of the peak rate
MAX_SHIFT = 4  # pixels: a 28x28 digit has a blank border about this wide


@dataclass
class Batches:
    """Random training batches: whole MNIST images (each shifted by up to max_shift pixels) or random text windows."""

    data: torch.Tensor  # MNIST (N, 784) or text (N,) uint8
    seq_len: int
    batch_size: int
    generator: torch.Generator
    max_shift: int = 0  # MNIST augmentation; the shifts come from the same generator, so resumes replay them

    def next(self) -> torch.Tensor:
        """(B, seq_len) int64 tokens."""
        if self.data.dim() == 2:
            rows = torch.randint(self.data.shape[0], (self.batch_size,), generator=self.generator)
            return random_shift(self.data[rows], self.max_shift, self.generator).long()
        starts = torch.randint(self.data.shape[0] - self.seq_len + 1, (self.batch_size,), generator=self.generator)
        offsets = starts[:, None] + torch.arange(self.seq_len)
        return self.data[offsets].long()


# What a run started from a file keeps of it beyond the flags: its vocabulary and the layer details that come
# with an imported model (GPT-2's tied output layer, GELU's tanh form, layer-norm epsilon, a Llama's block).
INHERITED_FIELDS = ("vocab_size", "bos_token", "eos_token", "tied_head", "gelu", "ln_eps", *block_options())


@dataclass(frozen=True)
class Inherited:
    """What `--init-from FILE` hands a run besides weights: config fields, the tokenizer (None: bytes) and the chat
    template (None: none), which the saved model keeps (a linearized chat model still chats)."""

    fields: dict[str, Any]
    tokenizer: str | None = None
    chat_template: str | None = None


def inherited_from(args: argparse.Namespace) -> Inherited:
    if not args.init_from:
        return Inherited({})
    try:
        config, _ = read_metadata(args.init_from)
        tokenizer, chat_template = read_tokenizer(args.init_from), read_chat_template(args.init_from)
    except WeightsError as exc:
        raise TrainError(f"--init-from: {exc}") from exc
    return Inherited({name: getattr(config, name) for name in INHERITED_FIELDS}, tokenizer, chat_template)


def build_config(args: argparse.Namespace, inherited: Inherited = Inherited({})) -> ModelConfig:
    preset = PRESETS[args.preset]
    return ModelConfig(
        **inherited.fields,
        attention=args.attention,
        task=args.task,
        n_layers=args.layers or preset.n_layers,
        d_model=args.d_model or preset.d_model,
        n_heads=args.heads or preset.n_heads,
        d_ff=args.d_ff or preset.d_ff,
        max_len=MNIST_PIXELS if args.task == "mnist" else args.context,
        dropout=args.dropout,
        pos_encoding=args.pos_encoding,
        options={key: getattr(args, key) for key in kind_options()},
        output_head=args.output_head,
        mixtures=args.mixtures,
    )


def load_training_data(args: argparse.Namespace, vocabulary: Vocabulary) -> tuple[torch.Tensor, str]:
    """Training tokens (a text's bytes, or its tokens in the model's tokenizer) and the path they came from."""
    if args.task == "mnist":
        split = load_mnist(args.data, "train")
        return split.images, split.path
    text = load_text(args.data, None if vocabulary.is_bytes else vocabulary.encode)
    if text.train.shape[0] <= args.context:
        raise DataError(
            f"{args.data}: training split has {text.train.shape[0]} tokens, need more than --context {args.context}"
        )
    return text.train, text.path


def learning_rate(base: float, step: int, warmup: int, progress: float) -> float:
    """Linear warmup, then cosine from base to MIN_LR_FRACTION * base as progress goes 0 -> 1."""
    warm = min(1.0, (step + 1) / max(1, warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return base * warm * (MIN_LR_FRACTION + (1.0 - MIN_LR_FRACTION) * cosine)


def run_progress(prog: Progress, steps: int | None, minutes: float | None) -> float:
    """Fraction of the horizon done: the larger of the step and time fractions."""
    by_steps = prog.step / steps if steps else 0.0
    by_time = prog.elapsed_s / (60.0 * minutes) if minutes else 0.0
    return max(by_steps, by_time)


def sequence_loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats/token) of predicting tokens (B, T) from BOS-shifted inputs."""
    return -model.token_log_probs(tokens).mean()


def checkpoint_path(args: argparse.Namespace) -> Path:
    if args.checkpoint:
        return Path(args.checkpoint)
    out = Path(args.out)
    return out.parent / "checkpoints" / (out.stem + ".ckpt")


def resume_path(args: argparse.Namespace) -> Path | None:
    """The checkpoint to resume from: ours, else one next to --out where rnnserve wrote them before."""
    ours, older = checkpoint_path(args), Path(args.out).with_suffix(".ckpt")
    if ours.is_file():
        return ours
    if not args.checkpoint and older.is_file():
        print(f"resuming from {older} (the older default place); new checkpoints go to {ours}", file=sys.stderr)
        return older
    return None


def resume(
    args: argparse.Namespace, writer: CheckpointWriter, model: Transformer, opt: torch.optim.Optimizer, batches: Batches
) -> tuple[Progress, dict[str, torch.Tensor] | None]:
    """Progress and weight average of the checkpoint this run continues, after loading it (fresh if there is none)."""
    path = resume_path(args)
    if path is None:
        print(f"no checkpoint at {writer.path}: starting from step 0", file=sys.stderr)
        return Progress(), None
    ckpt = read_checkpoint(path)
    check_config(path, ckpt.config, model.config)  # the architecture first: the most basic mismatch
    if ckpt.run is not None:
        saved = accept_file_digests(ckpt.run, writer.run, args.teacher or [])
        check_same_run(path, saved, writer.run, args.extend, ckpt.progress)
    prog = restore(path, ckpt, model, opt, batches.generator)
    print(f"resumed from {path} at step {prog.step}", file=sys.stderr)
    return prog, ckpt.average


def check_same_run(path: Path, saved: RunSettings, now: RunSettings, extend: bool, prog: Progress) -> None:
    """Refuse settings that would change the schedule or data order, except a horizon --extend accepts."""
    changes = run_changes(saved, now)
    if not changes:
        return
    fixed = {k: v for k, v in changes.items() if k not in RunSettings.EXTENDABLE}
    listed = "; ".join(f"{name} {old} -> {new}" for name, (old, new) in changes.items())
    if fixed or not extend:
        hint = "" if fixed else ", or add --extend to continue over the new horizon"
        raise TrainError(
            f"{path}: this run differs from the checkpoint's ({listed}); resume with the same "
            f"flags to continue the same schedule and data order{hint}"
        )
    was_lr = learning_rate(saved.lr, prog.step, saved.warmup_steps, run_progress(prog, saved.steps, saved.minutes))
    now_lr = learning_rate(now.lr, prog.step, now.warmup_steps, run_progress(prog, now.steps, now.minutes))
    print(
        f"--extend: {listed}; the cosine schedule is recomputed over the new horizon: at step {prog.step} the "
        f"learning rate goes from {was_lr:.3g} to {now_lr:.3g}",
        file=sys.stderr,
    )


def make_folder_of(flag: str, path: str) -> None:
    """The folder a file will be written to, made as `rnnserve import` makes its --out's."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrainError(f"{flag} {path}: cannot create its folder {Path(path).parent} ({exc.strerror})") from exc


def check_args(args: argparse.Namespace) -> None:
    if not args.steps and not args.minutes:
        raise TrainError("give a horizon: --steps N and/or --minutes M")
    for name in ("steps", "minutes", "batch_size", "lr", "context", "threads", "eval_limit"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise TrainError(f"--{name.replace('_', '-')} must be positive, got {value}")
    make_folder_of("--out", args.out)
    if Path(args.out).suffix != ".safetensors":
        raise TrainError(
            f"--out {args.out}: name the model file NAME.safetensors (rnnserve serve loads "
            "weights/*.safetensors; the checkpoint takes NAME.ckpt)"
        )
    if args.checkpoint:
        make_folder_of("--checkpoint", args.checkpoint)
    if args.init_from and not Path(args.init_from).is_file():
        raise TrainError(
            f"--init-from {args.init_from}: no such file; expected a .safetensors model written by rnnserve"
        )
    if args.extend and not args.resume:
        raise TrainError("--extend changes the horizon of a resumed run: add --resume")
    if not 0 <= args.ema_decay < 1:
        raise TrainError(
            f"--ema-decay must be in [0, 1) (0: no average; 0.999 averages about the last 1,000 steps), "
            f"got {args.ema_decay}"
        )
    if args.checkpoint_precision == "compact" and not args.ema_decay:
        raise TrainError(
            "--checkpoint-precision compact stores the weights as steps from their moving average: "
            "add --ema-decay (e.g. 0.999), or use bfloat16"
        )
    if not 0 <= args.max_shift <= MAX_SHIFT:
        raise TrainError(f"--max-shift must be in 0..{MAX_SHIFT} pixels, got {args.max_shift}")
    if args.max_shift and args.task != "mnist":
        raise TrainError(f"--max-shift shifts MNIST digits; --task {args.task} has no images to shift")
    if args.distill_weight is not None and not args.teacher:
        raise TrainError("--distill-weight weighs the teachers' targets: add --teacher FILE")
    if args.distill_weight is not None and not 0 < args.distill_weight <= 1:
        raise TrainError(
            f"--distill-weight must be in (0, 1] (the teachers' share of the loss), got {args.distill_weight}"
        )
    check_teacher_shares(args.teacher_shares, args.teacher or [])
    check_lora(args)


def check_lora(args: argparse.Namespace) -> None:
    """--lora-rank >= 0; --lora-alpha only beside it, positive; resolves the alpha's default."""
    if args.lora_rank < 0:
        raise TrainError(f"--lora-rank must be 0 (no adapters) or a positive rank, got {args.lora_rank}")
    if args.lora_alpha is not None and not args.lora_rank:
        raise TrainError("--lora-alpha scales the adapters: add --lora-rank R")
    if args.lora_alpha is not None and not args.lora_alpha > 0:
        raise TrainError(f"--lora-alpha must be positive, got {args.lora_alpha}")
    if args.lora_rank and args.lora_alpha is None:
        args.lora_alpha = 2.0 * args.lora_rank


def make_optimizer(model: Transformer, lr: float, weight_decay: float) -> torch.optim.AdamW:
    # No weight decay on 1-D parameters (biases, norm gains): the usual AdamW split.
    trained = [p for p in model.parameters() if p.requires_grad]  # all, bar the base weights under LoRA
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def optimizer_step(
    model: Transformer,
    opt: torch.optim.Optimizer,
    tokens: torch.Tensor,
    autocast,
    distillation: Distillation | None = None,
) -> float:
    """One AdamW step on a (B, T) batch, gradients clipped to norm 1; returns the data's loss (nats/token),
    which a distilled run reports too, so that its curve compares with other runs'."""
    with autocast:
        if distillation is None:
            loss = data_loss = sequence_loss(model, tokens)
        else:
            loss, data_loss = distillation.loss(model, tokens)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return data_loss.item()


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: with them bf16 matmuls beat fp32; without them bf16 is emulated and
    slower than fp32 (measurements in benchmarks/results/NOTES.md, "Measurements behind design choices")."""
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(check() for check in checks if check is not None)


def uses_autocast(device: torch.device, choice: str) -> bool:
    if choice != "auto":
        return choice == "bf16"
    return device.type == "cuda" or cpu_has_native_bf16()


def autocast_context(device: torch.device, choice: str):
    """bfloat16 autocast (weights and optimiser stay float32), or nothing."""
    if uses_autocast(device, choice):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def train_steps(
    model: Transformer,
    opt: torch.optim.Optimizer,
    batches: Batches,
    prog: Progress,
    args: argparse.Namespace,
    writer: CheckpointWriter,
    stop: StopRequest,
    average: WeightAverage | None,
    distillation: Distillation | None = None,
    stop_after: int | None = None,
) -> None:
    """The loop: until the horizon, a stop request, or `stop_after` steps (to simulate an interruption)."""
    device = model.device
    autocast = autocast_context(device, args.autocast)
    bar = tqdm(
        total=args.steps, initial=prog.step, disable=args.no_progress, unit="step", mininterval=2.0, dynamic_ncols=True
    )
    t_start = time.perf_counter() - prog.elapsed_s
    model.train()
    while run_progress(prog, args.steps, args.minutes) < 1.0 and stop.signum is None:
        if stop_after is not None and prog.step >= stop_after:
            break
        rate = learning_rate(writer.run.lr, prog.step, args.warmup_steps, run_progress(prog, args.steps, args.minutes))
        for group in opt.param_groups:
            group["lr"] = rate
        tokens = batches.next().to(device, non_blocking=True)  # (B, T)
        value = optimizer_step(model, opt, tokens, autocast, distillation)
        if not math.isfinite(value):
            raise TrainError(f"loss became {value} at step {prog.step}; try a lower --lr")
        if average is not None:
            average.update(model)
        prog.step += 1
        prog.examples += tokens.shape[0]
        prog.elapsed_s = time.perf_counter() - t_start
        prog.loss_ema = value if math.isnan(prog.loss_ema) else 0.98 * prog.loss_ema + 0.02 * value
        prog.record_curve()
        bar.update(1)
        bar.set_postfix(
            loss=f"{prog.loss_ema:.4f}",
            ex_s=f"{prog.examples / prog.elapsed_s:.1f}",
            lr=f"{rate:.2e}",
            min=f"{prog.elapsed_s / 60:.1f}",
            refresh=False,
        )
        if args.checkpoint_every and prog.step % args.checkpoint_every == 0:
            writer.save(model, opt, prog, batches.generator, average_of(average))
            if args.no_progress:
                print(
                    f"step {prog.step} loss {prog.loss_ema:.4f} examples {prog.examples} {prog.elapsed_s / 60:.1f} min",
                    flush=True,
                )
    bar.close()


def eval_data_path(args: argparse.Namespace) -> str:
    """MNIST: the test set next to the training data unless --eval-data; text: the same file."""
    if args.eval_data:
        return args.eval_data
    if args.task == "mnist" and Path(args.data).is_file():
        return str(Path(args.data).parent)
    return args.data


def training_info(
    args: argparse.Namespace,
    data_path: str,
    prog: Progress,
    device: torch.device,
    batch_size: int,
    lr: float,
    distillation: Distillation | None,
) -> dict[str, Any]:
    return {
        "task": args.task,
        "data": {"train": data_path, "eval": eval_data_path(args)},
        "examples_seen": prog.examples,
        "tokens_seen": prog.examples * (MNIST_PIXELS if args.task == "mnist" else args.context),
        "steps": prog.step,
        "wall_time_s": round(prog.elapsed_s, 1),
        "device": device_description(device),
        "autocast_bf16": uses_autocast(device, args.autocast),
        "batch_size": batch_size,
        "lr": lr,
        "seed": args.seed,
        "max_shift": args.max_shift,
        "init_from": args.init_from,  # the weights this run started from (None: random)
        "ema_decay": args.ema_decay,  # > 0: the file holds the moving average of the weights, not the last step's
        "distillation": distillation.describe() if distillation else None,  # teachers by file name and digest
        "final_train_loss_nats": round(prog.loss_ema, 5),  # moving average over ~50 steps
        "curve": {"columns": list(CURVE_COLUMNS), "points": prog.finished_curve()},  # `rnnserve curves` draws it
        "lineage": prog.lineage,  # the runs behind the --init-from file, oldest first (training/lineage.py)
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": args.command_line,
    }


def train(args: argparse.Namespace, stop_after: int | None = None) -> dict[str, Any]:
    """Train, save, evaluate; returns the info stored in the file."""
    check_args(args)
    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    inherited = inherited_from(args)
    cfg = build_config(args, inherited)
    data, data_path = load_training_data(args, vocabulary_for(cfg, inherited.tokenizer))
    preset = PRESETS[args.preset]
    batch_size, lr = args.batch_size or preset.batch_size, args.lr or preset.lr
    model = build_model(cfg).to(device)
    starts_anew = not (args.resume and resume_path(args) is not None)
    if starts_anew and args.init_from:  # before any adapter: the file's weights are the frozen base
        init_from(args.init_from, model)
    if args.lora_rank:
        trainable = add_lora(model, args.lora_rank, args.lora_alpha)
        print(f"LoRA rank {args.lora_rank}: {trainable:,} trainable parameters, the rest frozen", file=sys.stderr)
    opt = make_optimizer(model, lr, args.weight_decay)
    batches = Batches(data, cfg.max_len, batch_size, torch.Generator().manual_seed(args.seed), args.max_shift)
    distillation = (
        load_distillation(args.teacher, args.distill_weight or DEFAULT_DISTILL_WEIGHT, cfg, device, args.teacher_shares)
        if args.teacher
        else None
    )
    run = RunSettings(
        args.steps,
        args.minutes,
        batch_size,
        lr,
        args.warmup_steps,
        args.weight_decay,
        data.shape[0],
        args.max_shift,
        args.ema_decay,
        distillation.digests if distillation else (),
        distillation.weight if distillation else 0.0,
        distillation.given_shares if distillation else (),
        args.lora_rank,
        args.lora_alpha if args.lora_rank else 0.0,
    )
    writer = CheckpointWriter(checkpoint_path(args), args.checkpoint_precision, run, inherited.tokenizer)
    prog, saved_average = resume(args, writer, model, opt, batches) if args.resume else (Progress(), None)
    if prog.step == 0:  # a new run; a resumed one keeps the lineage of its checkpoint
        prog.lineage = inherited_lineage(args.init_from)
    average = WeightAverage.start(model, args.ema_decay, saved_average) if args.ema_decay else None
    print(
        f"{cfg.attention} {cfg.task}: {model.num_parameters():,} parameters, batch {batch_size}, "
        f"lr {lr}, device {device_description(device)}",
        file=sys.stderr,
    )
    with stop_on_signals() as stop:
        train_steps(model, opt, batches, prog, args, writer, stop, average, distillation, stop_after)
        if args.checkpoint_every:
            writer.save(model, opt, prog, batches.generator, average_of(average))
    if stop.signum is not None:
        raise TrainingStopped(stop.signum, prog.step, writer.path if args.checkpoint_every else None)
    info = training_info(args, data_path, prog, device, batch_size, lr, distillation)
    if average is not None:  # the run is over: the model keeps the average for good
        average.swap_into(model)
    merge_lora(model)  # the saved file holds plain weights
    save_and_evaluate(model, args, info, device, inherited.tokenizer)
    return info


def average_of(average: WeightAverage | None) -> dict[str, torch.Tensor] | None:
    return average.average if average is not None else None


def save_and_evaluate(
    model: Transformer, args: argparse.Namespace, info: dict[str, Any], device: torch.device, tokenizer: str | None
) -> None:
    """Save the model (with its tokenizer, if it has one, and the chat template of the file it started from);
    evaluate the saved 16-bit file itself (the numbers describe what ships) and store the result."""
    chat_template = inherited_from(args).chat_template
    save_model(
        model, args.out, info, dtype=SAVE_DTYPES[args.save_dtype], tokenizer=tokenizer, chat_template=chat_template
    )
    if args.no_eval:
        return
    info["eval"] = evaluate_file(
        args.out,
        eval_data_path(args),
        device,
        args.eval_limit,
        args.eval_batch_size,
        show_progress=not args.no_progress,
    )
    update_info(args.out, {"eval": info["eval"]})  # the evaluated tensors stay as written
    print_table([(args.out, info["eval"])])


def run(args: argparse.Namespace) -> int:
    try:
        train(args)
    except (TrainError, DataError, ConfigError) as exc:
        print(f"rnnserve train: error: {exc}", file=sys.stderr)
        return 2
    except TrainingStopped as exc:
        print(f"rnnserve train: {exc}", file=sys.stderr)
        return 128 + exc.signum  # the shell's code for "ended by this signal"
    return 0
