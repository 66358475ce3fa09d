"""training/: data loaders, the train loop, checkpoints, evaluation and the shipped weights.

Everything runs on tiny models and generated data in a temporary folder;
only the last tests read the real files in weights/ (skipped when none ship).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import os
import shlex
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from model import ModelConfig, Transformer, build_model
from model.decode.generate import generate
from model.decode.sampling import BatchSampling, SamplingParams
from model.transformer import with_bos
from model.io.weights import load_model, read_metadata, save_model
from rnnserve_cli import parse_args
from model.io import atomic_write
from training import checkpoint, evaluate, resume, run_state, train
from training.averaging import WeightAverage
from training.checkpoint import Checkpoint, read_checkpoint
from training.data import DataError, find_images_file, load_mnist, load_text, read_idx_images, write_idx_images
from training.warm_start import init_from

REPO = Path(__file__).resolve().parent.parent
WEIGHTS = REPO / "weights"
SHIPPED = sorted(WEIGHTS.glob("*.safetensors"))


def parse(command: str, argv: list[str]) -> argparse.Namespace:
    """`rnnserve COMMAND ARGV...` parsed by the real command line."""
    return parse_args([command, *argv])


def digit_images(count: int, seed: int = 0) -> torch.Tensor:
    """(count, 784) uint8: a bright random vertical bar on black, a very learnable 'digit'."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.zeros(count, 28, 28, dtype=torch.uint8)
    cols = torch.randint(4, 24, (count,), generator=gen)
    for i, c in enumerate(cols.tolist()):
        images[i, 6:22, c : c + 3] = 255
    return images.view(count, 784)


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("to be or not to be, that is the question. " * 60, encoding="utf-8")
    return path


@pytest.fixture
def mnist_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "mnist"
    folder.mkdir()
    write_idx_images(folder / "train-images-idx3-ubyte.gz", digit_images(64, seed=1))
    write_idx_images(folder / "t10k-images-idx3-ubyte.gz", digit_images(6, seed=2))
    return folder


# ---------------------------------------------------------------- data


def test_idx_round_trip_gzip_and_plain(tmp_path: Path) -> None:
    images = torch.randint(0, 256, (5, 784), dtype=torch.uint8)
    for name, compress in (("a-images-idx3-ubyte.gz", True), ("b-images-idx3-ubyte", False)):
        write_idx_images(tmp_path / name, images, compress=compress)
        assert torch.equal(read_idx_images(tmp_path / name), images)


def test_idx_bad_magic_is_rejected_with_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(struct.pack(">iiii", 2049, 1, 28, 28) + bytes(784)))
    with pytest.raises(DataError, match=r"magic number 2049, expected 2051"):
        read_idx_images(path)


def test_idx_truncated_file_names_the_expected_size(tmp_path: Path) -> None:
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(struct.pack(">iiii", 2051, 2, 28, 28) + bytes(784))
    with pytest.raises(DataError, match=r"expected 1584 for 2 images"):
        read_idx_images(path)


def test_mnist_files_found_by_standard_and_subset_names(tmp_path: Path) -> None:
    train, test = digit_images(3, seed=3), digit_images(2, seed=4)
    write_idx_images(tmp_path / "train10k-images-idx3-ubyte.gz", train)
    write_idx_images(tmp_path / "t10k-images-idx3-ubyte.gz", test)
    assert torch.equal(load_mnist(tmp_path, "train").images, train)
    assert torch.equal(load_mnist(tmp_path, "test").images, test)
    write_idx_images(tmp_path / "train-images-idx3-ubyte.gz", train)
    with pytest.raises(DataError, match="several train images files"):
        find_images_file(tmp_path, "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no test images file; expected e.g. t10k-images-idx3-ubyte.gz"):
        find_images_file(tmp_path / "empty", "test")


def test_text_split_is_first_90_last_10_percent(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(97, 97 + 20)) * 5)  # 100 bytes
    splits = load_text(path)
    assert splits.train.shape[0] == 90 and splits.valid.shape[0] == 10
    assert bytes(splits.train.tolist()) + bytes(splits.valid.tolist()) == path.read_bytes()


def test_text_loader_rejects_non_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello world, this is fine \xff\xfe then not")
    with pytest.raises(DataError, match="not valid UTF-8 at byte 26"):
        load_text(path)


# ---------------------------------------------------------------- training


def text_args(tmp_path: Path, text_file: Path, *extra: str) -> argparse.Namespace:
    return parse(
        "train",
        [
            "--task",
            "text",
            "--attention",
            "linear",
            "--data",
            str(text_file),
            "--preset",
            "tiny",
            "--context",
            "16",
            "--warmup-steps",
            "5",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--no-progress",
            "--out",
            str(tmp_path / "m.safetensors"),
            *extra,
        ],
    )


def fixed_batch(text_file: Path, context: int) -> torch.Tensor:
    data = load_text(text_file).train
    return data[: 8 * context].view(8, context).long()  # (8, context)


def test_training_lowers_the_loss(tmp_path: Path, text_file: Path) -> None:
    args = text_args(tmp_path, text_file, "--steps", "40", "--no-eval")
    batch = fixed_batch(text_file, 16)
    torch.manual_seed(args.seed)  # the same initial weights train() starts from
    with torch.no_grad():
        before = float(train.sequence_loss(build_model(train.build_config(args)), batch))
    info = train.train(args)
    trained, stored = load_model(args.out)
    with torch.no_grad():
        after = float(train.sequence_loss(trained, batch))
    assert stored["steps"] == 40 and stored["examples_seen"] == 40 * 8
    assert before > math.log(256) - 0.1  # untrained: about uniform over bytes
    assert after < before - 1.0, (before, after)
    assert info["final_train_loss_nats"] < before


def test_checkpoint_resumes_bit_for_bit(tmp_path: Path, text_file: Path) -> None:
    # k steps, a resume, k more == 2k steps in one run. Dropout and fresh reformer rotations make the RNG state matter.
    common = [
        "--steps",
        "6",
        "--checkpoint-every",
        "3",
        "--no-eval",
        "--attention",
        "reformer",
        "--dropout",
        "0.1",
        "--checkpoint-precision",
        "float32",
        "--save-dtype",
        "float32",
    ]
    straight = text_args(
        tmp_path, text_file, *common, "--checkpoint", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "a.safetensors")
    )
    train.train(straight)
    resumed = text_args(
        tmp_path,
        text_file,
        *common,
        "--checkpoint",
        str(tmp_path / "b.ckpt"),
        "--resume",
        "--out",
        str(tmp_path / "b.safetensors"),
    )
    train.train(resumed, stop_after=3)  # an interrupted run: its checkpoint is at step 3
    assert read_checkpoint(tmp_path / "b.ckpt").progress.step == 3
    train.train(resumed)
    a, b = read_checkpoint(tmp_path / "a.ckpt"), read_checkpoint(tmp_path / "b.ckpt")
    assert a.progress.step == b.progress.step == 6
    assert a.progress.examples == b.progress.examples
    assert a.progress.loss_ema == b.progress.loss_ema
    assert_same_training_state(a, b)
    final_a, final_b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def assert_same_training_state(a: Checkpoint, b: Checkpoint) -> None:
    """Weights, AdamW moments and steps, and every RNG state, bit for bit."""
    assert a.model.keys() == b.model.keys()
    for name, tensor in a.model.items():
        assert torch.equal(tensor, b.model[name]), name
    assert a.optimizer["state"].keys() == b.optimizer["state"].keys()
    for index, entries in a.optimizer["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, b.optimizer["state"][index][key]), (index, key)
    assert torch.equal(a.rng.data, b.rng.data)
    assert torch.equal(a.rng.torch, b.rng.torch)


def test_bfloat16_moments_resume_close_to_the_uninterrupted_run(tmp_path: Path, text_file: Path) -> None:
    common = ["--steps", "24", "--threads", "1", "--no-eval", "--save-dtype", "float32"]
    straight = text_args(
        tmp_path, text_file, *common, "--checkpoint-precision", "float32", "--out", str(tmp_path / "a.safetensors")
    )
    resumed = text_args(tmp_path, text_file, *common, "--resume", "--out", str(tmp_path / "b.safetensors"))
    train.train(straight)
    train.train(resumed, stop_after=12)  # the default precision: bfloat16 moments
    ckpt = tmp_path / "checkpoints" / "b.ckpt"
    dtypes = read_safetensors_dtypes_by_name(ckpt)
    assert {dtypes[k] for k in dtypes if k.startswith("model.")} == {"F32"}
    assert {dtypes[k] for k in dtypes if k.startswith("optim.")} == {"BF16"}
    halfway = batch_loss(tmp_path / "b.safetensors", text_file)
    train.train(resumed)
    uninterrupted, after_resume = (
        batch_loss(tmp_path / "a.safetensors", text_file),
        batch_loss(tmp_path / "b.safetensors", text_file),
    )
    assert halfway - uninterrupted > 0.1  # the second half still learns: closeness below is not for free
    assert abs(after_resume - uninterrupted) < 1e-3, (after_resume, uninterrupted)


def test_compact_checkpoint_resume_close_to_the_uninterrupted_run(tmp_path: Path, text_file: Path) -> None:
    common = ["--steps", "24", "--threads", "1", "--no-eval", "--save-dtype", "float32", "--ema-decay", "0.9"]
    straight = text_args(
        tmp_path, text_file, *common, "--checkpoint-precision", "float32", "--out", str(tmp_path / "a.safetensors")
    )
    resumed = text_args(
        tmp_path,
        text_file,
        *common,
        "--resume",
        "--checkpoint-precision",
        "compact",
        "--out",
        str(tmp_path / "b.safetensors"),
    )
    train.train(straight)
    train.train(resumed, stop_after=12)
    dtypes = read_safetensors_dtypes_by_name(tmp_path / "checkpoints" / "b.ckpt")
    assert {dtypes[k] for k in dtypes if k.startswith("model.")} == {"I8"}
    halfway = batch_loss(tmp_path / "b.safetensors", text_file)
    train.train(resumed)
    uninterrupted, after_resume = (
        batch_loss(tmp_path / "a.safetensors", text_file),
        batch_loss(tmp_path / "b.safetensors", text_file),
    )
    assert halfway - uninterrupted > 0.1
    assert abs(after_resume - uninterrupted) < 1e-3, (after_resume, uninterrupted)


def batch_loss(path: Path, text_file: Path) -> float:
    model, _ = load_model(path)
    with torch.no_grad():
        return float(train.sequence_loss(model, fixed_batch(text_file, 16)))


def read_safetensors_dtypes_by_name(path: Path) -> dict[str, str]:
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_checkpoint_stores_32_bit_weights_and_16_bit_moments(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(
            attention="linformer", task="mnist", d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=784, linformer_k=16
        )
    )
    opt = train.make_optimizer(model, 1e-3, 0.01)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # creates both moments of every parameter
    params = model.num_parameters()
    sizes = {}
    for precision in ("float32", "bfloat16"):
        run = run_state.RunSettings(10, None, 8, 1e-3, 5, 0.01, 100)
        writer = checkpoint.CheckpointWriter(tmp_path / f"{precision}.ckpt", precision, run)
        writer.save(model, opt, run_state.Progress(step=1), torch.Generator())
        sizes[precision] = writer.path.stat().st_size
    # 4 bytes of weight + 2 moments of 4 or 2 bytes, plus RNG states and the JSON header (<= 40 KB here)
    assert 12 * params < sizes["float32"] < 12 * params + 40_000
    assert 8 * params < sizes["bfloat16"] < 8 * params + 40_000


def trained_model_with_average(seed: int) -> tuple[Transformer, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """A Linformer after one optimiser step, and a moving average about 1% away from its weights (a long run's
    average trails its weights by a small fraction of their size)."""
    torch.manual_seed(seed)
    model = build_model(
        ModelConfig(
            attention="linformer", task="mnist", d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=784, linformer_k=16
        )
    )
    opt = train.make_optimizer(model, 1e-3, 0.01)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    average = {name: p.detach() * (1 + 0.01 * torch.randn_like(p)) for name, p in model.named_parameters()}
    return model, opt, average


def test_compact_checkpoint_is_7_bytes_a_parameter_and_restores_weights_closer_than_16_bits(tmp_path: Path) -> None:
    model, opt, average = trained_model_with_average(0)
    params = model.num_parameters()
    run = run_state.RunSettings(10, None, 8, 1e-3, 5, 0.01, 100, ema_decay=0.999)
    writer = checkpoint.CheckpointWriter(tmp_path / "compact.ckpt", "compact", run)
    writer.save(model, opt, run_state.Progress(step=1), torch.Generator(), average)
    # 1 byte of weight, 2 x 2 bytes of moments, 2 bytes of average, a float32 scale per row, RNG and header
    assert 7 * params < writer.path.stat().st_size < 7.2 * params + 40_000
    dtypes = read_safetensors_dtypes_by_name(writer.path)
    assert {dtypes[k] for k in dtypes if k.startswith("model.")} == {"I8"}
    restored = read_checkpoint(writer.path)
    for name, weight in model.state_dict().items():
        error = (restored.model[name] - weight).abs().max()
        assert error <= (weight - restored.average[name].float()).abs().max() / 254 + 1e-7, name
        assert error < (weight.to(torch.bfloat16).float() - weight).abs().max(), name
        assert torch.equal(restored.average[name], average[name].to(torch.bfloat16)), name
    fresh, fresh_opt, _ = trained_model_with_average(1)
    resume.restore(writer.path, restored, fresh, fresh_opt, torch.Generator())
    assert all(torch.equal(fresh.state_dict()[k], restored.model[k]) for k in restored.model)


def test_out_must_be_a_safetensors_file(tmp_path: Path, text_file: Path) -> None:
    args = text_args(tmp_path, text_file, "--steps", "2", "--no-eval", "--out", str(tmp_path / "model.txt"))
    with pytest.raises(train.TrainError, match=r"model\.txt: name the model file NAME\.safetensors"):
        train.train(args)
    assert not (tmp_path / "model.txt").exists() and not (tmp_path / "checkpoints").exists()  # refused before training


def test_compact_checkpoint_without_an_average_is_refused(tmp_path: Path, text_file: Path) -> None:
    args = text_args(
        tmp_path,
        text_file,
        "--steps",
        "2",
        "--no-eval",
        "--checkpoint-precision",
        "compact",
        "--out",
        str(tmp_path / "m.safetensors"),
    )
    with pytest.raises(train.TrainError, match="compact.*--ema-decay"):
        train.train(args)
    assert not (tmp_path / "checkpoints").exists()


def test_default_checkpoint_is_kept_under_weights_and_serve_does_not_load_it(tmp_path: Path, text_file: Path) -> None:
    from server.settings import build_settings

    weights = tmp_path / "weights"
    weights.mkdir()
    train.train(text_args(tmp_path, text_file, "--steps", "2", "--no-eval", "--out", str(weights / "m.safetensors")))
    assert read_checkpoint(weights / "checkpoints" / "m.ckpt").progress.step == 2
    assert sorted(p.name for p in (weights / "checkpoints").iterdir()) == ["m.ckpt"]  # no .tmp left behind
    assert build_settings(weights=weights).model_paths() == [weights / "m.safetensors"]


def test_resume_refuses_a_checkpoint_of_another_architecture(tmp_path: Path, text_file: Path) -> None:
    ckpt = str(tmp_path / "c.ckpt")
    train.train(text_args(tmp_path, text_file, "--steps", "2", "--no-eval", "--checkpoint", ckpt))
    other = text_args(
        tmp_path, text_file, "--steps", "4", "--no-eval", "--checkpoint", ckpt, "--resume", "--layers", "3"
    )
    with pytest.raises(train.TrainError, match="use the same architecture flags"):
        train.train(other)
    with pytest.raises(train.TrainError, match="checkpoint has n_layers=2; this run builds n_layers=3"):
        train.train(other)
    another = text_args(
        tmp_path,
        text_file,
        "--steps",
        "2",
        "--no-eval",
        "--checkpoint",
        ckpt,
        "--resume",
        "--attention",
        "softmax",
        "--d-model",
        "64",
    )
    with pytest.raises(
        train.TrainError,
        match=r"checkpoint has attention=linear, d_model=32; "
        r"this run builds attention=softmax, d_model=64",
    ):
        train.train(another)


def test_resume_with_another_horizon_needs_extend(tmp_path: Path, text_file: Path, capsys) -> None:
    ckpt = str(tmp_path / "h.ckpt")
    first = ["--no-eval", "--threads", "1", "--checkpoint", ckpt]
    train.train(text_args(tmp_path, text_file, "--steps", "4", *first))
    longer = text_args(tmp_path, text_file, "--steps", "6", "--resume", *first)
    with pytest.raises(train.TrainError, match=r"steps 4 -> 6\); resume with the same flags .* or add --extend"):
        train.train(longer)
    smaller_batches = text_args(
        tmp_path, text_file, "--steps", "6", "--batch-size", "4", "--resume", "--extend", *first
    )
    with pytest.raises(
        train.TrainError,
        match=r"batch_size 8 -> 4\); resume with the same flags to continue "
        r"the same schedule and data order$",
    ):
        train.train(smaller_batches)
    assert read_checkpoint(Path(ckpt)).progress.step == 4  # refused runs change nothing
    info = train.train(text_args(tmp_path, text_file, "--steps", "6", "--resume", "--extend", *first))
    assert info["steps"] == 6 and info["examples_seen"] == 6 * 8
    assert "--extend: steps 4 -> 6; the cosine schedule is recomputed" in capsys.readouterr().err


def test_damaged_checkpoints_are_named_as_such(tmp_path: Path, text_file: Path, capsys) -> None:
    good = tmp_path / "good.ckpt"
    train.train(text_args(tmp_path, text_file, "--steps", "2", "--no-eval", "--checkpoint", str(good)))
    raw = good.read_bytes()
    cases = {
        "cut.ckpt": (
            raw[: len(raw) // 2],
            rf"truncated checkpoint: {len(raw) // 2} bytes, but its header describes {len(raw)} bytes",
        ),
        "noise.ckpt": (bytes(range(256)) * 4, "corrupt or truncated checkpoint"),
        "legacy-cut.ckpt": (
            legacy_blob_bytes(tmp_path, good)[:3000],
            r"corrupt or truncated checkpoint \(older torch.save format",
        ),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(train.TrainError, match=message):
            read_checkpoint(tmp_path / name)
    model_file = tmp_path / "model.safetensors"
    save_model(build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=32)), model_file)
    with pytest.raises(train.TrainError, match="not a training checkpoint"):
        read_checkpoint(model_file)
    with safe_open(str(good), framework="pt") as f:
        tensors, header = {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()[checkpoint.METADATA_KEY])
    save_file(
        tensors,
        str(tmp_path / "future.ckpt"),
        metadata={checkpoint.METADATA_KEY: json.dumps(header | {"format": checkpoint.FORMAT + 1})},
    )
    with pytest.raises(train.TrainError, match=rf"checkpoint format {checkpoint.FORMAT + 1} is newer than this"):
        read_checkpoint(tmp_path / "future.ckpt")
    # Through the command line: exit status 2, one line naming the file and the problem.
    args = text_args(
        tmp_path, text_file, "--steps", "4", "--no-eval", "--checkpoint", str(tmp_path / "cut.ckpt"), "--resume"
    )
    assert train.run(args) == 2
    assert f"{tmp_path / 'cut.ckpt'}: truncated checkpoint" in capsys.readouterr().err


def legacy_blob_bytes(tmp_path: Path, ckpt: Path) -> bytes:
    """A checkpoint in the older torch.save format, holding what `ckpt` holds."""
    path = tmp_path / "legacy.tmp"
    write_legacy_checkpoint(path, read_checkpoint(ckpt))
    return path.read_bytes()


def write_legacy_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    """What rnnserve wrote before format 2: torch.save of the live model's and optimiser's state dicts."""
    model = build_model(ckpt.config)
    opt = train.make_optimizer(model, 1e-3, 0.01)
    generator = torch.Generator()
    resume.restore(path, ckpt, model, opt, generator)
    blob = {
        "config": model.config.to_json(),
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "progress": vars(ckpt.progress).copy(),
        "data_rng": generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": None,
    }
    torch.save(blob, path)


def test_older_torch_save_checkpoints_still_resume_bit_for_bit(tmp_path: Path, text_file: Path) -> None:
    common = ["--steps", "6", "--no-eval", "--dropout", "0.1", "--checkpoint-precision", "float32"]
    train.train(text_args(tmp_path, text_file, *common, "--checkpoint", str(tmp_path / "a.ckpt")))
    out = tmp_path / "old.safetensors"
    train.train(text_args(tmp_path, text_file, *common, "--out", str(out)), stop_after=3)
    # The run that wrote it kept its checkpoint next to --out, where the resume still looks.
    write_legacy_checkpoint(out.with_suffix(".ckpt"), read_checkpoint(tmp_path / "checkpoints" / "old.ckpt"))
    (tmp_path / "checkpoints" / "old.ckpt").unlink()
    train.train(text_args(tmp_path, text_file, *common, "--out", str(out), "--resume"))
    resumed = read_checkpoint(tmp_path / "checkpoints" / "old.ckpt")  # the new checkpoint: format 2, new place
    assert resumed.run is not None and resumed.progress.step == 6
    assert_same_training_state(read_checkpoint(tmp_path / "a.ckpt"), resumed)


@pytest.mark.parametrize(
    "failure", [OSError("No space left on device"), KeyboardInterrupt()], ids=["oserror", "interrupt"]
)
def test_an_interrupted_checkpoint_write_keeps_the_previous_one(
    tmp_path: Path, text_file: Path, failure: BaseException
) -> None:
    ckpt = tmp_path / "w.ckpt"
    train.train(text_args(tmp_path, text_file, "--steps", "2", "--no-eval", "--checkpoint", str(ckpt)))
    before = ckpt.read_bytes()

    def write_half_then_fail(tmp: Path) -> None:
        tmp.write_bytes(before[: len(before) // 2])
        raise failure

    with pytest.raises(type(failure)):
        atomic_write.write_atomically(ckpt, write_half_then_fail)
    assert ckpt.read_bytes() == before
    assert read_checkpoint(ckpt).progress.step == 2
    assert sorted(p.name for p in tmp_path.glob("w.ckpt*")) == ["w.ckpt"]  # the partial .tmp is removed


def test_a_checkpoint_is_shared_as_the_umask_allows_like_a_model_file(tmp_path: Path, text_file: Path) -> None:
    ckpt = tmp_path / "u.ckpt"
    old = os.umask(0o022)  # this test's own process-wide setting, put back below
    try:
        train.train(text_args(tmp_path, text_file, "--steps", "1", "--no-eval", "--checkpoint", str(ckpt)))
    finally:
        os.umask(old)
    assert ckpt.stat().st_mode & 0o777 == 0o644  # not safetensors' owner-only 0600


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_stops_training_with_a_checkpoint_to_resume_from(tmp_path: Path, text_file: Path, signum: int) -> None:
    ckpt = tmp_path / "s.ckpt"
    argv = [
        "--task",
        "text",
        "--attention",
        "linear",
        "--data",
        str(text_file),
        "--preset",
        "tiny",
        "--context",
        "16",
        "--dropout",
        "0.1",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--no-progress",
        "--no-eval",
        "--steps",
        "100000",
        "--checkpoint-every",
        "4",
        "--checkpoint-precision",
        "float32",
        "--checkpoint",
        str(ckpt),
        "--out",
        str(tmp_path / "s.safetensors"),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rnnserve_cli", "train", *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_file(ckpt, proc, timeout_s=180)  # a few steps done
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err
    step = read_checkpoint(ckpt).progress.step
    assert step >= 4
    assert f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {ckpt} written" in err
    assert not (tmp_path / "s.safetensors").exists()  # an unfinished run ships no model
    # Resumed for 2 more steps == the same run uninterrupted to step + 2.
    train.train(parse("train", [*argv, "--resume"]), stop_after=step + 2)
    straight = tmp_path / "straight.ckpt"
    train.train(parse("train", [*argv, "--checkpoint", str(straight)]), stop_after=step + 2)
    assert read_checkpoint(ckpt).progress.step == step + 2
    assert_same_training_state(read_checkpoint(straight), read_checkpoint(ckpt))


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"training exited early ({proc.returncode}): {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no checkpoint after {timeout_s} s")
        time.sleep(0.05)


def test_train_without_a_horizon_is_a_clear_error(tmp_path: Path, text_file: Path) -> None:
    with pytest.raises(train.TrainError, match="--steps N and/or --minutes M"):
        train.train(text_args(tmp_path, text_file))


def test_mnist_training_records_data_and_eval_in_the_file(tmp_path: Path, mnist_dir: Path) -> None:
    out = tmp_path / "d.safetensors"
    argv = [
        "--task",
        "mnist",
        "--attention",
        "softmax",
        "--data",
        str(mnist_dir),
        "--preset",
        "tiny",
        "--steps",
        "3",
        "--device",
        "cpu",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert train.run(parse("train", argv)) == 0
    cfg, info = read_metadata(out)
    assert cfg.max_len == 784 and cfg.task == "mnist"
    assert info["data"]["train"].endswith("train-images-idx3-ubyte.gz")
    assert info["examples_seen"] == 3 * 8 and info["device"].startswith("cpu")
    assert info["eval"]["images"] == 6 and 0 < info["eval"]["bits_per_dim"] < 9
    assert read_safetensors_dtypes(out) == {"BF16"}  # stored in 16 bits, like the shipped files
    assert info["command"] == shlex.join(["rnnserve", "train", *argv])  # the argv given, not pytest's sys.argv


def test_mnist_batches_shift_each_digit_by_at_most_max_shift() -> None:
    # Image i is one pixel of grey level i + 1 at the centre: where it lands in a batch is its shift.
    images = torch.zeros(50, 28, 28, dtype=torch.uint8)
    images[:, 14, 14] = torch.arange(1, 51, dtype=torch.uint8)
    batches = train.Batches(images.view(50, 784), 784, 64, torch.Generator().manual_seed(0), max_shift=1)
    offsets = set()
    for _ in range(4):
        batch = batches.next().view(64, 28, 28)  # (B, 28, 28)
        assert batch.dtype == torch.int64
        for digit in batch:
            ((row, col),) = digit.nonzero().tolist()  # each digit still holds its one pixel
            offsets.add((row - 14, col - 14))
    assert offsets == {(r, c) for r in (-1, 0, 1) for c in (-1, 0, 1)}  # every shift of up to 1, no more
    unshifted = train.Batches(images.view(50, 784), 784, 64, torch.Generator().manual_seed(0))
    assert (unshifted.next().view(64, 28, 28)[:, 14, 14] > 0).all()


def test_max_shift_may_change_only_with_extend_and_is_recorded(tmp_path: Path, mnist_dir: Path, capsys) -> None:
    out, ckpt = tmp_path / "s.safetensors", tmp_path / "s.ckpt"
    common = [
        "--task",
        "mnist",
        "--attention",
        "linear",
        "--data",
        str(mnist_dir),
        "--preset",
        "tiny",
        "--threads",
        "1",
        "--device",
        "cpu",
        "--no-progress",
        "--no-eval",
        "--checkpoint",
        str(ckpt),
        "--out",
        str(out),
    ]
    train.train(parse("train", [*common, "--steps", "2"]))
    with pytest.raises(train.TrainError, match=r"max_shift 0 -> 1\); resume with the same flags .* or add --extend"):
        train.train(parse("train", [*common, "--steps", "4", "--resume", "--max-shift", "1"]))
    info = train.train(parse("train", [*common, "--steps", "4", "--resume", "--extend", "--max-shift", "1"]))
    assert "--extend: steps 2 -> 4; max_shift 0 -> 1" in capsys.readouterr().err
    assert info["max_shift"] == 1 and read_checkpoint(ckpt).run.max_shift == 1
    assert read_metadata(out)[1]["max_shift"] == 1


def test_a_shifted_mnist_run_with_a_weight_average_resumes_bit_for_bit(tmp_path: Path, mnist_dir: Path) -> None:
    # The shifts draw from the batch sampler's generator and the average is carried in the checkpoint: both must
    # continue as if the run had never stopped.
    def args(name: str, *extra: str) -> argparse.Namespace:
        return parse(
            "train",
            [
                "--task",
                "mnist",
                "--attention",
                "linear",
                "--data",
                str(mnist_dir),
                "--preset",
                "tiny",
                "--threads",
                "1",
                "--device",
                "cpu",
                "--no-progress",
                "--no-eval",
                "--steps",
                "6",
                "--checkpoint-every",
                "3",
                "--checkpoint-precision",
                "float32",
                "--save-dtype",
                "float32",
                "--max-shift",
                "2",
                "--ema-decay",
                "0.9",
                "--dropout",
                "0.1",
                "--checkpoint",
                str(tmp_path / f"{name}.ckpt"),
                "--out",
                str(tmp_path / f"{name}.safetensors"),
                *extra,
            ],
        )

    train.train(args("a"))
    train.train(args("b", "--resume"), stop_after=3)
    assert read_checkpoint(tmp_path / "b.ckpt").progress.step == 3
    train.train(args("b", "--resume"))
    a, b = read_checkpoint(tmp_path / "a.ckpt"), read_checkpoint(tmp_path / "b.ckpt")
    assert_same_training_state(a, b)
    assert a.average is not None and all(torch.equal(a.average[k], b.average[k]) for k in a.average)
    final_a, final_b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_init_from_starts_a_new_run_from_trained_weights_under_another_hashing(
    tmp_path: Path, text_file: Path, capsys
) -> None:
    source = tmp_path / "src.safetensors"
    reformer = ["--attention", "reformer", "--no-eval", "--save-dtype", "float32"]
    train.train(text_args(tmp_path, text_file, *reformer, "--steps", "40", "--out", str(source)))
    trained, _ = load_model(source)
    warm = text_args(
        tmp_path,
        text_file,
        *reformer,
        "--steps",
        "1",
        "--lr",
        "1e-12",
        "--reformer-buckets",
        "8",
        "--init-from",
        str(source),
        "--out",
        str(tmp_path / "warm.safetensors"),
    )
    info = train.train(warm)
    assert "initialised from" in capsys.readouterr().err and info["init_from"] == str(source) and info["steps"] == 1
    warmed, _ = load_model(tmp_path / "warm.safetensors")
    assert warmed.config.reformer_buckets == 8 and trained.config.reformer_buckets == 32
    params = dict(trained.named_parameters())
    for name, value in warmed.named_parameters():  # a step at lr 1e-12 moves nothing visible
        assert torch.allclose(value, params[name], atol=1e-6), name
    rotations = [name for name, _ in warmed.named_buffers() if name.endswith("rotations")]
    assert rotations and all(warmed.get_buffer(n).shape[-1] == 4 for n in rotations)  # drawn for 8 buckets
    cold = text_args(
        tmp_path,
        text_file,
        *reformer,
        "--steps",
        "1",
        "--lr",
        "1e-12",
        "--reformer-buckets",
        "8",
        "--out",
        str(tmp_path / "cold.safetensors"),
    )
    assert info["final_train_loss_nats"] < train.train(cold)["final_train_loss_nats"] - 1.0


def test_init_from_names_the_fields_that_would_change_parameters(tmp_path: Path, text_file: Path) -> None:
    source = tmp_path / "src.safetensors"
    train.train(text_args(tmp_path, text_file, "--steps", "1", "--no-eval", "--out", str(source)))
    wider = text_args(tmp_path, text_file, "--steps", "1", "--no-eval", "--d-model", "64", "--init-from", str(source))
    with pytest.raises(
        train.TrainError,
        match=r"the file has d_model=32; this run builds d_model=64; only dropout, "
        r"reformer_buckets, reformer_local_window, reformer_rounds may differ",
    ):
        train.train(wider)
    missing = text_args(tmp_path, text_file, "--steps", "1", "--init-from", str(tmp_path / "none.safetensors"))
    with pytest.raises(train.TrainError, match=r"none\.safetensors: no such file; expected a \.safetensors model"):
        train.train(missing)
    (tmp_path / "junk.safetensors").write_bytes(b"not a model at all")
    junk = text_args(tmp_path, text_file, "--steps", "1", "--init-from", str(tmp_path / "junk.safetensors"))
    with pytest.raises(train.TrainError, match=r"--init-from: .*junk\.safetensors: "):
        train.train(junk)


def test_init_from_grows_the_model_by_blocks_that_start_as_identities(tmp_path: Path, text_file: Path) -> None:
    source = tmp_path / "src.safetensors"
    float32 = ["--no-eval", "--save-dtype", "float32"]
    train.train(text_args(tmp_path, text_file, *float32, "--steps", "20", "--out", str(source)))
    small, _ = load_model(source)
    grown = build_model(dataclasses.replace(small.config, n_layers=small.config.n_layers + 2))
    init_from(str(source), grown)
    tokens = torch.randint(0, 256, (3, 16))
    with torch.no_grad():  # the grown model computes what the file's did
        assert torch.allclose(grown.eval().next_token_log_probs(tokens), small.next_token_log_probs(tokens), atol=1e-5)
    out = tmp_path / "grown.safetensors"
    train.train(
        text_args(
            tmp_path,
            text_file,
            *float32,
            "--steps",
            "3",
            "--layers",
            str(small.config.n_layers + 1),
            "--init-from",
            str(source),
            "--out",
            str(out),
        )
    )
    trained, _ = load_model(out)
    top = trained.blocks[-1]
    assert trained.config.n_layers == small.config.n_layers + 1
    assert top.attn.proj.weight.abs().sum() > 0 and top.ff.down.weight.abs().sum() > 0  # the new block learns
    fewer = text_args(tmp_path, text_file, "--steps", "1", "--layers", "1", "--init-from", str(source))
    with pytest.raises(
        train.TrainError,
        match=r"the file has n_layers=2; this run builds n_layers=1: a warm start may "
        r"add layers .*, not drop them",
    ):
        train.train(fewer)


def test_a_stopped_warm_start_resumes_from_its_checkpoint(tmp_path: Path, text_file: Path, capsys) -> None:
    source, ckpt = tmp_path / "src.safetensors", str(tmp_path / "w.ckpt")
    train.train(text_args(tmp_path, text_file, "--steps", "2", "--no-eval", "--out", str(source)))
    warm = text_args(
        tmp_path,
        text_file,
        "--steps",
        "4",
        "--no-eval",
        "--checkpoint",
        ckpt,
        "--checkpoint-every",
        "2",
        "--resume",
        "--init-from",
        str(source),
    )
    train.train(warm, stop_after=2)
    assert "initialised from" in capsys.readouterr().err
    info = train.train(warm)  # the same command: the checkpoint wins, the file is not loaded again
    err = capsys.readouterr().err
    assert "resumed from" in err and "initialised from" not in err and info["steps"] == 4


def test_weight_average_follows_each_step_and_swaps_in_and_out() -> None:
    model = build_model(
        ModelConfig(attention="linear", task="text", n_layers=1, d_model=8, n_heads=2, d_ff=16, max_len=8)
    )
    first = {name: p.detach().clone() for name, p in model.named_parameters()}
    average = WeightAverage.start(model, 0.75)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    average.update(model)  # 0.75 * w + 0.25 * (w + 1) = w + 0.25
    for name, value in average.average.items():
        assert torch.allclose(value, first[name] + 0.25), name
    with average.swapped_in(model):
        for name, p in model.named_parameters():
            assert torch.allclose(p, first[name] + 0.25), name
    for name, p in model.named_parameters():  # its own weights are back
        assert torch.equal(p, first[name] + 1.0), name


def test_ema_run_saves_the_average_and_resumes_it_bit_for_bit(tmp_path: Path, text_file: Path) -> None:
    common = [
        "--steps",
        "6",
        "--checkpoint-every",
        "3",
        "--no-eval",
        "--ema-decay",
        "0.9",
        "--checkpoint-precision",
        "float32",
        "--save-dtype",
        "float32",
    ]
    straight = text_args(
        tmp_path, text_file, *common, "--checkpoint", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "a.safetensors")
    )
    info = train.train(straight)
    resumed = text_args(
        tmp_path,
        text_file,
        *common,
        "--checkpoint",
        str(tmp_path / "b.ckpt"),
        "--resume",
        "--out",
        str(tmp_path / "b.safetensors"),
    )
    train.train(resumed, stop_after=3)
    train.train(resumed)
    a, b = read_checkpoint(tmp_path / "a.ckpt"), read_checkpoint(tmp_path / "b.ckpt")
    assert_same_training_state(a, b)
    assert a.average is not None and b.average is not None and a.average.keys() == b.average.keys()
    assert all(torch.equal(a.average[k], b.average[k]) for k in a.average)
    saved = load_file(tmp_path / "a.safetensors")
    assert info["ema_decay"] == 0.9
    for name, value in a.average.items():  # the file holds the average, not the last step's weights
        assert torch.equal(saved[name], value), name
    assert any(not torch.equal(a.average[k], a.model[k]) for k in a.average)
    assert all(torch.equal(v, load_file(tmp_path / "b.safetensors")[k]) for k, v in saved.items())


def test_ema_can_be_turned_on_at_a_resume_with_extend(tmp_path: Path, text_file: Path) -> None:
    common = ["--no-eval", "--checkpoint", str(tmp_path / "c.ckpt"), "--checkpoint-every", "2"]
    train.train(text_args(tmp_path, text_file, *common, "--steps", "2"))
    assert read_checkpoint(tmp_path / "c.ckpt").average is None
    with pytest.raises(train.TrainError, match=r"ema_decay 0\.0 -> 0\.5\); resume with the same flags"):
        train.train(text_args(tmp_path, text_file, *common, "--steps", "2", "--resume", "--ema-decay", "0.5"))
    train.train(text_args(tmp_path, text_file, *common, "--steps", "4", "--resume", "--extend", "--ema-decay", "0.5"))
    ckpt = read_checkpoint(tmp_path / "c.ckpt")
    assert (
        ckpt.run.ema_decay == 0.5
        and ckpt.average is not None
        and ckpt.average.keys() == {name for name, _ in build_model(ckpt.config).named_parameters()}
    )


def test_a_checkpoint_whose_average_lacks_a_parameter_is_a_clear_error(tmp_path: Path, text_file: Path) -> None:
    common = ["--no-eval", "--ema-decay", "0.9", "--checkpoint", str(tmp_path / "d.ckpt"), "--checkpoint-every", "2"]
    train.train(text_args(tmp_path, text_file, *common, "--steps", "2"))
    with safe_open(tmp_path / "d.ckpt", "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "average.head.bias"}
    save_file(tensors, tmp_path / "d.ckpt", metadata=metadata)
    with pytest.raises(
        train.TrainError, match=r"weight average does not match .*missing: head\.bias; not in the model: none"
    ):
        train.train(text_args(tmp_path, text_file, *common, "--steps", "4", "--resume", "--extend"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-shift", "5"], r"--max-shift must be in 0\.\.4 pixels, got 5"),
        (["--max-shift", "-1"], r"--max-shift must be in 0\.\.4 pixels, got -1"),
        (["--max-shift", "1", "--task", "text"], "--max-shift shifts MNIST digits; --task text has no images to shift"),
        (
            ["--ema-decay", "1"],
            r"--ema-decay must be in \[0, 1\) \(0: no average; 0\.999 averages about the last 1,000 "
            r"steps\), got 1\.0",
        ),
    ],
)
def test_bad_max_shift_or_ema_decay_is_a_clear_error(
    tmp_path: Path, text_file: Path, flags: list[str], message: str
) -> None:
    with pytest.raises(train.TrainError, match=message):
        train.train(text_args(tmp_path, text_file, "--steps", "1", *flags))


def read_safetensors_dtypes(path: Path) -> set[str]:
    """Tensor dtypes as the file's own JSON header lists them."""
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


# ---------------------------------------------------------------- evaluation


def direct_bits_per_dim(model, images: torch.Tensor) -> float:
    """Image by image, pixel by pixel from the probabilities: the definition, in float64."""
    total, count = 0.0, 0
    with torch.no_grad():
        for image in images.long():
            logits, _ = model(with_bos(image[None]))
            probs = torch.softmax(logits[0].double(), dim=-1)  # (784, 256)
            for t, pixel in enumerate(image.tolist()):
                total -= math.log2(float(probs[t, pixel]))
                count += 1
    return total / count


def test_mnist_bits_per_dim_equals_a_direct_computation(tmp_path: Path, mnist_dir: Path) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(attention="linear", task="mnist", d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=784)
    path = tmp_path / "e.safetensors"
    save_model(build_model(cfg), path)
    model, _ = load_model(path)
    images = load_mnist(mnist_dir, "test").images
    expected = direct_bits_per_dim(model, images)
    for batch_size in (1, 4):  # batching must not change the result
        result = evaluate.evaluate_file(path, mnist_dir, torch.device("cpu"), batch_size=batch_size)
        assert result["bits_per_dim"] == pytest.approx(expected, abs=1e-5)
        assert result["images"] == 6


def test_text_loss_covers_every_validation_byte_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(attention="softmax", task="text", d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=8)
    model = build_model(cfg).eval()
    valid = torch.randint(0, 256, (21,), dtype=torch.uint8)  # two full windows of 8 and a tail of 5
    pieces = [valid[:8], valid[8:16], valid[16:]]
    with torch.no_grad():
        nats = sum(
            float(
                -torch.log_softmax(model(with_bos(p[None].long()))[0][0].double(), -1)
                .gather(-1, p.long()[:, None])
                .sum()
            )
            for p in pieces
        )
    result = evaluate.evaluate_text(model, valid, batch_size=1)
    assert result["bytes"] == 21
    assert result["loss_nats_per_byte"] == pytest.approx(nats / 21, abs=1e-5)
    assert result["bits_per_byte"] == pytest.approx(nats / 21 / math.log(2), abs=1e-5)


def test_eval_store_writes_the_result_into_the_file_and_keeps_its_tensors(
    tmp_path: Path, mnist_dir: Path, capsys
) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(attention="linear", task="mnist", d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=784)
    path = tmp_path / "s.safetensors"
    save_model(build_model(cfg), path, {"examples_seen": 7}, dtype=torch.bfloat16)
    before = load_file(path)
    args = ["--data", str(mnist_dir), "--device", "cpu", "--threads", "1", "--json", "--store"]
    assert evaluate.run(parse("eval", [str(path), *args])) == 0
    printed = json.loads(capsys.readouterr().out)[str(path)]
    _, info = read_metadata(path)
    assert info["examples_seen"] == 7 and info["eval"] == printed
    after = load_file(path)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert all(t.dtype == torch.bfloat16 for t in after.values())


def test_eval_cli_reports_a_missing_data_folder(tmp_path: Path, capsys) -> None:
    path = tmp_path / "f.safetensors"
    save_model(build_model(ModelConfig(task="mnist", d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=784)), path)
    assert evaluate.run(parse("eval", [str(path), "--data", str(tmp_path / "nope"), "--device", "cpu"])) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_pictures_draws_one_column_per_model(tmp_path: Path, mnist_dir: Path) -> None:
    from PIL import Image

    from training import pictures

    torch.manual_seed(0)
    model_path = tmp_path / "g.safetensors"
    save_model(
        build_model(ModelConfig(task="mnist", d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=784)), model_path
    )
    out = tmp_path / "p.png"
    args = parse(
        "pictures",
        [
            "--models",
            str(model_path),
            str(model_path),
            "--data",
            str(mnist_dir),
            "--out",
            str(out),
            "--digits",
            "2",
            "--scale",
            "1",
            "--device",
            "cpu",
        ],
    )
    assert pictures.run(args) == 0
    width, height = Image.open(out).size
    assert width == 4 * (28 + pictures.GAP) + pictures.GAP  # original, occluded, two models
    assert height == pictures.LABEL_HEIGHT + 2 * (28 + pictures.GAP) + pictures.GAP


def test_the_training_curve_survives_a_resume_and_is_drawn(tmp_path: Path, text_file: Path, capsys) -> None:
    from PIL import Image

    from training import curves

    common = ["--steps", "110", "--checkpoint-every", "60", "--no-eval", "--checkpoint-precision", "float32"]
    straight = text_args(
        tmp_path, text_file, *common, "--checkpoint", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "a.safetensors")
    )
    train.train(straight)
    resumed = text_args(
        tmp_path,
        text_file,
        *common,
        "--checkpoint",
        str(tmp_path / "b.ckpt"),
        "--resume",
        "--out",
        str(tmp_path / "b.safetensors"),
    )
    train.train(resumed, stop_after=60)
    assert [p[0] for p in read_checkpoint(tmp_path / "b.ckpt").progress.curve] == [50]
    train.train(resumed)
    a, b = (read_metadata(tmp_path / f"{name}.safetensors")[1]["curve"] for name in "ab")
    assert a["columns"] == ["step", "examples", "elapsed_s", "train_loss_nats"]
    assert [p[0] for p in b["points"]] == [50, 100, 110]  # the point from before the stop is kept; the last step
    assert [(p[0], p[1], p[3]) for p in a["points"]] == [(p[0], p[1], p[3]) for p in b["points"]]
    out = tmp_path / "curves.png"
    argv = [str(tmp_path / "b.safetensors"), str(tmp_path / "b.ckpt"), "--out", str(out), "--target", "1.6"]
    assert curves.run(parse("curves", argv)) == 0
    printed = capsys.readouterr().out
    assert "b.safetensors: 880 examples" in printed and "b.ckpt: 800 examples" in printed
    assert f"training loss {b['points'][-1][3]:.3f} nats/byte" in printed
    assert Image.open(out).format == "PNG"


def test_a_run_from_another_files_weights_keeps_its_runs_and_curves_draws_them_all(
    tmp_path: Path, text_file: Path, capsys
) -> None:
    from training import curves

    def run(name: str, steps: int, *extra: str) -> dict:
        return train.train(text_args(tmp_path, text_file, "--steps", str(steps), "--out", str(tmp_path / name), *extra))

    first = run("first.safetensors", 60)
    second = run("second.safetensors", 50, "--init-from", str(tmp_path / "first.safetensors"), "--no-eval")
    third = run("third.safetensors", 50, "--init-from", str(tmp_path / "second.safetensors"), "--no-eval")
    assert second["lineage"] == [
        {
            "command": first["command"],
            "examples_seen": first["examples_seen"],
            "wall_time_s": first["wall_time_s"],
            "held_out": first["eval"]["loss_nats_per_byte"],
            "points": first["curve"]["points"],
        }
    ]
    assert [r["examples_seen"] for r in third["lineage"]] == [first["examples_seen"], second["examples_seen"]]
    assert third["lineage"][1]["held_out"] is None  # --no-eval: no result, the run still counts
    assert read_metadata(tmp_path / "third.safetensors")[1]["lineage"] == third["lineage"]

    capsys.readouterr()  # the runs' own output
    argv = [str(tmp_path / "third.safetensors"), "--out", str(tmp_path / "c.png"), "--target", "9", "--target", "8"]
    assert curves.run(parse("curves", argv)) == 0
    printed = capsys.readouterr().out
    total = first["examples_seen"] + second["examples_seen"] + third["examples_seen"]
    hours = (first["wall_time_s"] + second["wall_time_s"] + third["wall_time_s"]) / 3600
    assert printed.startswith(f"third.safetensors: {total:,} examples, {hours:.2f} h, ")
    assert "(its own run, after 2 earlier)" in printed
    assert f"held-out at the earlier runs' ends: {first['eval']['loss_nats_per_byte']:.3f}, -" in printed
    curve = curves.read_curve(str(tmp_path / "third.safetensors"))
    assert curve.examples == sorted(curve.examples) and curve.examples[-1] == total
    assert curve.examples[curve.own_start] == first["examples_seen"] + second["examples_seen"] + 50 * 8


def test_a_resumed_run_keeps_the_lineage_it_started_with(tmp_path: Path, text_file: Path) -> None:
    # A continued run's command may name the file it ships to as --init-from: by its resume that file is newer.
    def run(name: str, *extra: str, stop_after: int | None = None) -> dict:
        return train.train(
            text_args(tmp_path, text_file, "--steps", "40", "--no-eval", "--out", str(tmp_path / name), *extra),
            stop_after=stop_after,
        )

    parent = run("parent.safetensors")
    child = [
        "--init-from",
        str(tmp_path / "parent.safetensors"),
        "--checkpoint",
        str(tmp_path / "child.ckpt"),
        "--checkpoint-every",
        "30",
        "--resume",
        "--steps",
        "60",
    ]
    run("child.safetensors", *child, stop_after=30)
    assert read_checkpoint(tmp_path / "child.ckpt").progress.lineage[0]["points"] == parent["curve"]["points"]
    run("other.safetensors", "--seed", "9", "--steps", "30")
    (tmp_path / "other.safetensors").replace(tmp_path / "parent.safetensors")  # the --init-from file, replaced
    info = run("child.safetensors", *child)
    assert [r["examples_seen"] for r in info["lineage"]] == [parent["examples_seen"]]
    assert info["lineage"][0]["command"] == parent["command"]
    from training import curves

    curve = curves.read_curve(str(tmp_path / "child.ckpt"))  # a checkpoint's curve counts its lineage too
    assert curve.run_ends == [(parent["examples_seen"], None)]


def test_curves_names_a_file_without_a_curve_and_mixed_tasks(tmp_path: Path, capsys) -> None:
    from training import curves

    old = tmp_path / "old.safetensors"
    save_model(build_model(ModelConfig(task="text", d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=16)), old)
    assert curves.run(parse("curves", [str(old), "--out", str(tmp_path / "c.png")])) == 2
    assert "old.safetensors: no training curve stored" in capsys.readouterr().err
    assert curves.run(parse("curves", [str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "c.png")])) == 2
    assert "missing.ckpt: no such file" in capsys.readouterr().err
    points = {"columns": [], "points": [[50, 400, 1.0, 2.0], [100, 800, 2.0, 1.5]]}
    for task, length in (("text", 16), ("mnist", 784)):
        model = build_model(ModelConfig(task=task, d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=length))
        save_model(model, tmp_path / f"{task}.safetensors", {"curve": points})
    argv = [str(tmp_path / "text.safetensors"), str(tmp_path / "mnist.safetensors"), "--out", str(tmp_path / "c.png")]
    assert curves.run(parse("curves", argv)) == 2
    assert "different tasks (mnist, text)" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


# ---------------------------------------------------------------- shipped weights


@pytest.mark.skipif(not SHIPPED, reason="no .safetensors files in weights/ yet")
@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_model_loads_reports_metrics_and_generates(path: Path) -> None:
    cfg, info = read_metadata(path)
    assert info["examples_seen"] > 0 and info["wall_time_s"] > 0 and info["device"]
    metrics = info["eval"]
    if cfg.task == "mnist":
        assert 0 < metrics["bits_per_dim"] < 8, metrics
        length = 784
    else:
        assert 0 < metrics["loss_nats_per_byte"] < math.log(256), metrics
        length = 64
    model, _ = load_model(path, device="cpu")
    sampling = BatchSampling.from_params([SamplingParams(seed=1)], "cpu")
    tokens = generate(model, torch.zeros(1, 0, dtype=torch.long), length, sampling, compiled=False)  # a file test
    assert tokens.shape == (1, length)
    assert int(tokens.min()) >= 0 and int(tokens.max()) <= 255


COMMITTED_CHECKPOINTS = sorted((WEIGHTS / "checkpoints").glob("*.ckpt"))


@pytest.mark.skipif(not COMMITTED_CHECKPOINTS, reason="no checkpoints in weights/checkpoints/ yet")
@pytest.mark.parametrize("path", COMMITTED_CHECKPOINTS, ids=[p.stem for p in COMMITTED_CHECKPOINTS])
def test_committed_checkpoint_is_at_most_10_mb_and_continues_the_shipped_file(path: Path) -> None:
    assert path.stat().st_size <= 10_000_000, (
        f"{path.name}: {path.stat().st_size:,} bytes (the checkpoint target: about 10 MB)"
    )
    ckpt = read_checkpoint(path)
    saved = ckpt.average if ckpt.average is not None else ckpt.model  # what the run's --out file holds
    shipped = load_file(WEIGHTS / f"{path.stem}.safetensors")
    assert set(saved) <= set(shipped) and len(saved) >= len(shipped) - ckpt.config.n_layers  # Reformer: + rotations
    for name, tensor in saved.items():
        assert torch.equal(tensor.to(shipped[name].dtype), shipped[name]), name


def test_pictures_refuses_a_text_model_naming_what_it_needs(tmp_path: Path, mnist_dir: Path, capsys) -> None:
    from training import pictures

    text_model = tmp_path / "words.safetensors"
    config = ModelConfig(task="text", d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=16)
    save_model(build_model(config), text_model)
    args = parse(
        "pictures",
        [
            "--models",
            str(text_model),
            "--data",
            str(mnist_dir),
            "--out",
            str(tmp_path / "p.png"),
            "--digits",
            "1",
            "--device",
            "cpu",
        ],
    )
    assert pictures.run(args) == 2
    assert capsys.readouterr().err == (
        f"rnnserve pictures: error: {text_model}: this is a text model; "
        "`rnnserve pictures` draws digits, so --models takes MNIST models "
        "(trained with --task mnist)\n"
    )
