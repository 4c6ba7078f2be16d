"""The web page at ``/``: a streaming chat and a live view of the engine (``server/web/``).

Plain HTML, CSS and JavaScript shipped in the package (no build step, no CDN: it works offline).
The page talks to the same public routes as any client: ``/v1/models``, ``/v1/chat/completions``
(streamed, with the API key the user types in when the server has one) and ``GET /stats``, whose
``block_states`` draws the KV block map. ``/`` and ``/ui/*`` are open without the API key: they
are static files that reveal nothing about the server.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB_DIR = Path(__file__).with_name("web")
UI_PREFIX = "/ui/"


def add_web_page(app: FastAPI) -> None:
    """Serve ``index.html`` at ``/`` and the page's assets under ``/ui/``."""
    app.mount(UI_PREFIX.rstrip("/"), StaticFiles(directory=WEB_DIR), name="ui")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        """The chat page."""
        return FileResponse(WEB_DIR / "index.html", media_type="text/html")
