"""The playground page as files over HTTP (no browser): served without the API key, shipped in the wheel.

The browser tests (tests/test_playground_browser.py) drive the page itself.
"""

from __future__ import annotations

import http.client
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest

from server.api.image_particles import MAX_PARTICLES
from server.api.routes_playground import STATIC_DIR
from server_support import make_settings, running_server, save_tiny_model

ROOT = Path(__file__).resolve().parent.parent
KEY = "playground-key"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("playground_weights")
    save_tiny_model(folder, "digits", "linear", "mnist")
    with running_server(make_settings(weights=folder, api_key=KEY)) as (url, _app):
        yield url


def test_page_is_served_at_root_and_playground_without_the_key(guarded):
    for path in ("/", "/playground"):
        page = httpx.get(guarded + path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.text == (STATIC_DIR / "index.html").read_text()
        # the browser itself refuses any host but this server
        assert "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(guarded + "/playground/").headers["location"].endswith("/playground")
    assert httpx.get(guarded + "/v1/models").status_code == 401  # the API still needs the key


def test_every_asset_the_page_links_is_served_without_the_key(guarded):
    html = (STATIC_DIR / "index.html").read_text()
    linked = re.findall(r'(?:href|src)="(playground/static/[^"]+)"', html)
    assert {"playground/static/main.js", "playground/static/style.css"} <= set(linked)
    for path in sorted({f"playground/static/{f.name}" for f in STATIC_DIR.iterdir()} | set(linked)):
        asset = httpx.get(f"{guarded}/{path}")
        assert asset.status_code == 200, path
        assert asset.content == (STATIC_DIR / path.removeprefix("playground/static/")).read_bytes()
    assert httpx.get(f"{guarded}/playground/static/main.js").headers["content-type"].startswith("text/javascript")


def test_the_open_static_prefix_does_not_open_the_api(guarded):
    """A path that only starts with the static prefix must not reach an API route without the key."""
    host, port = guarded.removeprefix("http://").split(":")
    for path in ("/playground/static/../../v1/models", "/playground/static/%2e%2e/%2e%2e/v1/models"):
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.request("GET", path)  # http.client sends the dots as written
        answer = connection.getresponse()
        body = answer.read()
        connection.close()
        assert answer.status == 404 and b"digits" not in body, path


def test_the_particles_control_has_the_apis_bounds_and_starts_empty():
    """Empty sends no `particles` (the server's default); the browser's own bounds are the API's."""
    control = re.search(r'<input id="image-particles"[^>]*>', (STATIC_DIR / "index.html").read_text())
    assert control, "the image tab has a particles control"
    assert 'min="1"' in control[0] and f'max="{MAX_PARTICLES}"' in control[0] and "value=" not in control[0]


def test_a_non_editable_wheel_ships_the_page(tmp_path):
    """`pip install .` (the Dockerfile's install) must carry the static folder, not only the .py files."""
    source = tmp_path / "src"  # a copy: building in the work tree would leave build/ behind
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for name in {name.split(".")[0] for name in setuptools["packages"]}:  # server.api lives in server/
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ["pyproject.toml", "README.md", *(f"{m}.py" for m in setuptools.get("py-modules", []))]:
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(source),
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next((tmp_path / "dist").glob("rnnserve-*.whl"))
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"server/playground/{f.name}" for f in STATIC_DIR.iterdir()}
    assert len(expected) >= 8 and expected <= shipped, sorted(expected - shipped)
