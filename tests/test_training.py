"""training/: data loaders, the train loop, checkpoints, evaluation and the shipped weights.

Everything runs on tiny models and generated data in a temporary folder;
only the last tests read the real files in weights/ (skipped when none ship).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model import ModelConfig, build_model
from model.generate import generate
from model.sampling import BatchSampling, SamplingParams
from model.transformer import with_bos
from model.weights_io import load_model, read_metadata, save_model
from training import evaluate, train
from training.data import DataError, find_images_file, load_mnist, load_text, read_idx_images, write_idx_images

WEIGHTS = Path(__file__).resolve().parent.parent / "weights"
SHIPPED = sorted(WEIGHTS.glob("*.safetensors"))


def parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def digit_images(count: int, seed: int = 0) -> torch.Tensor:
    """(count, 784) uint8: a bright random vertical bar on black, a very learnable 'digit'."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.zeros(count, 28, 28, dtype=torch.uint8)
    cols = torch.randint(4, 24, (count,), generator=gen)
    for i, c in enumerate(cols.tolist()):
        images[i, 6:22, c:c + 3] = 255
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
    return parse(train, ["--task", "text", "--attention", "linear", "--data", str(text_file), "--preset", "tiny",
                         "--context", "16", "--warmup-steps", "5", "--device", "cpu", "--threads", "2",
                         "--no-progress", "--out", str(tmp_path / "m.safetensors"), *extra])


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
    # Dropout and fresh reformer rotations make the RNG state matter.
    common = ["--steps", "6", "--checkpoint-every", "3", "--no-eval", "--attention", "reformer", "--dropout", "0.1"]
    straight = text_args(tmp_path, text_file, *common, "--checkpoint", str(tmp_path / "a.ckpt"))
    train.train(straight)
    resumed = text_args(tmp_path, text_file, *common, "--checkpoint", str(tmp_path / "b.ckpt"), "--resume")
    train.train(resumed, stop_after=3)  # an interrupted run: its checkpoint is at step 3
    assert torch.load(tmp_path / "b.ckpt", weights_only=False)["progress"]["step"] == 3
    train.train(resumed)
    a = torch.load(tmp_path / "a.ckpt", weights_only=False)
    b = torch.load(tmp_path / "b.ckpt", weights_only=False)
    assert a["progress"]["step"] == b["progress"]["step"] == 6
    assert a["progress"]["examples"] == b["progress"]["examples"]
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert torch.equal(a["data_rng"], b["data_rng"])


def test_resume_refuses_a_checkpoint_of_another_architecture(tmp_path: Path, text_file: Path) -> None:
    ckpt = str(tmp_path / "c.ckpt")
    train.train(text_args(tmp_path, text_file, "--steps", "2", "--no-eval", "--checkpoint", ckpt))
    other = text_args(tmp_path, text_file, "--steps", "4", "--no-eval", "--checkpoint", ckpt, "--resume", "--layers", "3")
    with pytest.raises(train.TrainError, match="use the same architecture flags"):
        train.train(other)


def test_train_without_a_horizon_is_a_clear_error(tmp_path: Path, text_file: Path) -> None:
    with pytest.raises(train.TrainError, match="--steps N and/or --minutes M"):
        train.train(text_args(tmp_path, text_file))


def test_mnist_training_records_data_and_eval_in_the_file(tmp_path: Path, mnist_dir: Path) -> None:
    out = tmp_path / "d.safetensors"
    args = parse(train, ["--task", "mnist", "--attention", "softmax", "--data", str(mnist_dir), "--preset", "tiny",
                         "--steps", "3", "--device", "cpu", "--no-progress", "--out", str(out)])
    assert train.run(args) == 0
    cfg, info = read_metadata(out)
    assert cfg.max_len == 784 and cfg.task == "mnist"
    assert info["data"]["train"].endswith("train-images-idx3-ubyte.gz")
    assert info["examples_seen"] == 3 * 8 and info["device"].startswith("cpu")
    assert info["eval"]["images"] == 6 and 0 < info["eval"]["bits_per_dim"] < 9
    assert read_safetensors_dtypes(out) == {"BF16"}  # stored in 16 bits, like the shipped files


def read_safetensors_dtypes(path: Path) -> set[str]:
    """Tensor dtypes as the file's own JSON header lists them."""
    raw = path.read_bytes()
    header = json.loads(raw[8: 8 + int.from_bytes(raw[:8], "little")])
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
        nats = sum(float(-torch.log_softmax(model(with_bos(p[None].long()))[0][0].double(), -1)
                         .gather(-1, p.long()[:, None]).sum()) for p in pieces)
    result = evaluate.evaluate_text(model, valid, batch_size=1)
    assert result["bytes"] == 21
    assert result["loss_nats_per_byte"] == pytest.approx(nats / 21, abs=1e-5)
    assert result["bits_per_byte"] == pytest.approx(nats / 21 / math.log(2), abs=1e-5)


def test_eval_store_writes_the_result_into_the_file_and_keeps_its_tensors(tmp_path: Path, mnist_dir: Path,
                                                                         capsys) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(attention="linear", task="mnist", d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=784)
    path = tmp_path / "s.safetensors"
    save_model(build_model(cfg), path, {"examples_seen": 7}, dtype=torch.bfloat16)
    before = load_file(path)
    args = ["--data", str(mnist_dir), "--device", "cpu", "--threads", "1", "--json", "--store"]
    assert evaluate.run(parse(evaluate, [str(path), *args])) == 0
    printed = json.loads(capsys.readouterr().out)[str(path)]
    _, info = read_metadata(path)
    assert info["examples_seen"] == 7 and info["eval"] == printed
    after = load_file(path)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert all(t.dtype == torch.bfloat16 for t in after.values())


def test_eval_cli_reports_a_missing_data_folder(tmp_path: Path, capsys) -> None:
    path = tmp_path / "f.safetensors"
    save_model(build_model(ModelConfig(task="mnist", d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=784)), path)
    assert evaluate.run(parse(evaluate, [str(path), "--data", str(tmp_path / "nope"), "--device", "cpu"])) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_pictures_draws_one_column_per_model(tmp_path: Path, mnist_dir: Path) -> None:
    from PIL import Image

    from training import pictures

    torch.manual_seed(0)
    model_path = tmp_path / "g.safetensors"
    save_model(build_model(ModelConfig(task="mnist", d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=784)), model_path)
    out = tmp_path / "p.png"
    args = parse(pictures, ["--models", str(model_path), str(model_path), "--data", str(mnist_dir), "--out", str(out),
                            "--digits", "2", "--scale", "1", "--device", "cpu"])
    assert pictures.run(args) == 0
    width, height = Image.open(out).size
    assert width == 4 * (28 + pictures.GAP) + pictures.GAP  # original, occluded, two models
    assert height == pictures.LABEL_HEIGHT + 2 * (28 + pictures.GAP) + pictures.GAP


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
