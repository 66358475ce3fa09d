"""Safetensors weights: exact round trips, and one clear error per bad file.

Every bad file is written for real with safetensors into tmp_path; the error
must be a WeightsError whose message names the file and what is wrong.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from model.io.weights import CONFIG_KEY, INFO_KEY, WeightsError, load_model, read_metadata, save_model

from conftest import make_tiny_config, make_tiny_model, make_tokens

INFO = {
    "data": "mnist train 60k",
    "examples_seen": 1234,
    "wall_time_s": 5.5,
    "device": "cpu",
    "eval": {"bits_per_dim": 3.21},
}


def good_tensors_and_metadata(kind: str = "linear"):
    model = make_tiny_model(kind)
    tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    metadata = {CONFIG_KEY: model.config.to_json(), INFO_KEY: json.dumps(INFO)}
    return tensors, metadata


def write(path, tensors, metadata) -> str:
    save_file(tensors, str(path), metadata=metadata)
    return str(path)


def assert_weights_error(path, *phrases: str) -> WeightsError:
    with pytest.raises(WeightsError) as err:
        load_model(path)
    message = str(err.value)
    assert str(path) in message
    problem = message.replace(str(path), "").lower()  # the path itself may contain any word
    for phrase in phrases:
        assert phrase.lower() in problem, f"{phrase!r} not in {message!r}"
    return err.value


# ---------------------------------------------------------------- round trips


def test_save_then_load_is_bitwise_identical(kind, tmp_path):
    model = make_tiny_model(kind)
    path = tmp_path / f"{kind}.safetensors"
    save_model(model, path, info=INFO)
    loaded, info = load_model(path)
    assert loaded.config == model.config
    assert info == INFO
    original, restored = model.state_dict(), loaded.state_dict()
    assert sorted(original) == sorted(restored)
    for name, tensor in original.items():
        assert restored[name].dtype == tensor.dtype
        assert torch.equal(restored[name], tensor), name
    assert not loaded.training  # loaded models are ready for inference
    tokens = make_tokens(0, 2, 30)
    with torch.no_grad():
        assert torch.equal(loaded(tokens)[0], model(tokens)[0])


def test_read_metadata_gives_config_and_info_without_tensors(tmp_path):
    cfg = make_tiny_config("linformer", linformer_sharing="kv", task="mnist", max_len=784, extra={"note": "x"})
    path = tmp_path / "m.safetensors"
    save_model(
        make_tiny_model("linformer", linformer_sharing="kv", task="mnist", max_len=784, extra={"note": "x"}),
        path,
        info=INFO,
    )
    assert read_metadata(path) == (cfg, INFO)


def test_missing_info_reads_as_empty_dict(tmp_path):
    path = tmp_path / "m.safetensors"
    save_model(make_tiny_model("softmax"), path)
    assert read_metadata(path)[1] == {}


def test_bfloat16_file_loads_into_float32(tmp_path):
    model = make_tiny_model("softmax")
    path = tmp_path / "bf16.safetensors"
    save_model(model, path, dtype=torch.bfloat16)
    assert path.stat().st_size < 0.6 * _float32_size(model, tmp_path)  # really stored as 2-byte values
    loaded, _ = load_model(path, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.dtype == torch.float32
        assert torch.equal(got, tensor.to(torch.bfloat16).float()), name
    as_bf16, _ = load_model(path, dtype=torch.bfloat16)
    assert as_bf16.head.weight.dtype == torch.bfloat16


def _float32_size(model, tmp_path) -> int:
    path = tmp_path / "fp32.safetensors"
    save_model(model, path)
    return path.stat().st_size


def test_save_leaves_no_temporary_file(tmp_path):
    save_model(make_tiny_model("linear"), tmp_path / "m.safetensors")
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_a_saved_file_is_shared_as_the_umask_allows_and_its_folder_is_made(tmp_path):
    old = os.umask(0o027)  # this test's own process-wide setting, put back below
    try:
        path = tmp_path / "new" / "folder" / "m.safetensors"
        save_model(make_tiny_model("linear"), path)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640  # not safetensors' owner-only 0600


# ---------------------------------------------------------------- bad files


def test_missing_file(tmp_path):
    assert_weights_error(tmp_path / "nope.safetensors", "no such file")


def test_random_bytes_are_not_safetensors(tmp_path):
    path = tmp_path / "random.safetensors"
    path.write_bytes(
        torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).to(torch.uint8).numpy().tobytes()
    )
    assert_weights_error(path, "not a valid safetensors file")


def test_text_file_is_not_safetensors(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("these are not weights\n" * 50)
    assert_weights_error(path, "not a valid safetensors file")


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_file(tmp_path, keep):
    tensors, metadata = good_tensors_and_metadata()
    whole = tmp_path / "whole.safetensors"
    write(whole, tensors, metadata)
    data = whole.read_bytes()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(data[: int(len(data) * keep)])  # the header survives, tensor data is cut
    assert_weights_error(path, "truncated")


def test_missing_tensor(tmp_path):
    tensors, metadata = good_tensors_and_metadata()
    del tensors["head.weight"]
    assert_weights_error(write(tmp_path / "m.safetensors", tensors, metadata), "missing", "head.weight")


def test_extra_tensor(tmp_path):
    tensors, metadata = good_tensors_and_metadata()
    tensors["blocks.0.attn.surprise"] = torch.zeros(3)
    assert_weights_error(write(tmp_path / "m.safetensors", tensors, metadata), "unexpected", "blocks.0.attn.surprise")


def test_wrong_shape(tmp_path):
    tensors, metadata = good_tensors_and_metadata()
    tensors["head.weight"] = torch.zeros(256, 16)
    error = assert_weights_error(write(tmp_path / "m.safetensors", tensors, metadata), "head.weight", "shape")
    assert "(256, 16)" in str(error) and "(256, 32)" in str(error)


def test_integer_tensor(tmp_path):
    tensors, metadata = good_tensors_and_metadata()
    tensors["head.bias"] = torch.zeros(256, dtype=torch.int32)
    assert_weights_error(write(tmp_path / "m.safetensors", tensors, metadata), "head.bias", "dtype", "int32")


def test_unknown_attention_kind(tmp_path):
    tensors, metadata = good_tensors_and_metadata()
    config = json.loads(metadata[CONFIG_KEY])
    config["attention"] = "performer"
    metadata[CONFIG_KEY] = json.dumps(config)
    assert_weights_error(write(tmp_path / "m.safetensors", tensors, metadata), "performer", "attention")


def test_no_config_metadata(tmp_path):
    tensors, metadata = good_tensors_and_metadata()
    del metadata[CONFIG_KEY]
    assert_weights_error(write(tmp_path / "m.safetensors", tensors, metadata), CONFIG_KEY)


def test_no_metadata_at_all(tmp_path):
    tensors, _ = good_tensors_and_metadata()
    assert_weights_error(write(tmp_path / "m.safetensors", tensors, None), CONFIG_KEY)


def test_config_that_is_not_json(tmp_path):
    tensors, metadata = good_tensors_and_metadata()
    metadata[CONFIG_KEY] = "{attention: linear"
    assert_weights_error(write(tmp_path / "m.safetensors", tensors, metadata), "config", "json")


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_non_finite_values(tmp_path, bad_value):
    tensors, metadata = good_tensors_and_metadata()
    tensors["blocks.1.ff.up.weight"][3, 5] = bad_value
    assert_weights_error(write(tmp_path / "m.safetensors", tensors, metadata), "blocks.1.ff.up.weight", "non-finite")


def test_read_metadata_reports_bad_files_too(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("not weights")
    with pytest.raises(WeightsError, match="not a valid safetensors file") as err:
        read_metadata(path)
    assert str(path) in str(err.value)
