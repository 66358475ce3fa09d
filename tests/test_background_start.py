"""An app whose models start in the background (a Ray Serve replica's): it answers at once, 503 `starting`
until the engines run, then serves; a model that cannot start is reported, not waited on forever."""

from __future__ import annotations

import time

import httpx

from server_support import make_settings, running_server, save_tiny_model


def test_it_answers_503_starting_until_its_engines_run_then_serves(tmp_path):
    save_tiny_model(tmp_path, "words", "linear", "text")
    settings = make_settings(weights=tmp_path, engine_process=True)  # spawning the engine takes seconds
    with running_server(settings, background_start=True) as (url, _):
        first = httpx.get(f"{url}/health")
        early = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
        deadline = time.monotonic() + 120
        while (health := httpx.get(f"{url}/health")).status_code != 200 and time.monotonic() < deadline:
            assert health.json()["error"]["code"] == "starting"
            time.sleep(0.1)
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert first.status_code == 503 and first.json()["error"]["code"] == "starting", first.text
    assert first.headers["retry-after"] == "2"
    assert early.status_code == 503 and early.json()["error"]["code"] == "starting"
    assert health.status_code == 200
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


def test_a_model_that_cannot_start_is_reported_as_start_failed(tmp_path):
    (tmp_path / "broken.safetensors").write_bytes(b"\0" * 64)
    with running_server(make_settings(weights=tmp_path), background_start=True) as (url, app):
        deadline = time.monotonic() + 60
        while not hasattr(app.state, "start_failure") and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(f"{url}/health")
    error = health.json()["error"]
    assert health.status_code == 503 and error["code"] == "start_failed"
    assert "broken.safetensors" in error["message"]
