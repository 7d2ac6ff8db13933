"""The web face of ``pagedllm serve``: a chat page at ``/`` and a live dashboard at ``/dashboard``.

The pages are plain HTML, CSS and JavaScript shipped in ``static/`` (no build step, nothing
loaded from elsewhere). They talk to the same OpenAI API as any client, with the API key the
user types in (kept in the browser), so the pages themselves carry no data and need no key.
The dashboard's data (``GET /v1/dashboard``) and its abort button
(``POST /v1/dashboard/requests/{id}/abort``) sit behind the API key like every /v1 route.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.web.feed import DashboardFeed
from pagedllm.entrypoints.web.tracker import RequestTracker, TrackingEngine

STATIC = Path(__file__).resolve().parent / "static"
_NO_CACHE = {"Cache-Control": "no-cache"}

__all__ = ["STATIC", "DashboardFeed", "RequestTracker", "TrackingEngine", "mount_web"]


def mount_web(
    app: FastAPI, *, engine: Any, metrics: Any, tracker: RequestTracker, auth: Any
) -> DashboardFeed:
    """Add the pages, their assets and the dashboard's JSON routes to ``app``."""
    feed = DashboardFeed(engine, metrics, tracker)
    pages = APIRouter(include_in_schema=False)

    @pages.get("/")
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC / "chat.html", headers=_NO_CACHE)

    @pages.get("/dashboard")
    async def dashboard_page() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html", headers=_NO_CACHE)

    app.include_router(pages)
    app.mount("/static", StaticFiles(directory=STATIC), name="web-static")
    data = APIRouter(prefix="/v1/dashboard", dependencies=[auth])

    @data.get("")
    async def dashboard_data() -> dict[str, Any]:
        return feed.snapshot()

    @data.post("/requests/{request_id}/abort")
    async def abort_request(request_id: str) -> dict[str, Any]:
        if tracker.get(request_id) is None:
            raise APIError(
                f"request_id: no request {request_id!r} is in flight",
                status=404,
                param="request_id",
                code="request_not_found",
            )
        await engine.abort(request_id)
        return {"id": request_id, "aborted": True}

    app.include_router(data)
    return feed
