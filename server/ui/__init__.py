"""The built-in page at `/`: a chat playground and a live engine view, as static files with no build step.

The page is plain JavaScript shipped in this package (index.html here, its scripts and styles in static/), so it
works offline and behind any proxy. It uses the same endpoints as every other client: /v1/models and
/v1/chat/completions (sending `Authorization: Bearer` itself once it has asked for the key), and /metrics.json for
the engine view. Loading the page needs no key: it holds no data, and the key check stays where it is, on /v1/*.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

UI_DIR = Path(__file__).resolve().parent
STATIC_DIR = UI_DIR / "static"
ASSETS_PATH = "/ui"

# The page builds everything it shows from model output with text nodes (never innerHTML); this policy is the
# second line of defence: no inline or foreign scripts, and nothing is fetched from anywhere but this server.
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",  # images the user attached, shown from the data: URLs the request sends
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidate on every load, so an upgraded server never runs with the previous page.
    "Cache-Control": "no-cache",
}


def asset_version() -> str:
    """A short hash of the assets: index.html asks for `app.js?v=<hash>`, so a changed file is never served stale
    from a browser's cache."""
    digest = hashlib.sha256()
    for path in sorted(STATIC_DIR.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def mount_ui(app: FastAPI) -> None:
    """Serve the page at `/` and its assets under /ui/."""
    page = (UI_DIR / "index.html").read_text().replace("{{ASSET_VERSION}}", asset_version()).encode()

    @app.get("/", include_in_schema=False)
    async def ui_page() -> HTMLResponse:
        return HTMLResponse(page, headers=PAGE_HEADERS)

    app.mount(ASSETS_PATH, StaticFiles(directory=STATIC_DIR), name="ui")
