"""Bad input gets one clear 4xx in OpenAI's shape, and the server keeps serving on the same connection."""

from __future__ import annotations

import json

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


@pytest.mark.parametrize(
    "body", ['{"prompt":"a\\ud800"}', '{"prompt":"ok","stop":"\\udc00"}', '{"prompt":["x","\\ud83d"]}']
)
def test_a_lone_surrogate_is_a_400_and_the_connection_lives_on(client, body):
    for _ in range(5):
        error = error_of(
            client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400
        )
        assert "surrogate" in error["message"] and error["param"] in ("prompt", "stop")
        still_serving(client)


def test_malformed_json_says_where(client):
    error = error_of(
        client.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}), 400
    )
    assert error["message"].startswith("the body is not valid JSON") and "at character" in error["message"]
    still_serving(client)


@pytest.mark.parametrize("headers", [{}, {"content-type": "text/plain"}, {"content-type": "application/jsonx"}])
def test_a_body_without_the_json_content_type_is_a_415_naming_it(client, headers):
    error = error_of(client.post("/v1/completions", content=b'{"prompt": "a"}', headers=headers), 415)
    assert "Content-Type: application/json" in error["message"]


@pytest.mark.parametrize(
    "headers",
    [{}, {"content-type": "text/plain"}, {"content-type": "application/jsonx"}, {"content-type": "multipart/form"}],
)
def test_an_image_body_of_another_content_type_is_a_415_naming_the_ones_read(client, headers):
    body = b'{"model": "digits", "pixels": [[0]], "keep_rows": 0}'  # read as JSON, it would be answered
    error = error_of(client.post("/v1/images/completions", content=body, headers=headers), 415)
    assert "application/json" in error["message"] and "multipart/form-data" in error["message"]
    still_serving(client)


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON", "application/x+json"])
def test_json_content_types_with_parameters_case_or_a_json_suffix_are_read(client, content_type):
    body = b'{"model": "words", "prompt": "a", "max_tokens": 2}'
    answer = client.post("/v1/completions", content=body, headers={"content-type": content_type})
    assert answer.status_code == 200, answer.text
    image = json.dumps({"model": "digits", "pixels": GRID, "keep_rows": 27}).encode()
    answer = client.post("/v1/images/completions", content=image, headers={"content-type": content_type})
    assert answer.status_code == 200, answer.text


def test_per_pixel_errors_fold_into_one_short_message(client):
    grid = [[0.5] * 28 for _ in range(28)]
    response = client.post("/v1/images/completions", json={"model": "digits", "pixels": grid, "keep_rows": 3})
    error = error_of(response, 400)
    assert error["param"] == "pixels" and len(response.content) < 1000
    assert "pixels[0][0]" in error["message"] and "and 781 more errors in pixels" in error["message"]


def test_messages_name_their_field_without_pydantic_prefixes(client):
    error = error_of(client.post("/v1/images/completions", json={"model": "digits", "keep_rows": 2}), 400)
    assert error["param"] == "image" and not error["message"].startswith(("body", "Value error"))
    both = client.post(
        "/v1/images/completions",
        json={"model": "digits", "pixels": [[0] * 28] * 28, "keep_rows": 2, "mask": [[1] * 28] * 28},
    )
    error = error_of(both, 400)
    assert error["param"] == "keep_rows" and error["code"] == "invalid_value"


JSON = {"content-type": "application/json"}
GRID = [[0] * 28 for _ in range(28)]


@pytest.mark.parametrize(
    "path, body, content_type, where",
    [
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', "application/json", "byte 0xff at offset 12"),
        (
            "/v1/completions",
            '{"prompt": "caf\xe9"}'.encode("latin-1"),
            "application/json; charset=latin-1",
            "byte 0xe9 at offset 15",
        ),
        ("/v1/images/completions", b'{"model": "\xff"}', "application/json", "byte 0xff at offset 11"),
    ],
)
def test_a_body_that_is_not_utf8_says_where_and_that_json_is_utf8(client, path, body, content_type, where):
    error = error_of(client.post(path, content=body, headers={"content-type": content_type}), 400)
    assert error["message"].startswith(f"the body is not UTF-8: {where} (")
    assert error["message"].endswith("JSON bodies must be UTF-8 encoded")
    assert error["param"] is None and error["code"] == "invalid_json"
    still_serving(client)


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/v1/images/completions"])
@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_a_json_body_in_utf16_or_utf32_is_a_400_saying_json_is_utf8(client, path, encoding):
    """Python's JSON parser reads UTF-16 and UTF-32 too; JSON on the wire is UTF-8 (RFC 8259), as OpenAI's is."""
    body = '{"model": "words", "prompt": "to be", "max_tokens": 2}'.encode(encoding)
    error = error_of(client.post(path, content=body, headers={"content-type": "application/json"}), 400)
    assert error["code"] == "invalid_json" and error["message"].endswith("JSON bodies must be UTF-8 encoded"), error
    still_serving(client)


@pytest.mark.parametrize("path, limit", [("/v1/completions", ""), ("/v1/images/completions", " (200 levels)")])
def test_a_body_nested_too_deeply_says_so(client, path, limit):
    error = error_of(client.post(path, content=b'{"prompt": ' + b"[" * 100_000, headers=JSON), 400)
    assert error["message"] == (
        f"the body nests arrays or objects deeper than the JSON parser allows{limit}; a request nests at most 3"
    )
    assert error["param"] is None and error["code"] == "invalid_json"
    still_serving(client)


VALID = {
    "/v1/completions": '"model": "words", "prompt": "a"',
    "/v1/images/completions": f'"model": "digits", "pixels": {GRID}, "keep_rows": 3',
}


@pytest.mark.parametrize(
    "path, field, where, shown",
    [
        ("/v1/completions", '"temperature": NaN', "temperature", "NaN"),
        ("/v1/completions", '"top_p": Infinity', "top_p", "Infinity"),
        ("/v1/completions", '"presence_penalty": -Infinity', "presence_penalty", "-Infinity"),
        ("/v1/completions", '"logit_bias": {"3": NaN}', "logit_bias.3", "NaN"),
        ("/v1/images/completions", '"temperature": NaN', "temperature", "NaN"),
    ],
)
def test_nan_and_infinity_are_refused_as_not_finite_naming_the_field(client, path, field, where, shown):
    error = error_of(client.post(path, content="{%s, %s}" % (VALID[path], field), headers=JSON), 400)
    assert error["message"] == f"{where} must be a finite number, got {shown}"
    assert error["param"] == where.split(".")[0]
    still_serving(client)


def test_null_means_the_default_for_openais_nullable_options(client):
    nulls = dict.fromkeys(
        [
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "n",
            "logprobs",
            "seed",
            "stop",
            "echo",
            "stream",
            "frequency_penalty",
            "presence_penalty",
            "logit_bias",
            "best_of",
        ]
    )
    response = client.post("/v1/completions", json={"prompt": "a", **nulls})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16 and len(response.json()["choices"]) == 1
    image = client.post(
        "/v1/images/completions", json={"model": "digits", "pixels": GRID, "keep_rows": 27, "n": None, "stream": None}
    )
    assert image.status_code == 200 and len(image.json()["data"]) == 1
    documented = client.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"type": "null"} in documented["max_tokens"]["anyOf"] and documented["max_tokens"]["default"] == 16


def test_pixels_without_a_mask_are_told_how_pixels_requests_mark_unknowns(client):
    error = error_of(client.post("/v1/images/completions", json={"model": "digits", "pixels": GRID}), 400)
    assert error["param"] == "pixels" and "alpha" not in error["message"]
    assert error["message"].startswith(
        "pixels marks no unknown pixel, so there is nothing to complete; "
        "with `pixels`, mark unknown pixels with a `mask` (28x28 lists: 1 = unknown"
    )
    assert "or `keep_rows` < 28" in error["message"]
    still_serving(client)


@pytest.mark.parametrize(
    "path, example", [("/v1/completions", '{"prompt": '), ("/v1/images/completions", '{"image": ')]
)
@pytest.mark.parametrize("body", [b"", b"  \n"])
def test_an_empty_body_asks_for_a_json_object(client, path, example, body):
    error = error_of(client.post(path, content=body, headers=JSON), 400)
    assert error["message"].startswith(f"the request body is empty; send a JSON object such as {example}")
    assert error["param"] is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/images/completions"])
@pytest.mark.parametrize(
    "body, kind", [(b"[1, 2]", "an array"), (b'"hi"', "a string"), (b"null", "null"), (b"7", "a number")]
)
def test_a_body_that_is_no_json_object_says_what_it_is(client, path, body, kind):
    error = error_of(client.post(path, content=body, headers=JSON), 400)
    assert error["message"] == f"the body must be a JSON object of the request's fields, got {kind}"
    assert error["param"] is None and error["code"] == "invalid_json"
    still_serving(client)


DIGIT = {"model": "digits", "pixels": [[0] * 28] * 28, "keep_rows": 27, "seed": 1}
WORDS = {"model": "words", "prompt": "a", "max_tokens": 2}


@pytest.mark.parametrize(
    "path, body, accept, offered",
    [
        ("/v1/images/completions", DIGIT, "image/jpeg", "application/json or image/png"),
        ("/v1/images/completions", DIGIT | {"stream": True}, "image/png", "text/event-stream or application/json"),
        ("/v1/completions", WORDS, "text/html", "application/json"),
        ("/v1/completions", WORDS, "application/json;q=0, text/plain", "application/json"),
        ("/v1/completions", WORDS | {"stream": True}, "text/html", "text/event-stream or application/json"),
    ],
)
def test_an_accept_header_that_allows_no_answer_is_a_406_listing_what_can_be_sent(client, path, body, accept, offered):
    error = error_of(client.post(path, json=body, headers={"accept": accept}), 406)
    assert offered in error["message"] and f"Accept: {accept}" in error["message"]
    assert error["code"] == "not_acceptable" and error["type"] == "invalid_request_error"
    still_serving(client)


@pytest.mark.parametrize(
    "path, body, accept, answered",
    [
        ("/v1/images/completions", DIGIT, "image/*", "image/png"),
        ("/v1/images/completions", DIGIT, "application/json, image/png;q=0.5", "image/png"),  # named: the strip
        ("/v1/images/completions", DIGIT, "text/html, */*;q=0.8", "application/json"),  # a browser's
        ("/v1/completions", WORDS | {"stream": True}, "application/json", "text/event-stream"),  # OpenAI's clients
        ("/v1/completions", WORDS, "", "application/json"),
    ],
)
def test_accept_headers_that_allow_an_answer_get_it(client, path, body, accept, answered):
    response = client.post(path, json=body, headers={"accept": accept})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith(answered)


@pytest.mark.parametrize("stop", [5, {"a": 1}, ["a", 3], True])
def test_a_stop_of_the_wrong_type_gets_one_message_saying_what_it_takes(client, stop):
    error = error_of(client.post("/v1/completions", json={"prompt": "a", "stop": stop}), 400)
    assert error["message"].startswith("stop must be a string or a list of up to 4 strings, got ")
    assert error["param"] == "stop" and error["code"] == "invalid_value"
    still_serving(client)


def test_a_mask_of_booleans_reads_as_0_1_and_a_mask_of_another_type_says_what_it_takes(client):
    unknown_below = [[int(r >= 20)] * 28 for r in range(28)]
    answers = [
        client.post("/v1/images/completions", json={**DIGIT, "keep_rows": None, "mask": mask})
        for mask in (unknown_below, [[bool(v) for v in row] for row in unknown_below])
    ]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    assert answers[0].json()["data"][0]["pixels"] == answers[1].json()["data"][0]["pixels"]
    for mask in (5, {"rows": 28}, [1, 0]):
        error = error_of(client.post("/v1/images/completions", json={**DIGIT, "keep_rows": None, "mask": mask}), 400)
        assert error["message"].startswith(
            "mask must be a base64 PNG string or 28 rows of 28 values 0/1 or false/true, got "
        )
        assert error["param"] == "mask"
    still_serving(client)


def test_a_prompt_too_long_by_itself_is_blamed_and_otherwise_max_tokens_is(client):
    long_prompt = error_of(client.post("/v1/completions", json={"prompt": "a" * 500, "max_tokens": 1}), 400)
    assert long_prompt["param"] == "prompt" and long_prompt["code"] == "context_length_exceeded"
    too_many = error_of(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 500}), 400)
    assert too_many["param"] == "max_tokens" and too_many["code"] == "context_length_exceeded"
    still_serving(client)


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", '{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}", "max_tokens"),
        ("/v1/images/completions", '{"keep_rows": ' + "9" * 5000 + ', "pixels": [[0]]}', "keep_rows"),
        ("/v1/images/completions", '{"keep_rows": 3, "pixels": [[0, ' + "9" * 5000 + "]]}", "pixels"),
    ],
)
def test_an_integer_of_thousands_of_digits_gets_a_400_naming_the_field(client, path, body, field):
    error = error_of(client.post(path, content=body, headers={"content-type": "application/json"}), 400)
    assert error["code"] == "invalid_json" and error["param"] == field, error
    assert error["message"].startswith(f"{field}: integer too large (5000 digits, the most read is "), error
    still_serving(client)


def png_file() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (28, 28)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_multipart_body_with_a_bad_boundary_gets_a_400_with_a_code(client):
    body = b'--wrong\r\nContent-Disposition: form-data; name="image"; filename="d.png"\r\n\r\n' + png_file()
    answer = client.post(
        "/v1/images/completions", content=body, headers={"content-type": "multipart/form-data; boundary=right"}
    )
    error = error_of(answer, 400)
    assert error["code"] == "invalid_multipart" and "boundary" in error["message"], error
    still_serving(client)


def test_a_multipart_body_with_two_image_files_is_refused_not_read_silently(client):
    answer = client.post(
        "/v1/images/completions",
        data={"keep_rows": "14", "model": "digits"},
        files=[("image", ("a.png", png_file(), "image/png")), ("image", ("b.png", png_file(), "image/png"))],
    )
    error = error_of(answer, 400)
    assert error["param"] == "image" and "2 `image` parts" in error["message"], error
    still_serving(client)


def test_an_unknown_route_and_a_wrong_method_get_codes(client):
    assert error_of(client.get("/v1/nothing"), 404)["code"] == "not_found"
    assert error_of(client.get("/v1/completions"), 405)["code"] == "method_not_allowed"
