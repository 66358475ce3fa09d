"""POST /v1/images/completions over real HTTP, plus the PNG / mask decoding behind it."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from server.api import imaging
from server_support import make_settings, metric_value, running_server, save_tiny_model, sse_payloads

UNKNOWN_ROWS = 2  # the last rows: few pixels to generate keeps each request short


def digit(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (28, 28), dtype=np.uint8)


def png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def rgba_with_hole(grey: np.ndarray, hole: np.ndarray) -> bytes:
    """A colour PNG whose alpha is 0 exactly on `hole`."""
    rgba = np.stack([grey, grey, grey, np.where(hole, 0, 255).astype(np.uint8)], axis=-1)
    return png_bytes(rgba)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def tail_hole() -> np.ndarray:
    """Unknown: row 26 from column 5 on, and row 27 columns 0-9; known pixels follow the hole."""
    hole = np.zeros((28, 28), dtype=bool)
    hole[26, 5:] = True
    hole[27, :10] = True
    return hole


# -- decoding (no server) -------------------------------------------------------


def test_png_round_trip_and_alpha_marks_unknown():
    grey, hole = digit(1), tail_hole()
    decoded = imaging.decode_png(rgba_with_hole(grey, hole), "image")
    assert np.array_equal(decoded.grey, grey)
    assert np.array_equal(decoded.transparent, hole)
    assert imaging.decode_png(png_bytes(grey), "image").transparent is None


def test_16_bit_grey_is_scaled_not_clipped():
    grey16 = digit(9).astype(np.uint16) * 257
    assert np.array_equal(imaging.decode_png(png_bytes(grey16), "image").grey, digit(9))


def test_not_a_png_says_what_it_is():
    buf = io.BytesIO()
    Image.fromarray(digit()).save(buf, format="JPEG")
    with pytest.raises(imaging.ImageError, match="image is not a PNG \\(it is JPEG\\); expected a 28x28 PNG"):
        imaging.decode_png(buf.getvalue(), "image")
    with pytest.raises(imaging.ImageError, match="not a PNG \\(it is not an image\\)"):
        imaging.decode_png(b"hello", "image")


@pytest.mark.parametrize("cut", [20, 40, 60])
def test_truncated_png_is_called_damaged_without_naming_a_python_object(cut):
    with pytest.raises(imaging.ImageError, match="image is a damaged PNG .*expected a valid 28x28 PNG") as refused:
        imaging.decode_png(png_bytes(digit())[:cut], "image")
    assert "object at 0x" not in str(refused.value) and "BytesIO" not in str(refused.value)


def test_wrong_size_states_received_and_expected():
    with pytest.raises(imaging.ImageError, match="image is 27x30 pixels; expected 28x28"):
        imaging.decode_png(png_bytes(np.zeros((30, 27), dtype=np.uint8)), "image")


def test_grid_checks_shape_and_range():
    with pytest.raises(imaging.ImageError, match="27 rows .* expected 28 rows of 28"):
        imaging.grid_from_lists([[0] * 28] * 27, "pixels")
    bad = [[0] * 28 for _ in range(28)]
    bad[3][4] = 256
    with pytest.raises(imaging.ImageError, match=r"pixels\[3\]\[4\] is 256; expected values in 0..255"):
        imaging.grid_from_lists(bad, "pixels")
    with pytest.raises(imaging.ImageError, match="expected values in 0..1"):
        imaging.grid_from_lists([[2] * 28] * 28, "mask", 0, 1)


def test_grid_with_an_integer_too_large_for_numpy_is_a_range_error():
    huge = [[10**30] * 28 for _ in range(28)]
    with pytest.raises(imaging.ImageError, match="too large .* expected values in 0..255"):
        imaging.grid_from_lists(huge, "pixels")


def test_mask_with_no_unknown_pixel_is_refused():
    with pytest.raises(imaging.ImageError, match="marks no unknown pixel"):
        imaging.occlude(digit(), np.zeros((28, 28), dtype=bool), "mask")
    with pytest.raises(imaging.ImageError, match="image marks no unknown pixel"):
        imaging.occlude(digit(), None, "image")


def test_prompt_and_forced_follow_raster_order():
    grey, hole = digit(2), tail_hole()
    occluded = imaging.occlude(grey, hole, "mask")
    first = 26 * 28 + 5
    assert occluded.first_unknown == first
    assert occluded.prompt() == grey.reshape(-1)[:first].tolist()
    forced = occluded.forced()
    assert sorted(forced) == [p for p in range(first, 784) if not hole.reshape(-1)[p]]
    assert all(forced[p] == grey.reshape(-1)[p] for p in forced)


def test_mask_png_bright_is_unknown_and_keep_rows():
    mask = imaging.mask_from_png(imaging.decode_png(png_bytes(np.where(tail_hole(), 255, 0).astype(np.uint8)), "mask"))
    assert np.array_equal(mask, tail_hole())
    assert imaging.mask_from_keep_rows(26).sum() == 56
    with pytest.raises(imaging.ImageError, match="either `mask` or `keep_rows`"):
        imaging.choose_unknown(None, mask, 3)


def test_strip_is_n_images_side_by_side():
    images = [digit(i) for i in range(3)]
    strip = np.asarray(Image.open(io.BytesIO(imaging.encode_strip(images))))
    assert strip.shape == (28, 84)
    assert np.array_equal(strip[:, 28:56], images[1])


# -- over HTTP --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mnist_weights")
    save_tiny_model(folder, "linear-mnist", "linear", "mnist", info={"eval": {"bits_per_dim": 1.5}})
    save_tiny_model(folder, "softmax-mnist", "softmax", "mnist", info={"eval": {"bits_per_dim": 1.2}})
    save_tiny_model(folder, "linear-text", "linear", "text")
    with running_server(make_settings(weights=folder, max_batch=8, max_waiting=8)) as (url, _app):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


def pixels_body(grey: np.ndarray, **extra) -> dict:
    return {"pixels": grey.tolist(), "keep_rows": 28 - UNKNOWN_ROWS, "model": "linear-mnist", **extra}


def complete(client, **body) -> dict:
    response = client.post("/v1/images/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_pixels_with_keep_rows(server):
    grey = digit(3)
    out = complete(server, **pixels_body(grey, n=3, seed=9))
    assert out["object"] == "image.completion" and out["model"] == "linear-mnist" and len(out["data"]) == 3
    for i, entry in enumerate(out["data"]):
        pixels = np.asarray(entry["pixels"], dtype=np.uint8)
        assert entry["index"] == i and pixels.shape == (28, 28)
        assert np.array_equal(pixels[:26], grey[:26])  # known rows untouched
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(base64.b64decode(entry["png_base64"])))), pixels)
    usage = out["usage"]
    assert usage["pixels_generated"] == 3 * 28 * UNKNOWN_ROWS and usage["seconds"] > 0
    assert usage["pixels_per_second"] == pytest.approx(usage["pixels_generated"] / usage["seconds"], rel=0.05)
    assert not np.array_equal(out["data"][0]["pixels"], out["data"][1]["pixels"])  # seeds differ per sample


def test_alpha_png_keeps_known_pixels_after_the_hole(server):
    grey, hole = digit(4), tail_hole()
    out = complete(server, image=b64(rgba_with_hole(grey, hole)), model="softmax-mnist", n=2, seed=1)
    for entry in out["data"]:
        pixels = np.asarray(entry["pixels"], dtype=np.uint8)
        assert np.array_equal(pixels[~hole], grey[~hole])  # forced, not resampled
    assert out["usage"]["pixels_generated"] == 2 * int(hole.sum())


def test_same_seed_same_completion_and_mask_lists(server):
    grey, hole = digit(5), tail_hole()
    body = dict(pixels=grey.tolist(), mask=hole.astype(int).tolist(), seed=11, model="linear-mnist")
    first, second = complete(server, **body), complete(server, **body)
    assert first["data"][0]["pixels"] == second["data"][0]["pixels"]
    via_png = complete(server, **{**body, "mask": b64(png_bytes(np.where(hole, 255, 0).astype(np.uint8)))})
    assert via_png["data"][0]["pixels"] == first["data"][0]["pixels"]


@pytest.mark.parametrize("model", ["linear-mnist", "softmax-mnist"])
def test_the_same_digit_asked_again_takes_its_known_pixels_from_the_prefix_cache(server, model):
    """Its known pixels before the hole are not prefilled again (usage says how many), and with the same seed the
    completion and the particles' likelihood are those of the first, fully prefilled request."""
    grey, hole = digit(12), tail_hole()
    body = dict(pixels=grey.tolist(), mask=hole.astype(int).tolist(), seed=3, model=model)
    first, second = complete(server, **body), complete(server, **body)
    known_before_hole = int(np.argmax(hole.reshape(-1)))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == known_before_hole
    assert second["data"][0]["pixels"] == first["data"][0]["pixels"]
    likelihoods = [answer["usage"]["particles"]["known_log_likelihood"] for answer in (first, second)]
    assert likelihoods[1] == pytest.approx(likelihoods[0], abs=1e-3)


def test_multipart_upload_and_png_strip(server):
    grey, hole = digit(6), tail_hole()
    files = {"image": ("digit.png", rgba_with_hole(grey, hole), "image/png")}
    response = server.post(
        "/v1/images/completions",
        files=files,
        data={"n": "3", "seed": "2", "model": "linear-mnist"},
        headers={"accept": "image/png"},
    )
    assert response.status_code == 200 and response.headers["content-type"] == "image/png"
    strip = np.asarray(Image.open(io.BytesIO(response.content)))
    assert strip.shape == (28, 84)
    as_json = complete(server, image=b64(rgba_with_hole(grey, hole)), n=3, seed=2, model="linear-mnist")
    assert np.array_equal(strip[:, 56:], np.asarray(as_json["data"][2]["pixels"], dtype=np.uint8))


def test_multipart_with_mask_file_and_keep_rows_field(server):
    grey = digit(7)
    files = {
        "image": ("d.png", png_bytes(grey), "image/png"),
        "mask": ("m.png", png_bytes(np.where(tail_hole(), 255, 0).astype(np.uint8)), "image/png"),
    }
    out = server.post("/v1/images/completions", files=files, data={"seed": "3", "model": "linear-mnist"}).json()
    assert out["usage"]["pixels_generated"] == int(tail_hole().sum())
    kept = server.post(
        "/v1/images/completions",
        files={"image": ("d.png", png_bytes(grey), "image/png")},
        data={"keep_rows": "27", "model": "linear-mnist"},
    ).json()
    assert kept["usage"]["pixels_generated"] == 28


def test_a_missing_model_means_the_only_one_of_its_kind_else_a_400(server):
    refused = server.post("/v1/images/completions", json={"pixels": digit().tolist(), "keep_rows": 27})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["code"] == "model_required"
    assert "linear-mnist" in error["message"] and "softmax-mnist" in error["message"]
    text = server.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})  # one text model is loaded
    assert text.status_code == 200 and text.json()["model"] == "linear-text"


def test_stream_sends_rows_then_images_then_usage(server):
    body = pixels_body(digit(8), n=2, seed=4)
    whole = complete(server, **body)
    response = server.post("/v1/images/completions", json={**body, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(response.text)
    rows = [e for e in events if e["object"] == "image.completion.row"]
    assert sorted((e["index"], e["row"]) for e in rows) == [(0, 26), (0, 27), (1, 26), (1, 27)]
    for e in rows:
        assert e["pixels"] == whole["data"][e["index"]]["pixels"][e["row"]]
    done = [e for e in events if e["object"] == "image.completion"]
    assert sorted(e["index"] for e in done) == [0, 1]
    assert done[0]["png_base64"] == whole["data"][done[0]["index"]]["png_base64"]
    assert events[-1]["object"] == "image.completion.usage" and events[-1]["usage"]["pixels_generated"] == 112


def test_completed_images_counter_moves(server):
    before = metric_value(server.get("/metrics").text, "rnnserve_completed_images_total", model="linear-mnist")
    complete(server, **pixels_body(digit(), n=2))
    after = metric_value(server.get("/metrics").text, "rnnserve_completed_images_total", model="linear-mnist")
    assert after == before + 2


def bad(client, status: int, param: str | None, *words: str, **kwargs) -> None:
    response = client.post("/v1/images/completions", **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert all(w in error["message"] for w in words), error["message"]


def test_image_errors(server):
    jpeg = io.BytesIO()
    Image.fromarray(digit()).save(jpeg, format="JPEG")
    bad(server, 400, "image", "not a PNG", "JPEG", json={"image": b64(jpeg.getvalue())})
    bad(
        server,
        400,
        "image",
        "27x28 pixels; expected 28x28",
        json={"image": b64(png_bytes(np.zeros((28, 27), dtype=np.uint8))), "keep_rows": 3},
    )
    bad(server, 400, "image", "not valid base64", json={"image": "%%%"})
    bad(server, 400, "image", "no unknown pixel", json={"image": b64(png_bytes(digit()))})
    bad(server, 400, "keep_rows", "no unknown pixel", json=pixels_body(digit(), keep_rows=28))
    bad(server, 400, "mask", "no unknown pixel", json={"pixels": digit().tolist(), "mask": [[0] * 28] * 28})
    bad(server, 400, "mask", "expected 28 rows", json={"pixels": digit().tolist(), "mask": [[1] * 28] * 3})
    bad(server, 400, "pixels", "expected values in 0..255", json={"pixels": [[300] * 28] * 28, "keep_rows": 1})
    bad(server, 400, "image", "exactly one of", json={"keep_rows": 1})
    bad(server, 400, "image", "exactly one of", json={"pixels": digit().tolist(), "image": "x", "keep_rows": 1})
    bad(server, 400, "n", "less than or equal to 64", json=pixels_body(digit(), n=65))
    bad(server, 400, "n", "--max-batch", json=pixels_body(digit(), n=9))
    bad(server, 400, "n", "greater than or equal to 1", files={"image": ("d.png", png_bytes(digit()))}, data={"n": "0"})
    bad(server, 400, "image", "exactly one of", files={"mask": ("m.png", png_bytes(digit()))})
    bad(server, 400, "model", "text model", json=pixels_body(digit(), model="linear-text"))


def test_unknown_model_and_content_type(server):
    response = server.post("/v1/images/completions", json=pixels_body(digit(), model="nope"))
    assert (
        response.status_code == 404
        and "linear-mnist, linear-text, softmax-mnist" in response.json()["error"]["message"]
    )
    response = server.post("/v1/images/completions", content=b"x", headers={"content-type": "text/plain"})
    assert response.status_code == 415 and "multipart/form-data" in response.json()["error"]["message"]


def test_refused_image_requests_count_under_the_model_they_name(server):
    def invalid(model: str) -> float:
        return metric_value(
            server.get("/metrics").text,
            "rnnserve_requests_total",
            endpoint="/v1/images/completions",
            outcome="invalid",
            model=model,
        )

    before = invalid("linear-mnist")
    grey = digit(2)
    refusals = [
        server.post("/v1/images/completions", json=pixels_body(grey, keep_rows=-1)),  # a bad field (JSON)
        server.post("/v1/images/completions", json={**pixels_body(grey), "pixels": [[300] * 28] * 28}),  # bad pixels
        server.post(
            "/v1/images/completions",
            data={"model": "linear-mnist", "n": "abc"},  # a bad field (form)
            files={"image": ("d.png", png_bytes(grey), "image/png")},
        ),
        server.post(
            "/v1/images/completions",
            data={"model": "linear-mnist"},  # a PNG of the wrong size
            files={"image": ("d.png", png_bytes(np.zeros((32, 32), np.uint8)), "image/png")},
        ),
        server.post("/v1/images/completions", json=pixels_body(grey), headers={"accept": "text/csv"}),  # a 406
    ]
    assert [r.status_code for r in refusals] == [400, 400, 400, 400, 406], [r.text for r in refusals]
    assert invalid("linear-mnist") == before + 5
    none_before = invalid("none")
    assert (
        server.post("/v1/images/completions", json={**pixels_body(grey, keep_rows=-1), "model": "nope"}).status_code
        == 400
    )
    assert invalid("none") == none_before + 1  # an unknown name is no label value
    assert server.post("/v1/images/completions", json=pixels_body(grey, n=1)).status_code == 200  # still serving
