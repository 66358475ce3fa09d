"""The `particles` parameter of POST /v1/images/completions, over real HTTP (the sampler itself is
checked against exact enumeration in test_particles.py)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from server.api.image_particles import DEFAULT_PARTICLES, NOTHING_KNOWN, PREFIX_ONLY
from server_support import make_settings, metric_value, running_server, save_tiny_model, sse_payloads

MAX_BATCH = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("particle_weights")
    save_tiny_model(folder, "digits", "linear", "mnist")
    with running_server(make_settings(weights=folder, max_batch=MAX_BATCH, max_waiting=8)) as (url, _app):
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client


def digit() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8)


def right_of_last_rows() -> np.ndarray:
    """Unknown: the right half of the last two rows, so known pixels follow unknown ones."""
    hole = np.zeros((28, 28), dtype=bool)
    hole[26:, 14:] = True
    return hole


def known_after_first_unknown(hole: np.ndarray) -> int:
    flat = hole.reshape(-1)
    return int((~flat[int(np.argmax(flat)) :]).sum())


def body(**extra) -> dict:
    return {"pixels": digit().tolist(), "mask": right_of_last_rows().astype(int).tolist(), "seed": 3, **extra}


def complete(client: httpx.Client, **fields) -> dict:
    response = client.post("/v1/images/completions", json=body(**fields))
    assert response.status_code == 200, response.text
    return response.json()


def test_default_particles_when_known_pixels_follow_unknown_ones(server):
    out = complete(server, n=2)
    usage = out["usage"]["particles"]
    assert usage["per_sample"] == DEFAULT_PARTICLES and "note" not in usage
    assert 1 <= usage["effective_sample_size"] <= DEFAULT_PARTICLES and usage["known_log_likelihood"] < 0
    hole = right_of_last_rows()
    for entry in out["data"]:
        assert np.array_equal(np.asarray(entry["pixels"], dtype=np.uint8)[~hole], digit()[~hole])
        # resampling happens at a known pixel that follows an unknown one, at most once at each
        assert 0 <= entry["particles"]["resamplings"] <= known_after_first_unknown(hole)
        assert entry["particles"]["known_log_likelihood"] < 0
    assert usage["resamplings"] == sum(e["particles"]["resamplings"] for e in out["data"])


def test_resamplings_are_counted_in_the_metrics(server):
    def counted() -> float:
        return metric_value(server.get("/metrics").text, "rnnserve_particle_resamplings_total", model="digits")

    # Whether a request resamples depends on its draws: the first of a few seeds that does.
    for seed in range(5, 15):
        before = counted()
        out = complete(server, n=2, particles=8, seed=seed)
        assert counted() == before + out["usage"]["particles"]["resamplings"]
        if out["usage"]["particles"]["resamplings"] > 0:
            return
    pytest.fail("no seed of 5-14 resampled: the counter was only checked at zero")


def test_the_default_fits_the_slots(server):
    assert complete(server, n=4)["usage"]["particles"]["per_sample"] == min(DEFAULT_PARTICLES, MAX_BATCH // 4)


def test_one_particle_is_forced_sampling_with_its_likelihood(server):
    out = complete(server, particles=1)
    assert out["usage"]["particles"]["per_sample"] == 1
    assert out["data"][0]["particles"]["resamplings"] == 0 and out["data"][0]["particles"]["effective_sample_size"] == 1


def test_prefix_only_masks_run_one_particle_and_say_so(server):
    out = server.post("/v1/images/completions", json={"pixels": digit().tolist(), "keep_rows": 27, "particles": 8})
    usage = out.json()["usage"]["particles"]
    assert out.status_code == 200 and usage["per_sample"] == 1 and usage["note"] == PREFIX_ONLY
    # known pixels before the first unknown one are the prompt: their likelihood is exact, and reported
    assert usage["known_log_likelihood"] < 0 and usage["resamplings"] == 0


def test_with_no_known_pixel_the_note_says_the_sample_is_unconditional(server):
    out = server.post("/v1/images/completions", json={"pixels": digit().tolist(), "keep_rows": 0})
    usage = out.json()["usage"]["particles"]
    assert out.status_code == 200 and usage["per_sample"] == 1 and usage["note"] == NOTHING_KNOWN
    assert usage["known_log_likelihood"] == 0.0  # log p(nothing) = 0


def test_stream_sends_progress_then_the_fixed_rows(server):
    whole = complete(server, n=2, particles=4)
    events = sse_payloads(server.post("/v1/images/completions", json=body(n=2, particles=4, stream=True)).text)
    kinds = [e["object"] for e in events]
    progress = [e["rows_drawn"] for e in events if e["object"] == "image.completion.progress"]
    assert progress == [27]  # row 26 drawn; row 27 ends the particles, whose rows follow
    assert kinds.index("image.completion.row") > max(i for i, k in enumerate(kinds) if k == "image.completion.progress")
    rows = [e for e in events if e["object"] == "image.completion.row"]
    assert sorted((e["index"], e["row"]) for e in rows) == [(0, 26), (0, 27), (1, 26), (1, 27)]
    for e in rows:
        assert e["pixels"] == whole["data"][e["index"]]["pixels"][e["row"]]
    done = {e["index"]: e for e in events if e["object"] == "image.completion"}
    assert done[1]["particles"] == whole["data"][1]["particles"]
    assert events[-1]["usage"]["particles"]["per_sample"] == 4


def refused(client: httpx.Client, param: str, *words: str, **fields) -> None:
    response = client.post("/v1/images/completions", json=body(**fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error


def test_bad_particles_get_a_clear_400_and_the_server_keeps_serving(server):
    refused(server, "particles", "greater than or equal to 1", particles=0)
    refused(server, "particles", "less than or equal to 256", particles=257)
    refused(server, "particles", "n (4) x particles (16) = 64 decode slots", "--max-batch", n=4, particles=16)
    refused(server, "particles", "temperature > 0", particles=4, temperature=0)
    everything_unknown = {"mask": np.ones((28, 28), dtype=int).tolist()}
    refused(server, "particles", "every pixel unknown", particles=4, **everything_unknown)
    nothing_unknown = {"mask": np.zeros((28, 28), dtype=int).tolist()}
    refused(server, "mask", "no unknown pixel", particles=4, **nothing_unknown)
    assert complete(server, particles=2)["usage"]["particles"]["per_sample"] == 2
