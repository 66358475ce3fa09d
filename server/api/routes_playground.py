"""GET / and /playground: a page to try the models in a browser.

The page is static (plain HTML, CSS and JavaScript modules in
`server/playground/`, shipped as package data) and talks to the public API
like any other client, so it needs nothing from the server beyond files.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parents[1] / "playground"  # server/playground
STATIC_PREFIX = "/playground/static"  # index.html links its assets relative to the root: playground/static/...
PAGE_PATHS = ("/", "/playground")
# Only this server: the page must work offline and send the API key nowhere else.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'",
    "Cache-Control": "no-cache",
}

router = APIRouter()


@router.get("/", include_in_schema=False)
@router.get("/playground", include_in_schema=False)
async def playground() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)


def mount_static(app: FastAPI) -> None:
    """Serve the page's assets (ETag and Last-Modified come from StaticFiles)."""
    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="playground-static")
