"""The playground page in a real headless Chromium, against `rnnserve serve` on the shipped weights.

Debian's `chromium` is driven by playwright (no browser download). The tests skip, with the
reason, when either is missing; CI's .ci/run installs Chromium first. Waits poll with
page.evaluate (run by the debugger, outside the page's Content-Security-Policy) rather than
wait_for_function, which the policy rightly refuses, so the page runs under its real policy.

Set PLAYGROUND_SCREENSHOT=path to keep the screenshot of the completion test (README's picture).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from model.attention.kinds import attention_kinds
from server.api.image_particles import PREFIX_ONLY
from server_support import (
    free_port,
    make_settings,
    metric_value,
    running_server,
    save_tiny_model,
    stop_process,
    wait_healthy,
)

ROOT = Path(__file__).resolve().parent.parent
KEY = "browser-test-key"
WAIT_SECONDS = 240  # the shipped MNIST models completing at once on a shared 2-core machine
FAILED_LOAD = re.compile(r"^Failed to load resource: the server responded with a status of 4\d\d")


def start_server(args: list[str], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    env["OMP_NUM_THREADS"] = "1"
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--device", "cpu", "--no-compile-decode", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


@pytest.fixture(scope="module")
def chromium():
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip(
            "no Chromium on this machine: `apt-get install chromium` runs the playground's browser tests "
            "(CI's .ci/run installs it)"
        )
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is missing: pip install -e '.[test]'")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path)
        yield browser
        browser.close()


# A play's layout: the Shakespeare model chats in the form it was trained on
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}:\n{{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)


@pytest.fixture(scope="module")
def served(chromium, tmp_path_factory):
    """Every shipped MNIST model (one per attention kind) and one Shakespeare model in a real server process, which
    can chat."""
    folder = tmp_path_factory.mktemp("playground_server")
    port, log, template = free_port(), folder / "server.log", folder / "chat.jinja"
    template.write_text(CHAT_TEMPLATE, encoding="utf-8")
    models = [
        *sorted((ROOT / "weights").glob("mnist-*.safetensors")),
        ROOT / "weights" / "shakespeare-linear.safetensors",
    ]
    flags = ["--port", str(port), "--chat-template", str(template)]
    proc = start_server([arg for path in models for arg in ("--model", str(path))] + flags, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, 180)
        yield url
    finally:
        stop_process(proc)


class Watched:
    """A page with every console error, page error and request it made, checked at the end."""

    def __init__(self, browser, url: str, viewport=(1200, 900)):
        self.context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
        self.page = self.context.new_page()
        self.url = url
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def open(self, path: str = "/") -> "Watched":
        self.page.goto(self.url + path)
        self.wait("document.body.dataset.ready === 'true' || !document.getElementById('key-form').hidden")
        return self

    def wait(self, condition: str, seconds: float = 30) -> None:
        deadline = time.monotonic() + seconds
        while not self.page.evaluate(condition):
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {seconds} s waiting for {condition}; page errors: {self.errors}")
            time.sleep(0.05)

    def check_clean(self, allowed=None) -> None:
        """No console errors (but `allowed` ones) and no request to any host but the server."""
        assert [e for e in self.errors if not (allowed and allowed.match(e))] == []
        elsewhere = [u for u in self.requests if not u.startswith(self.url + "/") and not u.startswith("data:")]
        assert self.requests and elsewhere == []

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def watched(chromium, served):
    page = Watched(chromium, served)
    yield page
    page.close()


def metric_now(url: str, name: str, **labels: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics").text, name, **labels)


def wait_metric(url: str, name: str, condition, seconds: float = 30, **labels: str) -> float:
    deadline = time.monotonic() + seconds
    while not condition(value := metric_now(url, name, **labels)):
        assert time.monotonic() < deadline, f"{name} {labels} stayed at {value}"
        time.sleep(0.05)
    return value


def canvas_rgba(page, selector: str) -> list[np.ndarray]:
    """(28, 28, 4) RGBA of every canvas matching `selector`, read back with getImageData."""
    flat = page.evaluate(
        """(selector) => [...document.querySelectorAll(selector)].map(
        (canvas) => Array.from(canvas.getContext('2d').getImageData(0, 0, 28, 28).data))""",
        selector,
    )
    return [np.array(values, dtype=np.uint8).reshape(28, 28, 4) for values in flat]


def editor_input(page) -> tuple[np.ndarray, np.ndarray]:
    """The editor's grey levels and unknown mask, from its canvas: unknown pixels are tinted blue."""
    rgba = canvas_rgba(page, "#editor")[0].astype(int)
    unknown = rgba[..., 2] > rgba[..., 0]
    return rgba[..., 0], unknown


def draw_stroke(page, points: list[tuple[float, float]]) -> None:
    """Drag the mouse across the editor through `points`, given in pixels of the 28x28 digit."""
    box = page.locator("#editor").bounding_box()
    at = [(box["x"] + x / 28 * box["width"], box["y"] + y / 28 * box["height"]) for x, y in points]
    page.mouse.move(*at[0])
    page.mouse.down()
    for x, y in at[1:]:
        page.mouse.move(x, y, steps=4)
    page.mouse.up()


def image_models(url: str) -> list[dict]:
    return [m for m in httpx.get(f"{url}/v1/models").json()["data"] if m["task"] == "mnist"]


# ---------------------------------------------------------------- loading


def test_page_loads_every_model_and_the_examples_with_no_error_and_no_other_host(watched):
    models = httpx.get(f"{watched.url}/v1/models").json()["data"]
    example_strip = np.asarray(Image.open(ROOT / "server/playground/digits.png"))
    for path in ("/", "/playground"):
        page = watched.open(path).page
        boxes = page.evaluate("[...document.querySelectorAll('#image-models input')].map((b) => [b.value, b.checked])")
        assert boxes == [[m["id"], True] for m in models if m["task"] == "mnist"]  # all image models, chosen
        options = page.evaluate("[...document.querySelectorAll('#text-model option')].map((o) => o.value)")
        assert options == [m["id"] for m in models if m["task"] == "text"]
        assert page.locator("#examples button").count() == example_strip.shape[1] // 28
        pixels, unknown = editor_input(page)  # the page starts on example 2 with its bottom half unknown
        assert (unknown == (np.arange(28) >= 14)[:, None]).all()
        assert (pixels[:14] == example_strip[:14, 56:84]).all()
    watched.check_clean()


def test_phone_width_needs_no_sideways_scrolling(chromium, served):
    phone = Watched(chromium, served, viewport=(390, 844)).open()
    try:
        for tab in ("#tab-images", "#tab-text"):
            phone.page.click(tab)
            assert phone.page.evaluate("document.documentElement.scrollWidth") <= 390
        phone.page.click("#tab-images")
        for selector in ("#editor", "#complete", "#image-seed"):
            box = phone.page.locator(selector).bounding_box()
            assert box["x"] >= 0 and box["x"] + box["width"] <= 390, selector
        phone.check_clean()
    finally:
        phone.close()


# ---------------------------------------------------------------- image tab


def test_presets_mark_the_unknown_pixels(watched):
    page = watched.open().page
    rows, cols = np.mgrid[0:28, 0:28]
    expected = {
        "bottom": rows >= 14,
        "right": cols >= 14,
        "none": rows < 0,
        "centre": (rows >= 7) & (rows < 21) & (cols >= 7) & (cols < 21),
    }
    for preset, unknown in expected.items():
        page.click(f"[data-preset={preset}]")
        assert (editor_input(page)[1] == unknown).all(), preset
    watched.check_clean()


def test_draw_hide_and_complete_keeps_every_known_pixel(watched, tmp_path):
    page = watched.open().page
    page.click("#clear")
    page.click("[data-preset=none]")
    draw_stroke(page, [(8, 6), (20, 6), (13, 26)])  # a 7
    page.check("input[name=tool][value=hide]")
    for y in (19.5, 22.5):  # hide a band across its stem; the stroke goes on below it, known
        draw_stroke(page, [(2, y), (26, y)])
    pixels, unknown = editor_input(page)
    assert pixels.max() == 255 and (pixels > 0).sum() > 20, "the stroke drew"
    assert unknown[18:24, 3:25].all() and not unknown[:18].any() and not unknown[24:].any()
    assert pixels[unknown].any() and pixels[24:].any(), "ink under the band and after it"
    page.fill("#image-n", "2")
    page.fill("#image-seed", "7")
    page.click("#complete")
    watched.wait("[...document.querySelectorAll('.panel')].every((p) => p.dataset.state === 'done')", WAIT_SECONDS)

    models = image_models(watched.url)
    completions = canvas_rgba(page, ".panel canvas")
    assert len(completions) == 2 * len(models) == 2 * len(list((ROOT / "weights").glob("mnist-*.safetensors")))
    for rgba in completions:
        assert (rgba[..., 0] == rgba[..., 2]).all(), "every unknown pixel was filled (none left tinted)"
        assert (rgba[..., 0][~unknown] == pixels[~unknown]).all(), "known pixels are the input's"
    # the page shows exactly what the API answers to the same request
    body = {
        "model": "mnist-linear",
        "pixels": pixels.tolist(),
        "mask": unknown.astype(int).tolist(),
        "n": 2,
        "seed": 7,
        "temperature": 1.0,
    }
    answer = httpx.post(f"{watched.url}/v1/images/completions", json=body, timeout=120).json()
    shown = canvas_rgba(page, ".panel[data-model='mnist-linear'] canvas")
    assert [s[..., 0].tolist() for s in shown] == [entry["pixels"] for entry in answer["data"]]
    for model in models:
        check_panel_stats(page.locator(f".panel[data-model='{model['id']}'] .stats").inner_text(), 2, model)
    keep_screenshot(page, tmp_path)
    watched.check_clean()


def check_panel_stats(stats: str, n: int, model: dict) -> None:
    match = re.fullmatch(r"([\d.]+) images/s · finished in ([\d.]+) s · ([\d.]+) (KiB|MiB) state/sequence", stats)
    assert match, stats
    rate, seconds, size = float(match[1]), float(match[2]), float(match[3]) * (1024 if match[4] == "KiB" else 1024**2)
    assert rate == pytest.approx(n / seconds, rel=0.05, abs=0.01)
    assert size == pytest.approx(model["state_bytes_per_sequence"], rel=0.05)


def keep_screenshot(page, tmp_path: Path) -> None:
    shot = tmp_path / "playground.png"
    page.locator("body").screenshot(path=shot)  # the page's content, without the empty viewport below
    assert shot.read_bytes().startswith(b"\x89PNG")
    if os.environ.get("PLAYGROUND_SCREENSHOT"):
        shutil.copy(shot, os.environ["PLAYGROUND_SCREENSHOT"])


PARTICLE_FIGURES = re.compile(
    r"(\d+) particles?/sample · (\d+) resamplings? · final ESS ≥ ([\d.]+)"
    r" · log p\(known pixels\) = (-?[\d.]+) nats"
)
SAMPLE_FIGURES = re.compile(
    r"sample (\d+): (\d+) resamplings? · final ESS ([\d.]+) · log p\(known pixels\) = (-?[\d.]+) nats"
)
# On every change inside the panels: each panel's particle line and how many of its pixels are still
# unknown (tinted blue: blue > red), so a test sees what was on screen while the particles ran.
RECORD_PANELS = """() => { window.snapshots = [];
    const tinted = (canvas) => { const d = canvas.getContext('2d').getImageData(0, 0, 28, 28).data; let k = 0;
        for (let o = 0; o < d.length; o += 4) k += d[o + 2] > d[o]; return k; };
    new MutationObserver(() => { for (const panel of document.querySelectorAll('.panel')) window.snapshots.push([
        panel.dataset.model, panel.querySelector('.particles').textContent,
        [...panel.querySelectorAll('.completions canvas')].reduce((k, c) => k + tinted(c), 0)]); })
      .observe(document.getElementById('panels'), { childList: true, characterData: true, subtree: true }); }"""


def test_particles_with_the_right_half_unknown_show_progress_then_their_figures(watched):
    page = watched.open().page  # example 2
    page.click("[data-preset=right]")
    pixels, unknown = editor_input(page)
    assert pixels[~unknown].any() and unknown[:, 14:].all() and not unknown[:, :14].any()
    page.fill("#image-n", "2")
    page.fill("#image-seed", "5")
    page.fill("#image-particles", "8")
    page.evaluate(RECORD_PANELS)
    page.click("#complete")
    watched.wait("[...document.querySelectorAll('.panel')].every((p) => p.dataset.state === 'done')", WAIT_SECONDS)

    models = image_models(watched.url)
    snapshots = page.evaluate("window.snapshots")
    for model in models:
        running = [(text, left) for name, text, left in snapshots if name == model["id"] and "rows drawn" in text]
        drawn = [int(re.fullmatch(r"particles running: (\d+) of 28 rows drawn", text)[1]) for text, _ in running]
        assert drawn and drawn == sorted(drawn) and 1 <= drawn[0] and drawn[-1] <= 27, (model["id"], drawn)
        # while the particles run no row is shown: every unknown pixel of both canvases is still tinted
        assert {left for _, left in running} == {2 * unknown.sum()}, model["id"]
        panel = f".panel[data-model='{model['id']}']"
        figures = PARTICLE_FIGURES.fullmatch(page.inner_text(f"{panel} .particles"))
        assert figures and int(figures[1]) == 8, page.inner_text(f"{panel} .particles")
        assert 1 <= float(figures[3]) <= 8 and float(figures[4]) < 0
        assert page.is_hidden(f"{panel} progress")
    for rgba in canvas_rgba(page, ".panel canvas"):
        assert (rgba[..., 0] == rgba[..., 2]).all(), "every unknown pixel was filled (none left tinted)"
        assert (rgba[..., 0][~unknown] == pixels[~unknown]).all(), "known pixels are the input's"

    # the linear panel shows what the API answers to the same request, figures included
    body = {
        "model": "mnist-linear",
        "pixels": pixels.tolist(),
        "mask": unknown.astype(int).tolist(),
        "n": 2,
        "seed": 5,
        "temperature": 1.0,
        "particles": 8,
    }
    answer = httpx.post(f"{watched.url}/v1/images/completions", json=body, timeout=120).json()
    panel = ".panel[data-model='mnist-linear']"
    assert [s[..., 0].tolist() for s in canvas_rgba(page, f"{panel} canvas")] == [e["pixels"] for e in answer["data"]]
    usage = answer["usage"]["particles"]
    figures = PARTICLE_FIGURES.fullmatch(page.inner_text(f"{panel} .particles"))
    assert int(figures[2]) == usage["resamplings"]
    assert float(figures[3]) == pytest.approx(usage["effective_sample_size"], abs=0.006)
    assert float(figures[4]) == pytest.approx(usage["known_log_likelihood"], abs=0.006)
    titles = page.evaluate(f'[...document.querySelectorAll("{panel} canvas")].map((c) => c.title)')
    for title, entry in zip(titles, answer["data"], strict=True):
        sample = SAMPLE_FIGURES.fullmatch(title)
        assert sample and int(sample[1]) == entry["index"] and int(sample[2]) == entry["particles"]["resamplings"]
        assert float(sample[3]) == pytest.approx(entry["particles"]["effective_sample_size"], abs=0.006)
        assert float(sample[4]) == pytest.approx(entry["particles"]["known_log_likelihood"], abs=0.006)
    watched.check_clean()


def test_particles_on_a_prefix_only_mask_show_the_servers_note(watched):
    page = watched.open().page  # example 2, bottom half unknown: the prompt conditions exactly
    for box in page.locator("#image-models input").all():
        box.set_checked(box.get_attribute("value") == "mnist-linear")
    page.fill("#image-n", "1")
    page.fill("#image-particles", "4")
    page.click("#complete")
    watched.wait("document.querySelector('.panel').dataset.state === 'done'", WAIT_SECONDS)
    assert page.locator(".panel").count() == 1
    figures = PARTICLE_FIGURES.fullmatch(page.inner_text(".panel .particles").split("\n")[0])
    assert figures and (figures[1], figures[2]) == ("1", "0"), "one particle, never resampled"
    assert page.inner_text(".panel .particles .note") == PREFIX_ONLY
    assert page.is_hidden(".panel progress"), "no progress: rows streamed as they were drawn"
    watched.check_clean()


def test_second_press_cancels_and_the_server_frees_the_slots(watched):
    url, page = watched.url, watched.open().page
    labels = {"endpoint": "/v1/images/completions", "outcome": "cancelled"}
    cancelled_before = metric_now(url, "rnnserve_requests_total", **labels)
    models = len(image_models(url))
    page.fill("#image-n", "16")
    page.click("#complete")
    wait_metric(url, "rnnserve_running_sequences", lambda v: v == 16 * models, WAIT_SECONDS)
    assert page.inner_text("#complete") == "Cancel"
    page.click("#complete")
    wait_metric(url, "rnnserve_running_sequences", lambda v: v == 0)
    assert metric_now(url, "rnnserve_waiting_sequences") == 0
    wait_metric(url, "rnnserve_requests_total", lambda v: v == cancelled_before + models, **labels)
    watched.wait("[...document.querySelectorAll('.panel')].every((p) => p.dataset.state === 'cancelled')")
    assert page.inner_text("#complete") == "Complete"
    tokens = metric_now(url, "rnnserve_generated_tokens_total")
    time.sleep(0.5)
    assert metric_now(url, "rnnserve_generated_tokens_total") == tokens, "nothing generates after the cancel"
    watched.check_clean()


# ---------------------------------------------------------------- text tab

GENERATED = "document.querySelector('#output .generated')"
OUTPUT_STATE = "document.getElementById('output').dataset.state"


def open_text_tab(watched, prompt: str, max_tokens: int, seed: int = 3) -> dict:
    page = watched.open().page
    page.click("#tab-text")
    page.select_option("#text-model", "shakespeare-linear")
    page.fill("#prompt", prompt)
    page.fill("#text-max", str(max_tokens))
    page.fill("#text-temperature", "0.8")
    page.fill("#text-seed", str(seed))
    return {"model": "shakespeare-linear", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed}


def test_text_streams_in_pieces_and_matches_the_api(watched):
    body = open_text_tab(watched, "ROMEO:\n", 200)
    page = watched.page
    # press Generate and record the generated text's length at every change, in one go
    page.evaluate(f"""() => {{ document.getElementById('generate').click(); window.lengths = [];
        const span = {GENERATED};
        new MutationObserver(() => window.lengths.push(span.textContent.length))
            .observe(span, {{ childList: true, characterData: true, subtree: true }}); }}""")
    watched.wait(f"{OUTPUT_STATE} === 'finished (length)'")
    lengths = page.evaluate("window.lengths")
    assert len(set(lengths)) >= 5 and lengths == sorted(lengths), "the text grew in several steps"
    answer = httpx.post(f"{watched.url}/v1/completions", json=body, timeout=60).json()
    assert page.evaluate(f"{GENERATED}.textContent") == answer["choices"][0]["text"]
    assert re.fullmatch(r"200 tokens · [\d.]+ tokens/s · finished \(length\)", page.inner_text("#text-stats"))
    watched.check_clean()


def test_stop_ends_the_stream_and_frees_the_slot(watched):
    url = watched.url

    def ended() -> float:  # text requests that ended, cancelled or not
        return sum(
            metric_now(url, "rnnserve_requests_total", endpoint="/v1/completions", outcome=outcome)
            for outcome in ("cancelled", "ok")
        )

    ended_before = ended()
    open_text_tab(watched, "ROMEO:\n", 240)
    page = watched.page
    # press Stop as soon as the first text arrives
    page.evaluate(f"""() => {{ const button = document.getElementById('generate'); button.click();
        const stop = new MutationObserver(() => {{ stop.disconnect(); button.click(); }});
        stop.observe({GENERATED}, {{ childList: true, characterData: true, subtree: true }}); }}""")
    watched.wait(f"{OUTPUT_STATE} === 'stopped'")
    generated = page.evaluate(f"{GENERATED}.textContent")
    assert 0 < len(generated.encode()) < 240
    assert page.inner_text("#text-stats").startswith(f"{len(generated.encode())} tokens · ")
    assert page.inner_text("#generate") == "Generate"
    # Usually the abort reaches the server mid-stream (outcome "cancelled"); on a loaded machine the server may
    # have sent all 240 tokens before it, and the page still stops showing them. Cancelling on a client's
    # disconnect is tested on the server alone in tests/test_server_process.py.
    deadline = time.monotonic() + 30
    while ended() != ended_before + 1:
        assert time.monotonic() < deadline, "the stopped request never ended on the server"
        time.sleep(0.1)
    wait_metric(url, "rnnserve_running_sequences", lambda v: v == 0, model="shakespeare-linear")
    watched.check_clean()


def test_colours_each_character_by_its_bytes_log_probability(watched):
    prompt = "To be, or not to bé"  # é is two bytes: one character, one colour
    open_text_tab(watched, prompt, 10)
    page = watched.page
    page.click("#score")
    watched.wait(f"{OUTPUT_STATE} === 'scored'")
    spans = page.evaluate(
        "[...document.querySelectorAll('#output span')].map((s) => [s.textContent, s.title, s.style.background])"
    )
    assert "".join(text for text, _, _ in spans) == prompt
    body = {"model": "shakespeare-linear", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    logprobs = httpx.post(f"{watched.url}/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]
    per_char = [*([lp] for lp in logprobs[:-2]), logprobs[-2:]]
    assert [title for _, title, _ in spans] == [
        f"log p = {sum(lps):.2f} over {len(lps)} byte{'s' if len(lps) > 1 else ''}" for lps in per_char
    ]
    assert len({colour for _, _, colour in spans}) > 3, "likely and unlikely bytes get different colours"
    watched.check_clean()


def test_chat_mode_sends_the_conversation_and_streams_each_reply(watched):
    body = open_text_tab(watched, "", 40)
    page = watched.page
    page.check("#text-chat")
    assert page.inner_text("#generate") == "Send" and page.is_hidden("#score") and page.is_visible("#new-chat")
    messages, shown = [], ""
    for text in ("Good morrow, sir!", "What news?"):
        page.fill("#prompt", text)
        page.click("#generate")
        watched.wait("document.getElementById('prompt').value === ''")  # cleared once the reply is in
        messages.append({"role": "user", "content": text})
        chat = {k: v for k, v in body.items() if k != "prompt"} | {"messages": messages}
        answer = httpx.post(f"{watched.url}/v1/chat/completions", json=chat, timeout=60).json()
        reply = answer["choices"][0]["message"]["content"]
        assert page.evaluate(f"{GENERATED}.textContent") == reply and reply
        assert page.evaluate(OUTPUT_STATE) == "finished (length)"
        shown += f"user: {text}\n\nassistant: {reply}"
        assert page.evaluate("document.getElementById('output').textContent") == shown
        messages.append({"role": "assistant", "content": reply})
        shown += "\n\n"
    page.click("#new-chat")
    assert page.evaluate("document.getElementById('output').textContent") == ""
    page.uncheck("#text-chat")
    assert page.inner_text("#generate") == "Generate" and page.is_visible("#score")
    watched.check_clean()


# ---------------------------------------------------------------- errors and the API key


def test_errors_show_the_apis_own_message(watched):
    body = open_text_tab(watched, "ROMEO:\n", 100000)
    page = watched.page
    page.click("#generate")
    watched.wait("!document.getElementById('error').hidden")
    api = httpx.post(f"{watched.url}/v1/completions", json=body).json()["error"]["message"]
    assert page.inner_text("#error") == api and "handles at most" in api
    page.click("#tab-images")
    page.fill("#image-n", "0")
    page.click("#complete")
    watched.wait("document.querySelector('.panel .error') !== null")
    image_body = {"model": image_models(watched.url)[0]["id"], "pixels": [[0] * 28] * 28, "keep_rows": 14, "n": 0}
    api = httpx.post(f"{watched.url}/v1/images/completions", json=image_body).json()["error"]["message"]
    assert page.locator(".panel .error").first.inner_text() == api and api.startswith("n: ")
    watched.check_clean(allowed=FAILED_LOAD)


@pytest.fixture(scope="module")
def every_kind(chromium, tmp_path_factory):
    """A tiny MNIST model of every attention kind, the hybrid among them, served together."""
    folder = tmp_path_factory.mktemp("every_kind")
    for kind in attention_kinds():
        save_tiny_model(folder, f"digits-{kind}", kind, "mnist")
    with running_server(make_settings(weights=folder)) as (url, _app):
        yield url


def test_a_panel_per_model_of_every_kind_labelled_with_its_kind(chromium, every_kind):
    watched = Watched(chromium, every_kind).open()
    page = watched.page
    try:
        models = image_models(every_kind)
        assert sorted(m["attention"] for m in models) == sorted(attention_kinds()) and "hybrid" in attention_kinds()
        picker = page.evaluate(
            "[...document.querySelectorAll('#image-models label')].map((l) => l.querySelector('.attention').textContent)"
        )
        assert picker == [m["attention"] for m in models]
        page.click("[data-preset=bottom]")
        page.fill("#image-n", "1")
        page.click("#complete")
        watched.wait("[...document.querySelectorAll('.panel')].every((p) => p.dataset.state === 'done')", WAIT_SECONDS)
        pixels, unknown = editor_input(page)
        for model in models:
            panel = f".panel[data-model='{model['id']}']"
            assert page.inner_text(f"{panel} .attention") == model["attention"]
            (completion,) = canvas_rgba(page, f"{panel} canvas")
            assert (completion[..., 0] == completion[..., 2]).all(), f"{model['id']}: every unknown pixel filled"
            assert (completion[..., 0][~unknown] == pixels[~unknown]).all(), f"{model['id']}: known pixels kept"
            stats = page.locator(f"{panel} .stats").inner_text()  # a tiny model's state rounds to whole KiB
            assert re.fullmatch(r"[\d.]+ images/s · finished in [\d.]+ s · \d+ KiB state/sequence", stats), stats
        watched.check_clean()
    finally:
        watched.close()


@pytest.fixture(scope="module")
def guarded(chromium, tmp_path_factory):
    """Tiny models behind --api-key (uvicorn in a thread: a real server, quicker to start than a process)."""
    folder = tmp_path_factory.mktemp("guarded_weights")
    save_tiny_model(folder, "digits", "linear", "mnist")
    save_tiny_model(folder, "chat", "linear", "text")
    with running_server(make_settings(weights=folder, api_key=KEY)) as (url, _app):
        yield url


def test_the_page_asks_for_the_key_and_keeps_it_in_memory_only(chromium, guarded):
    watched = Watched(chromium, guarded).open()
    page = watched.page
    try:
        assert page.is_visible("#key-form") and "missing or wrong API key" in page.inner_text("#error")
        for key, status in (("wrong", 401), (KEY, 200)):
            page.fill("#key-input", key)
            with page.expect_response(lambda r: r.url.endswith("/v1/models")) as answer:
                page.click("#key-form button")
            assert answer.value.status == status
        watched.wait("document.body.dataset.ready === 'true'")
        assert page.is_hidden("#key-form") and page.is_hidden("#error")
        assert page.evaluate("document.querySelector('#text-model').value") == "chat"
        page.click("#tab-text")
        page.fill("#text-max", "8")
        page.click("#generate")  # a POST with the key
        watched.wait(f"{OUTPUT_STATE} === 'finished (length)'")
        assert page.evaluate("[localStorage.length, sessionStorage.length, document.cookie]") == [0, 0, ""]
        assert KEY not in page.content()
        page.reload()
        watched.wait("!document.getElementById('key-form').hidden")  # memory only: asked again
        watched.check_clean(allowed=FAILED_LOAD)
    finally:
        watched.close()
