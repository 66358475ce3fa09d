"""The OpenAPI document describes the server exactly, and a schema fuzzer finds nothing to report.

The fuzzer (schemathesis, every default check, bounded examples and time) runs against a real
server process on tiny models; it is a test extra, so `make test` runs it.
schemathesis.toml in the repository root says which refusals no schema can express.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server_support import save_tiny_model, serving_process

REPO = Path(__file__).resolve().parent.parent
ERROR_STATUSES = {"400", "401", "404", "413", "415", "429", "500", "503"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("contract_weights")
    save_tiny_model(folder, "words", "linear", "text")
    save_tiny_model(folder, "digits", "linear", "mnist")
    with serving_process(folder, "--max-batch", "8") as url:
        yield url


@pytest.fixture(scope="module")
def document(base) -> dict:
    return httpx.get(f"{base}/openapi.json").json()


def test_no_422_and_every_error_status_of_the_generation_routes(document):
    for path in ("/v1/completions", "/v1/images/completions"):
        responses = document["paths"][path]["post"]["responses"]
        assert "422" not in responses and ERROR_STATUSES <= set(responses)
        assert "text/event-stream" in responses["200"]["content"]
        assert all(
            responses[s]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
            for s in ERROR_STATUSES
        )
    assert "image/png" in document["paths"]["/v1/images/completions"]["post"]["responses"]["200"]["content"]
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_only_routes_that_take_the_api_key_document_a_401(document):
    from server.api.middleware import is_open

    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert ("401" in operation["responses"]) != is_open(path), f"{method.upper()} {path}"


def test_every_multipart_field_is_documented_and_limits_are_this_servers(document):
    body = document["paths"]["/v1/images/completions"]["post"]["requestBody"]
    form = body["content"]["multipart/form-data"]["schema"]
    assert body["required"] and form["required"] == ["image"]
    assert {
        "image",
        "mask",
        "pixels",
        "model",
        "n",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "stream",
        "keep_rows",
        "particles",
    } == set(form["properties"])
    completion = document["components"]["schemas"]["CompletionRequest"]["properties"]
    # JSON options are nullable (null = the default, as in OpenAI's API); a form cannot send null
    assert [branch.get("maximum") for branch in completion["n"]["anyOf"]] == [8, None]  # --max-batch 8
    assert form["properties"]["particles"]["maximum"] == form["properties"]["n"]["maximum"] == 8
    # the text model's max_len
    assert [branch.get("maximum") for branch in completion["max_tokens"]["anyOf"]] == [64, None]


def test_docs_and_redoc_load_their_assets_from_this_server(base):
    for page in ("/docs", "/redoc"):
        html = httpx.get(f"{base}{page}").text
        sources = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert sources and all(s.startswith("/") for s in sources), sources
        for source in sources:
            assert httpx.get(f"{base}{source}").status_code == 200


@pytest.mark.skipif(
    shutil.which("schemathesis", path=str(Path(sys.executable).parent)) is None,
    reason="schemathesis is not installed: it is a test extra (pip install -e .[test])",
)
def test_the_schema_fuzzer_finds_no_failure(base):
    st = Path(sys.executable).parent / "schemathesis"
    run = subprocess.run(
        [str(st), "run", f"{base}/openapi.json", "--max-examples", "20", "--workers", "1", "--max-time", "60"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = run.stdout[-3000:]
    assert run.returncode == 0, summary
    assert "failure" not in summary.splitlines()[-1], summary
