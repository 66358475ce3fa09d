"""Settings, /v1/models, /health, /metrics, API key, body limit and the error shape, over real HTTP."""

from __future__ import annotations

import argparse
import gc
import re
import time
from pathlib import Path

import httpx
import pytest
import torch

from model.io.weights import WeightsError
from server.engine.registry import check_model_files
from server.serve import add_arguments, settings_from_args
from server.settings import SettingsError, build_settings
from server_support import make_settings, metric_value, running_server, save_tiny_model

REPO = Path(__file__).resolve().parents[1]

METRIC_NAMES = (
    "rnnserve_generated_tokens_total",
    "rnnserve_completed_images_total",
    "rnnserve_requests_total",
    "rnnserve_time_to_first_token_seconds",
    "rnnserve_inter_token_latency_seconds",
    "rnnserve_request_latency_seconds",
    "rnnserve_running_sequences",
    "rnnserve_waiting_sequences",
    "rnnserve_batch_size",
    "rnnserve_decode_steps_total",
    "rnnserve_tokens_per_second",
    "rnnserve_images_per_second",
    "rnnserve_decode_state_in_use_bytes",
    "rnnserve_particle_resamplings_total",
    "rnnserve_decode_step_seconds",
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in (
        "HOST",
        "PORT",
        "WEIGHTS",
        "MODELS",
        "DEVICE",
        "DTYPE",
        "CUDA_GRAPHS",
        "MAX_BATCH",
        "MAX_WAITING",
        "MAX_BODY_BYTES",
        "API_KEY",
        "LOG_LEVEL",
    ):
        monkeypatch.delenv(f"RNNSERVE_{name}", raising=False)
    return monkeypatch


# -- settings -------------------------------------------------------------------


def test_settings_defaults(clean_env):
    s = build_settings()
    assert (s.host, s.port, str(s.weights), s.device) == ("127.0.0.1", 8000, "weights", "auto")
    assert (s.max_batch, s.max_waiting, s.api_key, s.models) == (64, 256, None, [])
    assert s.cuda_graphs is True and s.compile_decode is True
    assert s.prefix_cache_memory == 256 * 1024 * 1024  # the prefix cache is on, within 256 MiB per engine


def test_flags_override_env_over_defaults(clean_env):
    clean_env.setenv("RNNSERVE_PORT", "9001")
    clean_env.setenv("RNNSERVE_API_KEY", "k")
    clean_env.setenv("RNNSERVE_MODELS", '["a.safetensors", "b.safetensors"]')
    assert build_settings().port == 9001 and build_settings().api_key_value() == "k"
    assert [str(p) for p in build_settings().models] == ["a.safetensors", "b.safetensors"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--port", "9002", "--model", "x.safetensors", "--model", "y.safetensors", "--max-batch", "4"]
    )
    s = settings_from_args(args)
    assert (s.port, s.max_batch, [str(p) for p in s.models]) == (9002, 4, ["x.safetensors", "y.safetensors"])
    clean_env.setenv("RNNSERVE_CUDA_GRAPHS", "false")
    assert settings_from_args(parser.parse_args([])).cuda_graphs is False
    assert settings_from_args(parser.parse_args(["--cuda-graphs"])).cuda_graphs is True
    clean_env.setenv("RNNSERVE_COMPILE_DECODE", "false")
    assert settings_from_args(parser.parse_args([])).compile_decode is False
    assert settings_from_args(parser.parse_args(["--compile-decode"])).compile_decode is True
    clean_env.setenv("RNNSERVE_PREFIX_CACHE_MEMORY", "2MiB")
    assert settings_from_args(parser.parse_args([])).prefix_cache_memory == 2 * 1024 * 1024
    assert settings_from_args(parser.parse_args(["--prefix-cache-memory", "0"])).prefix_cache_memory == 0
    assert settings_from_args(parser.parse_args(["--prefix-cache-memory", "1.5kB"])).prefix_cache_memory == 1500


def test_bad_settings_name_the_flag(clean_env):
    with pytest.raises(
        SettingsError, match="--max-batch / RNNSERVE_MAX_BATCH: Input should be greater than or equal to 1"
    ):
        build_settings(max_batch=0)
    clean_env.setenv("RNNSERVE_PORT", "http")
    with pytest.raises(SettingsError, match="--port .*'http'"):
        build_settings()


def test_model_paths_explain_what_is_missing(tmp_path):
    with pytest.raises(SettingsError, match="has no .safetensors files"):
        make_settings(weights=tmp_path).model_paths()
    with pytest.raises(SettingsError, match="does not exist"):
        make_settings(weights=tmp_path / "nope").model_paths()
    with pytest.raises(SettingsError, match="--model file not found: .*missing.safetensors"):
        make_settings(models=[tmp_path / "missing.safetensors"]).model_paths()


def test_bad_and_duplicate_weight_files(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = save_tiny_model(tmp_path / "a", "m", "linear", "text")
    second = save_tiny_model(tmp_path / "b", "m", "linear", "text")
    with pytest.raises(SettingsError, match="both named 'm'"):
        check_model_files(make_settings(models=[first, second]))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not weights")
    with pytest.raises(WeightsError, match="junk.safetensors: not a valid safetensors file"):
        check_model_files(make_settings(models=[junk]))
    untokenized = save_tiny_model(tmp_path, "wide", "linear", "text", vocab_size=1000)
    with pytest.raises(SettingsError, match=r"wide.safetensors: a text model with a 1000-token vocabulary but no tok"):
        check_model_files(make_settings(models=[untokenized]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when no GPU is present")
def test_cuda_without_gpu_is_a_clear_error():
    assert make_settings(device="auto").torch_device() == "cpu"
    with pytest.raises(SettingsError, match="no CUDA GPU is available"):
        make_settings(device="cuda").torch_device()


# -- models, health, metrics, errors ----------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("misc_weights")
    save_tiny_model(
        folder,
        "linear-text",
        "linear",
        "text",
        info={"eval": {"bits_per_byte": 3.5, "data": "../shared/data/text/valid.txt"}, "steps": 10},
    )
    save_tiny_model(folder, "softmax-text", "softmax", "text")
    save_tiny_model(folder, "linear-mnist", "linear", "mnist")
    with running_server(make_settings(weights=folder, max_batch=4, max_waiting=4)) as (url, _app):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


def test_models_list_shape(server):
    body = server.get("/v1/models").json()
    assert body["object"] == "list"
    by_id = {m["id"]: m for m in body["data"]}
    assert set(by_id) == {"linear-text", "softmax-text", "linear-mnist"}
    linear, softmax = by_id["linear-text"], by_id["softmax-text"]
    assert linear["object"] == "model" and linear["owned_by"] == "rnnserve" and linear["created"] > 0
    assert (linear["task"], linear["attention"], linear["max_len"]) == ("text", "linear", 64)
    assert by_id["linear-mnist"]["task"] == "mnist" and by_id["linear-mnist"]["max_len"] == 784
    # the evaluation's data by file name: the stored path was the evaluating machine's
    assert linear["parameters"] > 0 and linear["metrics"] == {"bits_per_byte": 3.5, "data": "valid.txt"}
    # a softmax cache grows to max_len; the linear state does not
    assert 0 < linear["state_bytes_per_sequence"] < softmax["state_bytes_per_sequence"]
    assert server.get("/v1/models/softmax-text").json() == softmax


def test_unknown_model_id_lists_loaded(server):
    response = server.get("/v1/models/nope")
    assert response.status_code == 404
    assert (
        response.json()["error"]["code"] == "model_not_found" and "linear-text" in response.json()["error"]["message"]
    )


def test_health_ready(server):
    response = server.get("/health")
    assert response.status_code == 200 and response.json()["models"]["linear-mnist"] == "ready"


def test_metrics_exports_every_name_and_moves(server):
    text = server.get("/metrics").text
    labels = {"model": "linear-text", "attention": "linear"}
    before = {
        name: metric_value(text, name, **labels)
        for name in (
            "rnnserve_generated_tokens_total",
            "rnnserve_decode_steps_total",
            "rnnserve_request_latency_seconds_count",
            "rnnserve_decode_step_seconds_count",
            "rnnserve_decode_step_seconds_sum",
            "rnnserve_request_latency_seconds_sum",
        )
    }
    ok_before = metric_value(text, "rnnserve_requests_total", endpoint="/v1/completions", outcome="ok")
    bad_before = metric_value(text, "rnnserve_requests_total", endpoint="/v1/completions", outcome="invalid")
    ok_model_before = metric_value(text, "rnnserve_requests_total", endpoint="/v1/completions", outcome="ok", **labels)
    assert (
        server.post("/v1/completions", json={"model": "linear-text", "prompt": "a", "max_tokens": 5}).status_code == 200
    )
    assert server.post("/v1/completions", json={"model": "linear-text", "n": 0}).status_code == 400
    response = server.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = response.text
    for name in METRIC_NAMES:  # after traffic: the request counter has no series before its first request
        assert f"\n{name}" in after, name
    assert (
        metric_value(after, "rnnserve_generated_tokens_total", **labels)
        == before["rnnserve_generated_tokens_total"] + 5
    )
    assert metric_value(after, "rnnserve_decode_steps_total", **labels) >= before["rnnserve_decode_steps_total"] + 5
    assert (
        metric_value(after, "rnnserve_request_latency_seconds_count", **labels)
        == before["rnnserve_request_latency_seconds_count"] + 1
    )
    # every step is timed once, and the steps of one request fit inside its latency
    steps = metric_value(after, "rnnserve_decode_steps_total", **labels) - before["rnnserve_decode_steps_total"]
    assert (
        metric_value(after, "rnnserve_decode_step_seconds_count", **labels)
        - before["rnnserve_decode_step_seconds_count"]
        == steps
    )
    step_seconds = (
        metric_value(after, "rnnserve_decode_step_seconds_sum", **labels) - before["rnnserve_decode_step_seconds_sum"]
    )
    latency = (
        metric_value(after, "rnnserve_request_latency_seconds_sum", **labels)
        - before["rnnserve_request_latency_seconds_sum"]
    )
    assert 0 < step_seconds <= latency
    assert metric_value(after, "rnnserve_requests_total", endpoint="/v1/completions", outcome="ok") == ok_before + 1
    assert (
        metric_value(after, "rnnserve_requests_total", endpoint="/v1/completions", outcome="invalid") == bad_before + 1
    )
    # both requests named a loaded model: the refused one is labelled by it too
    assert (
        metric_value(after, "rnnserve_requests_total", endpoint="/v1/completions", outcome="ok", **labels)
        == ok_model_before + 1
    )
    assert metric_value(after, "rnnserve_requests_total", endpoint="/v1/completions", outcome="invalid", **labels) >= 1
    assert server.post("/v1/completions", json={"model": "no-such-model", "n": 0}).status_code == 400
    unknown = metric_value(
        server.get("/metrics").text,
        "rnnserve_requests_total",
        endpoint="/v1/completions",
        outcome="invalid",
        model="none",
    )
    assert unknown >= 1  # a model that is not loaded is no label value: cardinality stays bounded
    assert metric_value(after, "rnnserve_running_sequences", **labels) == 0


def test_every_step_of_a_whole_image_is_counted_when_its_answer_arrives(server):
    """An engine process sends nothing for a pass without answers (a whole image's steps before its last): the
    figures it holds back go with the answer, so none is missing from /metrics once the answer is in."""
    labels = {"model": "linear-mnist", "attention": "linear"}
    names = ("rnnserve_generated_tokens_total", "rnnserve_decode_steps_total", "rnnserve_decode_step_seconds_count")
    before = server.get("/metrics").text
    digit = [[255 * ((x + y) % 2) for x in range(28)] for y in range(28)]
    response = server.post("/v1/images/completions", json={"model": "linear-mnist", "pixels": digit, "keep_rows": 14})
    assert response.status_code == 200
    after = server.get("/metrics").text
    moved = {name: metric_value(after, name, **labels) - metric_value(before, name, **labels) for name in names}
    assert moved["rnnserve_generated_tokens_total"] == 14 * 28  # the unknown rows, in passes of several steps
    assert moved["rnnserve_decode_step_seconds_count"] == moved["rnnserve_decode_steps_total"] >= 14 * 28 - 1


def test_a_406_counts_under_the_model_it_names(server):
    def not_acceptable() -> float:
        return metric_value(
            server.get("/metrics").text,
            "rnnserve_requests_total",
            endpoint="/v1/completions",
            outcome="invalid",
            model="linear-text",
        )

    before = not_acceptable()
    response = server.post(
        "/v1/completions",
        json={"model": "linear-text", "prompt": "a", "max_tokens": 2},
        headers={"accept": "image/png"},
    )
    assert response.status_code == 406, response.text
    assert not_acceptable() == before + 1


def test_unknown_route_and_method_use_the_error_shape(server):
    response = server.get("/v2/nothing")
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["type"] == "not_found_error"
    response = server.get("/v1/completions")
    assert response.status_code == 405 and "GET" in response.json()["error"]["message"]
    text = server.get("/metrics").text
    assert metric_value(text, "rnnserve_requests_total", endpoint="other", outcome="not_found") >= 1


def test_validation_error_shape(server):
    response = server.post("/v1/completions", json={"model": "linear-text", "max_tokens": "many"})
    error = response.json()["error"]
    assert response.status_code == 400
    assert error == {
        "message": error["message"],
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": "invalid_value",
    }
    assert "max_tokens: Input should be a valid integer" in error["message"] and "'many'" in error["message"]


def test_health_503_names_a_model_that_is_not_ready(tmp_path):
    save_tiny_model(tmp_path, "one", "linear", "text")
    save_tiny_model(tmp_path, "two", "softmax", "text")
    with running_server(make_settings(weights=tmp_path)) as (url, app):
        assert httpx.get(f"{url}/health").status_code == 200
        app.state.server.engines.engines["two"].stop()
        response = httpx.get(f"{url}/health")
        assert response.status_code == 503
        assert response.json()["error"]["message"] == "models not ready: two"
        refused = httpx.post(f"{url}/v1/completions", json={"model": "two", "prompt": "a"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
        assert httpx.post(f"{url}/v1/completions", json={"model": "one", "prompt": "a"}).status_code == 200


# -- API key and body limit -------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guarded_weights")
    save_tiny_model(folder, "linear-text", "linear", "text")
    with running_server(make_settings(weights=folder, api_key="s3cret", max_body_bytes=2048)) as (url, _app):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


KEY = {"authorization": "Bearer s3cret"}


def test_api_key_required_except_health_and_metrics(guarded):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
        response = guarded.get("/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        assert "Authorization: Bearer" in response.json()["error"]["message"]
        assert response.headers["www-authenticate"] == "Bearer"
    assert guarded.post("/v1/completions", json={"n": "bad"}).status_code == 401  # key before validation
    assert guarded.get("/v1/models", headers=KEY).status_code == 200
    assert guarded.get("/v1/models", headers={"authorization": "bearer s3cret"}).status_code == 200  # scheme: any case
    assert guarded.post("/v1/completions", headers=KEY, json={"prompt": "a", "max_tokens": 2}).status_code == 200
    assert guarded.get("/health").status_code == 200
    assert guarded.get("/metrics").status_code == 200


def test_the_openapi_document_declares_the_bearer_key_on_exactly_the_routes_that_need_it(guarded):
    from server.api.middleware import is_open

    document = guarded.get("/openapi.json").json()
    assert document["components"]["securitySchemes"]["apiKey"] | {"description": ""} == {
        "type": "http",
        "scheme": "bearer",
        "description": "",
    }
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            expected = None if is_open(path) else [{"apiKey": []}]
            assert operation.get("security") == expected, f"{method.upper()} {path}"


def test_the_api_key_s_help_and_docs_name_exactly_the_open_routes():
    from server.api.middleware import OPEN_PATHS, OPEN_PREFIXES

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    [action] = [a for a in parser._actions if "--api-key" in a.option_strings]
    [row] = [
        line for line in (REPO / "docs" / "operations.md").read_text().splitlines() if line.startswith("| `--api-key")
    ]
    for text in (action.help, row):
        named = set(re.findall(r"(/[\w./{}-]*)", text))
        assert named == set(OPEN_PATHS) | set(OPEN_PREFIXES), text


def test_body_over_the_limit_is_413(guarded):
    response = guarded.post("/v1/completions", headers=KEY, json={"prompt": "a" * 5000})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "limit is 2048 bytes" in error["message"]

    def chunks():  # no Content-Length: the limit must hold while streaming in
        for _ in range(10):
            yield b" " * 500

    response = guarded.post("/v1/completions", headers={**KEY, "content-type": "application/json"}, content=chunks())
    assert response.status_code == 413 and "limit is 2048 bytes" in response.json()["error"]["message"]
    small = guarded.post("/v1/completions", headers=KEY, json={"prompt": "a" * 10, "max_tokens": 1})
    assert small.status_code == 200


def test_no_waiting_queue_still_serves_when_a_slot_is_free(tmp_path):
    save_tiny_model(tmp_path, "linear-text", "linear", "text")
    with running_server(make_settings(weights=tmp_path, max_batch=2, max_waiting=0)) as (url, _app):
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 4, "seed": 1}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["choices"][0]["text"].encode("utf-8", "surrogateescape")) >= 1


def test_start_up_objects_are_frozen_out_of_the_garbage_collectors_reach(tmp_path):
    # A full collection walks every tracked object with the GIL held, stalling the engine threads.
    save_tiny_model(tmp_path, "linear-text", "linear", "text")
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with running_server(make_settings(weights=tmp_path)) as (url, _app):
        deadline = time.monotonic() + 30
        while gc.get_freeze_count() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        frozen = gc.get_freeze_count()
        assert (
            httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 2}, timeout=30).status_code == 200
        )
    assert frozen > 10_000  # torch, the models and the app: everything start-up built


def test_counted_histogram_exposes_what_one_observe_per_value_would():
    """The engine records a step's shared inter-token gap once with a count; the scrape
    must read exactly as prometheus_client's own histogram fed every value one by one."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from server.metrics import LATENCY_BUCKETS, CountedHistogram

    ours_registry, reference_registry = CollectorRegistry(), CollectorRegistry()
    ours = CountedHistogram("x_seconds", "doc", ("model",), LATENCY_BUCKETS, ours_registry)
    reference = Histogram("x_seconds", "doc", ("model",), buckets=LATENCY_BUCKETS, registry=reference_registry)
    observations = [(0.004, 64), (0.0025, 3), (0.001, 1), (200.0, 2), (0.05, 0)]  # on a bound, past the last
    for value, count in observations:
        ours.observe(("m",), value, count)
        for _ in range(count):
            reference.labels("m").observe(value)

    def samples(registry):
        lines = generate_latest(registry).decode().splitlines()
        return sorted(line for line in lines if line.startswith("x_seconds") and "_created" not in line)

    assert samples(ours_registry) == samples(reference_registry)
    assert 'x_seconds_count{model="m"} 70.0' in samples(ours_registry)


def test_image_series_exist_for_image_models_only(server):
    """A text model has no images/s or completed-images series (they would read 0 forever)."""
    text = server.get("/metrics").text
    for name in ("rnnserve_images_per_second", "rnnserve_completed_images_total"):
        series = [line for line in text.splitlines() if line.startswith(name + "{")]
        assert any('model="linear-mnist"' in line for line in series), name
        assert not any('model="linear-text"' in line for line in series), name


def test_models_route_and_state_gauges_agree(server):
    """/v1/models' state_bytes_allocated is the allocated gauge; state_bytes_per_sequence x slots is that figure."""
    cards = {card["id"]: card for card in server.get("/v1/models").json()["data"]}
    text = server.get("/metrics").text
    for name, card in cards.items():
        labels = {"model": name, "attention": card["attention"]}
        allocated = metric_value(text, "rnnserve_decode_state_allocated_bytes", **labels)
        assert allocated == card["state_bytes_allocated"] > 0, name
        assert 0 <= metric_value(text, "rnnserve_decode_state_in_use_bytes", **labels) <= allocated
