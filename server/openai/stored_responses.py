"""The stored responses' own routes: retrieve one, list the input of its turn, delete it; and the job that deletes
responses past --store-retention-days."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

from fastapi import FastAPI, Query, Request

from server.openai.errors import ERROR_RESPONSES, APIError
from server.state import responses
from server.state.keys import request_owner
from server.state.stored import StoredState

logger = logging.getLogger(__name__)

SWEEP_SECONDS = 60.0
"""How often expired responses are deleted (reads treat them as gone from the moment they expire)."""


def response_not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


def add_stored_response_routes(app: FastAPI, stored: StoredState) -> None:
    async def sweep() -> None:
        while True:
            try:
                async with stored.db().transaction() as connection:
                    await responses.remove_expired(connection)
            except Exception:  # a database away for a moment: the next sweep catches up
                logger.exception("Deleting expired responses failed")
            await asyncio.sleep(SWEEP_SECONDS)

    stored.jobs.append(sweep)

    @app.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
        async with stored.db().transaction() as connection:
            row = await responses.get(connection, request_owner(request), response_id)
        if row is None:
            raise response_not_found(response_id)
        return row.response

    @app.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        async with stored.db().transaction() as connection:
            if not await responses.remove(connection, request_owner(request), response_id):
                raise response_not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items", responses=ERROR_RESPONSES)
    async def list_input_items(
        response_id: str,
        request: Request,
        after: str | None = None,
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        """The input of the response's own turn (not of the turns before it), paged."""
        async with stored.db().transaction() as connection:
            row = await responses.get(connection, request_owner(request), response_id)
        if row is None:
            raise response_not_found(response_id)
        items = list(row.input_items if order == "asc" else reversed(row.input_items))
        if after is not None:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        return {
            "object": "list", "data": page, "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
        }  # fmt: skip
