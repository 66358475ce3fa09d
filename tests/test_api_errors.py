"""Bad input gets one clear 4xx in OpenAI's shape, and the server keeps serving on the same connection."""

from __future__ import annotations

import httpx
import pytest

from server_support import make_settings, running_server, save_tiny_model


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = tmp_path_factory.mktemp("error_weights")
    save_tiny_model(folder, "words", "linear", "text")
    save_tiny_model(folder, "digits", "linear", "mnist")
    with running_server(make_settings(weights=folder, max_batch=4, max_waiting=4)) as (url, _app):
        with httpx.Client(base_url=url, timeout=60) as http:  # one keep-alive connection for every request
            yield http


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def still_serving(client: httpx.Client) -> None:
    ok = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


@pytest.mark.parametrize("body", ['{"prompt":"a\\ud800"}', '{"prompt":"ok","stop":"\\udc00"}', '{"prompt":["x","\\ud83d"]}'])
def test_a_lone_surrogate_is_a_400_and_the_connection_lives_on(client, body):
    for _ in range(5):
        error = error_of(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
        assert "surrogate" in error["message"] and error["param"] in ("prompt", "stop")
        still_serving(client)


def test_malformed_json_says_where(client):
    error = error_of(client.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}), 400)
    assert error["message"].startswith("the body is not valid JSON") and "at character" in error["message"]
    still_serving(client)


@pytest.mark.parametrize("headers", [{}, {"content-type": "text/plain"}])
def test_a_body_without_the_json_content_type_is_a_415_naming_it(client, headers):
    error = error_of(client.post("/v1/completions", content=b'{"prompt": "a"}', headers=headers), 415)
    assert "Content-Type: application/json" in error["message"]


@pytest.mark.parametrize("headers", [{}, {"content-type": "text/plain"}])
def test_an_image_body_of_another_content_type_is_a_415_naming_the_ones_read(client, headers):
    error = error_of(client.post("/v1/images/completions", content=b'{"keep_rows": 3}', headers=headers), 415)
    assert "application/json" in error["message"] and "multipart/form-data" in error["message"]
    still_serving(client)


def test_per_pixel_errors_fold_into_one_short_message(client):
    grid = [[0.5] * 28 for _ in range(28)]
    response = client.post("/v1/images/completions", json={"model": "digits", "pixels": grid, "keep_rows": 3})
    error = error_of(response, 400)
    assert error["param"] == "pixels" and len(response.content) < 1000
    assert "pixels[0][0]" in error["message"] and "and 781 more errors in pixels" in error["message"]


def test_messages_name_their_field_without_pydantic_prefixes(client):
    error = error_of(client.post("/v1/images/completions", json={"model": "digits", "keep_rows": 2}), 400)
    assert error["param"] == "image" and not error["message"].startswith(("body", "Value error"))
    both = client.post("/v1/images/completions",
                       json={"model": "digits", "pixels": [[0] * 28] * 28, "keep_rows": 2, "mask": [[1] * 28] * 28})
    error = error_of(both, 400)
    assert error["param"] == "keep_rows" and error["code"] == "invalid_value"
