"""The digit classifier and `rnnserve eval --completions`, on generated digits and tiny models.

Nothing here reads ../shared: toy "digits" (bars and boxes) stand in for
MNIST, and tiny random-weight models stand in for trained ones. Only the
last test reads the shipped classifier in weights/classifier/, when present.
"""

from __future__ import annotations

import argparse
import copy
import functools
import io
import json
import math
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from model import ModelConfig, build_model
from model.transformer import with_bos
from model.io.weights import WeightsError, read_metadata, save_model
from server_support import make_settings, running_server
from training import classifier as clf
from training import arguments
from training.completions import (
    SEED_STRIDE,
    Occlusion,
    choose_occlusion,
    complete_digits,
    mask_from_file,
    occlusion_mask,
    unknown_bits_per_dim,
)
from rnnserve_cli import run_eval
from server.api.imaging import read_mask_png
from server.engine.offline import complete_with_particles
from training.data import DataError, load_labeled_mnist, write_idx_images, write_idx_labels

WEIGHTS = Path(__file__).resolve().parent.parent / "weights"
SHIPPED_CLASSIFIER = WEIGHTS / "classifier" / "digit-classifier.safetensors"
TOY_CLASSES = 3


def toy_digits(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, 784) uint8 and (count,) labels: 0 a vertical bar, 1 a horizontal bar, 2 a hollow box, placed at random."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, TOY_CLASSES, (count,), generator=gen)
    images = torch.zeros(count, 28, 28, dtype=torch.uint8)
    for i, (label, a, b) in enumerate(zip(labels.tolist(), *torch.randint(4, 14, (2, count), generator=gen).tolist())):
        if label == 0:
            images[i, a : a + 12, b + 4 : b + 7] = 255
        elif label == 1:
            images[i, b + 4 : b + 7, a : a + 12] = 255
        else:
            images[i, a : a + 10, b : b + 10] = 255
            images[i, a + 2 : a + 8, b + 2 : b + 8] = 0
    return images.view(count, 784), labels.to(torch.uint8)


def write_toy_mnist(folder: Path, train: int = 200, test: int = 60) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, count, seed in (("train", train, 1), ("t10k", test, 2)):
        images, labels = toy_digits(count, seed)
        write_idx_images(folder / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx_labels(folder / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return folder


@functools.cache
def tiny_mnist_model(seed: int = 0):
    """A random-weight MNIST model with weights large enough that its samples depend on its input; one per
    seed and session, so that its decode steps compile once (never change it in place)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(attention="linear", task="mnist", d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=784)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model.eval()


def parse_eval(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    arguments.add_eval_arguments(parser)
    return parser.parse_args(argv)


def png_bytes(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory) -> Path:
    return write_toy_mnist(tmp_path_factory.mktemp("toy") / "mnist")


@pytest.fixture(scope="module")
def toy_classifier(toy_data: Path, tmp_path_factory) -> Path:
    """A classifier trained on the toy digits by the real command, saved where eval finds it with --classifier."""
    out = tmp_path_factory.mktemp("classifier") / "digit-classifier.safetensors"
    args = argparse.ArgumentParser()
    arguments.add_classifier_arguments(args)
    assert (
        clf.run(
            args.parse_args(
                ["--data", str(toy_data), "--out", str(out), "--epochs", "10", "--batch-size", "16", "--seed", "0"]
            )
        )
        == 0
    )
    return out


# ---------------------------------------------------------------- classifier


def test_classifier_learns_the_toy_task_far_above_chance(toy_classifier: Path, toy_data: Path) -> None:
    classifier, info = clf.load_classifier(toy_classifier)
    test = load_labeled_mnist(toy_data, "test")
    measured = clf.accuracy(classifier, test.images, test.labels)
    assert measured >= 0.9 > 2 / TOY_CLASSES  # chance is 1/3
    assert info["test_accuracy"] == pytest.approx(measured)  # the stored accuracy is the file's own
    assert info["test_images"] == 60 and info["train_images"] == 200 and info["kind"] == "digit classifier"


def test_random_shift_moves_each_digit_by_at_most_the_limit() -> None:
    images = torch.zeros(50, 28, 28, dtype=torch.uint8)
    images[:, 13, 11] = 200  # one lit pixel, away from the border
    shifted = clf.random_shift(images.view(50, 784), 2, torch.Generator().manual_seed(0)).view(50, 28, 28)
    assert torch.equal(shifted.sum(dim=(1, 2)), images.sum(dim=(1, 2)))  # nothing lost, nothing added
    where = shifted.flatten(1).argmax(dim=1)
    rows, cols = where // 28, where % 28
    assert (rows - 13).abs().max() == 2 and (cols - 11).abs().max() == 2  # up to 2 pixels, and 2 is reached
    assert len(set(zip(rows.tolist(), cols.tolist()))) > 10  # many different shifts
    assert torch.equal(clf.random_shift(images.view(50, 784), 0, torch.Generator()), images.view(50, 784))


def test_the_classifier_file_is_not_served_as_a_model(toy_classifier: Path, tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    (weights / "classifier").mkdir(parents=True)
    save_model(tiny_mnist_model(), weights / "mnist-tiny.safetensors")
    (weights / "classifier" / "digit-classifier.safetensors").write_bytes(toy_classifier.read_bytes())
    assert make_settings(weights=weights).model_paths() == [weights / "mnist-tiny.safetensors"]
    with pytest.raises(WeightsError, match="not an rnnserve model file"):  # named as a model by hand: refused
        read_metadata(weights / "classifier" / "digit-classifier.safetensors")


def test_a_generative_model_is_refused_as_a_classifier(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_model(tiny_mnist_model(), path)
    with pytest.raises(WeightsError, match="not a digit classifier"):
        clf.load_classifier(path)


def test_train_classifier_reports_a_missing_labels_file(tmp_path: Path, capsys) -> None:
    data = write_toy_mnist(tmp_path / "mnist", train=20, test=10)
    (data / "t10k-labels-idx1-ubyte.gz").unlink()
    parser = argparse.ArgumentParser()
    arguments.add_classifier_arguments(parser)
    assert clf.run(parser.parse_args(["--data", str(data), "--out", str(tmp_path / "c.safetensors")])) == 2
    assert "t10k-labels-idx1-ubyte.gz: no such file" in capsys.readouterr().err


@pytest.mark.skipif(not SHIPPED_CLASSIFIER.is_file(), reason="no shipped classifier in weights/classifier/")
def test_shipped_classifier_is_small_accurate_and_not_served() -> None:
    classifier, info = clf.load_classifier(SHIPPED_CLASSIFIER)
    assert info["test_accuracy"] >= 0.97 and info["test_images"] == 10_000
    assert SHIPPED_CLASSIFIER.stat().st_size < 300_000
    assert SHIPPED_CLASSIFIER not in make_settings(weights=WEIGHTS).model_paths()


# ---------------------------------------------------------------- occlusions


def grid(unknown: torch.Tensor) -> np.ndarray:
    return unknown.view(28, 28).numpy()


def test_named_occlusions_mark_the_right_pixels() -> None:
    rows, cols = np.mgrid[0:28, 0:28]
    assert (grid(occlusion_mask("bottom-half")) == (rows >= 14)).all()
    assert (grid(occlusion_mask("right-half")) == (cols >= 14)).all()
    centre = (rows >= 7) & (rows < 21) & (cols >= 7) & (cols < 21)
    assert (grid(occlusion_mask("centre-box")) == centre).all() and centre.sum() == 196
    assert choose_occlusion("right-half", None).first_unknown == 14
    assert choose_occlusion(None, None).name == "bottom-half" and choose_occlusion(None, None).first_unknown == 392


def test_mask_png_marks_white_and_transparent_pixels(tmp_path: Path) -> None:
    grey = np.zeros((28, 28), dtype=np.uint8)
    grey[3, 5] = grey[20, 1] = 255
    grey[10, 10] = 127  # below the threshold: known
    path = tmp_path / "mask.png"
    path.write_bytes(png_bytes(grey))
    unknown = grid(mask_from_file(path, read_mask_png))
    assert unknown.sum() == 2 and unknown[3, 5] and unknown[20, 1]
    rgba = np.zeros((28, 28, 4), dtype=np.uint8)
    rgba[..., 3] = 255
    rgba[27, 27, 3] = 0  # transparent: unknown, as the server reads a mask
    Image.fromarray(rgba, "RGBA").save(path)
    assert grid(mask_from_file(path, read_mask_png)).sum() == 1 and grid(mask_from_file(path, read_mask_png))[27, 27]
    assert choose_occlusion(None, str(path), read_mask_png).name == "mask mask.png"


def test_bad_mask_pngs_get_clear_errors(tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.png"
    wrong.write_bytes(png_bytes(np.full((27, 28), 255)))
    with pytest.raises(DataError, match=r"wrong.png: mask is 28x27 pixels; expected 28x28"):
        mask_from_file(wrong, read_mask_png)
    black = tmp_path / "black.png"
    black.write_bytes(png_bytes(np.zeros((28, 28))))
    with pytest.raises(DataError, match="nothing is unknown"):
        mask_from_file(black, read_mask_png)
    with pytest.raises(DataError, match="no such file"):
        mask_from_file(tmp_path / "absent.png", read_mask_png)
    with pytest.raises(DataError, match="unknown occlusion 'top-half'"):
        occlusion_mask("top-half")


# ---------------------------------------------------------------- completions and bits/dim


@pytest.mark.parametrize("name", ["bottom-half", "right-half", "centre-box"])
def test_completions_keep_every_known_pixel_and_sample_the_rest(name: str) -> None:
    images, _ = toy_digits(3, seed=5)
    occlusion = Occlusion(name, occlusion_mask(name))
    completed = complete_digits(tiny_mnist_model(), images, occlusion, seed=3, batch_size=2)
    known = ~occlusion.unknown
    assert completed.shape == images.shape and completed.dtype == torch.uint8
    assert torch.equal(completed[:, known], images[:, known])
    assert (completed[:, occlusion.unknown] != images[:, occlusion.unknown]).float().mean() > 0.5


def test_completions_are_seeded_and_do_not_depend_on_the_batch_size() -> None:
    images, _ = toy_digits(5, seed=6)
    occlusion = Occlusion("centre-box", occlusion_mask("centre-box"))
    model = tiny_mnist_model()
    one = complete_digits(model, images, occlusion, seed=1, batch_size=5)
    assert torch.equal(one, complete_digits(model, images, occlusion, seed=1, batch_size=2))
    assert not torch.equal(one, complete_digits(model, images, occlusion, seed=2, batch_size=5))


def test_one_particle_through_the_engine_is_the_plain_sampler_and_more_keep_the_known_pixels() -> None:
    """`eval --particles K` runs the server's engine: K=1 draws exactly the plain sampler's completions."""
    images, _ = toy_digits(3, seed=8)
    occlusion = Occlusion("right-half", occlusion_mask("right-half"))
    model = tiny_mnist_model()
    plain = complete_digits(model, images, occlusion, seed=4, batch_size=3)
    seeds = [4 * SEED_STRIDE + i for i in range(3)]
    forced = occlusion.forced(images)
    one = complete_with_particles(model, forced, occlusion.first_unknown, seeds, 1.0, particles=1, rows=3)
    assert torch.equal(one.images, plain)
    four = complete_with_particles(model, forced, occlusion.first_unknown, seeds, 1.0, particles=4, rows=8)
    assert torch.equal(four.images[:, ~occlusion.unknown], images[:, ~occlusion.unknown])
    assert [s.particles for s in four.summaries] == [4, 4, 4] and not torch.equal(four.images, plain)


def test_unknown_bits_per_dim_equals_a_direct_computation() -> None:
    images, _ = toy_digits(3, seed=7)
    images = images.clone()
    images[:, ::5] = torch.arange(images[:, ::5].numel(), dtype=torch.uint8).view(3, -1)  # grey levels, not just 0/255
    model = tiny_mnist_model()
    unknown = occlusion_mask("right-half")
    total = 0.0
    with torch.no_grad():
        for image in images.long():
            probs = torch.softmax(model(with_bos(image[None]))[0][0].double(), dim=-1)  # (784, 256)
            total -= sum(math.log2(float(probs[t, image[t]])) for t in unknown.nonzero()[:, 0].tolist())
    expected = total / (3 * 392)
    for batch_size in (1, 2):
        assert unknown_bits_per_dim(model, images, unknown, batch_size) == pytest.approx(expected, abs=1e-5)


# ---------------------------------------------------------------- the command


def save_tiny_file(folder: Path, name: str = "tiny") -> Path:
    path = folder / f"{name}.safetensors"
    save_model(tiny_mnist_model(), path, {"examples_seen": 3, "eval": {"bits_per_dim": 7.5}}, dtype=torch.bfloat16)
    return path


def test_eval_completions_reports_stores_and_serves_the_result(
    tmp_path: Path, toy_data: Path, toy_classifier: Path, capsys
) -> None:
    path = save_tiny_file(tmp_path)
    before = load_file(path)
    argv = [
        str(path),
        "--completions",
        "--data",
        str(toy_data),
        "--classifier",
        str(toy_classifier),
        "--limit",
        "8",
        "--batch-size",
        "3",
        "--device",
        "cpu",
        "--json",
        "--store",
    ]
    assert run_eval(parse_eval(argv)) == 0
    printed = json.loads(capsys.readouterr().out)[str(path)]
    test = load_labeled_mnist(toy_data, "test")
    classifier, _ = clf.load_classifier(toy_classifier)
    images, labels = test.images[:8], test.labels[:8]
    hidden = images.view(8, 28, 28).clone()
    hidden[:, 14:] = 0
    assert printed["digits"] == 8 and printed["unknown_pixels"] == 392 and printed["occlusion"] == "bottom-half"
    assert printed["read_as_true_original"] == pytest.approx(clf.accuracy(classifier, images, labels))
    assert printed["read_as_true_occluded"] == pytest.approx(clf.accuracy(classifier, hidden.view(8, 784), labels))
    model_bits = unknown_bits_per_dim(
        copy.deepcopy(tiny_mnist_model()).to(torch.bfloat16).float(), images, occlusion_mask("bottom-half")
    )
    assert printed["bits_per_dim_unknown"] == pytest.approx(model_bits, rel=1e-4)
    _, info = read_metadata(path)
    assert info["eval"]["completions"]["bottom-half"] == printed and info["eval"]["bits_per_dim"] == 7.5
    after = load_file(path)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with running_server(make_settings(weights=tmp_path)) as (url, _app):
        listed = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    assert listed["metrics"]["completions"]["bottom-half"] == printed | {"data": Path(printed["data"]).name}


def test_a_bits_per_dim_store_keeps_stored_completions(tmp_path: Path, toy_data: Path) -> None:
    path = save_tiny_file(tmp_path)
    from model.io.weights import update_info

    update_info(path, {"eval": {"bits_per_dim": 7.5, "completions": {"right-half": {"digits": 4}}}})
    assert (
        run_eval(
            parse_eval([str(path), "--data", str(toy_data), "--limit", "2", "--store", "--json", "--device", "cpu"])
        )
        == 0
    )
    stored = read_metadata(path)[1]["eval"]
    assert stored["completions"] == {"right-half": {"digits": 4}} and stored["bits_per_dim"] != 7.5


@pytest.mark.parametrize(
    "problem, expected",
    [
        ("missing data", "no such file or folder"),
        ("missing classifier", "no digit classifier here; train one with `rnnserve train-classifier"),
        ("wrong-size mask", "mask is 20x20 pixels; expected 28x28"),
        ("text model", ": this is a text model; --completions needs an MNIST model (trained with --task mnist)"),
        ("mask without --completions", "--mask only applies with --completions"),
        ("mask and occlusion", "give either --occlusion or --mask, not both"),
        ("particles without --completions", "--particles only applies with --completions"),
        ("zero particles", "--particles must be in 1..256, got 0"),
    ],
)
def test_eval_completions_errors_are_clear(
    problem: str, expected: str, tmp_path: Path, toy_data: Path, toy_classifier: Path, capsys
) -> None:
    path = save_tiny_file(tmp_path)
    mask = tmp_path / "small.png"
    mask.write_bytes(png_bytes(np.full((20, 20), 255)))
    args = {"data": str(toy_data), "classifier": str(toy_classifier)}
    flags = ["--completions", "--limit", "2", "--device", "cpu"]
    if problem == "missing data":
        args["data"] = str(tmp_path / "nowhere")
    elif problem == "missing classifier":
        args["classifier"] = str(tmp_path / "weights" / "classifier" / "digit-classifier.safetensors")
    elif problem == "wrong-size mask":
        flags += ["--mask", str(mask)]
    elif problem == "text model":
        path = tmp_path / "text.safetensors"
        save_model(build_model(ModelConfig(task="text", d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=16)), path)
    elif problem == "mask without --completions":
        flags = ["--mask", str(mask), "--device", "cpu"]
    elif problem == "particles without --completions":
        flags = ["--particles", "4", "--device", "cpu"]
    elif problem == "zero particles":
        flags += ["--particles", "0"]
    else:
        flags += ["--mask", str(mask), "--occlusion", "right-half"]
    argv = [str(path), "--data", args["data"], "--classifier", args["classifier"], *flags]
    assert run_eval(parse_eval(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("rnnserve eval: error: ") and expected in err, err
