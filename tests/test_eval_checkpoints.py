"""`rnnserve eval RUN.ckpt`: a run in progress scored from its checkpoint, as the file it would save now."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.io.weights import read_metadata
from rnnserve_cli import parse_args
from training import evaluate, train
from training.completions import load_completion_model
from training.data import write_idx_images


@pytest.fixture
def mnist_dir(tmp_path: Path) -> Path:
    """Random grey digits: enough for a tiny model to move its bits/dim in a few steps."""
    folder = tmp_path / "mnist"
    folder.mkdir()
    gen = torch.Generator().manual_seed(0)
    for name, count in (("train-images-idx3-ubyte.gz", 32), ("t10k-images-idx3-ubyte.gz", 4)):
        images = (torch.rand(count, 784, generator=gen) < 0.2).to(torch.uint8) * 255
        write_idx_images(folder / name, images)
    return folder


def run_training(tmp_path: Path, mnist_dir: Path, *extra: str) -> tuple[Path, Path]:
    out, ckpt = tmp_path / "m.safetensors", tmp_path / "m.ckpt"
    train.train(
        parse_args(
            [
                "train",
                "--task",
                "mnist",
                "--attention",
                "linear",
                "--data",
                str(mnist_dir),
                "--preset",
                "tiny",
                "--steps",
                "4",
                "--checkpoint-every",
                "2",
                "--warmup-steps",
                "1",
                "--lr",
                "1e-2",
                "--device",
                "cpu",
                "--threads",
                "1",
                "--no-progress",
                "--no-eval",
                "--out",
                str(out),
                "--checkpoint",
                str(ckpt),
                *extra,
            ]
        )
    )
    return out, ckpt


def eval_json(capsys, *argv: str) -> dict:
    capsys.readouterr()  # what training printed
    assert evaluate.run(parse_args(["eval", *argv, "--device", "cpu", "--threads", "1", "--json"])) == 0
    return json.loads(capsys.readouterr().out)


# A checkpoint keeps the average in its precision (bfloat16 by default, as the file saves it) and the weights in
# float32: with the file saved alike, both score the same to the last digit.
@pytest.mark.parametrize(
    "extra, weights",
    [(["--ema-decay", "0.5"], "moving average of the weights"), (["--save-dtype", "float32"], "last step's weights")],
)
def test_a_checkpoint_scores_as_the_file_its_run_saves(
    tmp_path: Path, mnist_dir: Path, capsys, extra: list[str], weights: str
) -> None:
    out, ckpt = run_training(tmp_path, mnist_dir, *extra)
    results = eval_json(capsys, str(out), str(ckpt), "--data", str(mnist_dir))
    from_file, from_ckpt = results[str(out)], results[str(ckpt)]
    assert from_ckpt["bits_per_dim"] == pytest.approx(from_file["bits_per_dim"], abs=1e-6)
    examples = read_metadata(out)[1]["examples_seen"]
    assert from_ckpt["checkpoint"] == {"step": 4, "examples_seen": examples, "weights": weights}
    assert "checkpoint" not in from_file
    assert evaluate.run(parse_args(["eval", str(ckpt), "--data", str(mnist_dir), "--device", "cpu"])) == 0
    assert f"(step 4, {weights})" in capsys.readouterr().out


def test_the_average_is_what_a_checkpoint_scores(tmp_path: Path, mnist_dir: Path) -> None:
    out, ckpt = run_training(tmp_path, mnist_dir, "--ema-decay", "0.9")
    model = load_completion_model(ckpt, torch.device("cpu"))  # --completions loads checkpoints the same way
    saved = load_file(out)
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name].float()), name


def test_store_refuses_a_checkpoint_and_a_damaged_one_is_named(tmp_path: Path, mnist_dir: Path, capsys) -> None:
    _, ckpt = run_training(tmp_path, mnist_dir)
    argv = [str(ckpt), "--data", str(mnist_dir), "--device", "cpu", "--store"]
    assert evaluate.run(parse_args(["eval", *argv])) == 2
    assert "--store writes into a .safetensors file's metadata; " in capsys.readouterr().err
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    assert evaluate.run(parse_args(["eval", str(ckpt), "--data", str(mnist_dir), "--device", "cpu"])) == 2
    err = capsys.readouterr().err
    assert "rnnserve eval: error: " in err and str(ckpt) in err
