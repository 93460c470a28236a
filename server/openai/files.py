"""/v1/files: upload, list, retrieve, delete and read files, as OpenAI's Files API; a `batch` file is checked line
by line when it arrives (server/openai/batches.py's `read_requests`), so a bad line is a 400 naming it, not a
failed batch later."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.responses import Response

from server.openai.batches import read_requests
from server.openai.errors import ERROR_RESPONSES, APIError, file_not_found, invalid_request
from server.state import files
from server.state.keys import request_owner
from server.state.stored import StoredState, list_page

UPLOAD_PURPOSES = ("batch", "user_data")
"""What a client may upload a file for (`batch_output` files are the server's own)."""


def add_file_routes(app: FastAPI, stored: StoredState) -> None:
    max_bytes = stored.settings.max_file_bytes

    @app.post("/v1/files", responses=ERROR_RESPONSES)
    async def create_file(
        request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
    ) -> dict[str, Any]:
        """Upload a file (`purpose`: batch or user_data), at most --max-file-bytes."""
        if purpose not in UPLOAD_PURPOSES:
            raise invalid_request(
                f"'{purpose}' is not a purpose files are uploaded for: {', '.join(UPLOAD_PURPOSES)}", "purpose"
            )
        content = await file.read(max_bytes + 1)
        if len(content) > max_bytes:
            raise APIError(413, f"The file exceeds the server's limit of {max_bytes} bytes.", code="file_too_large")
        if purpose == "batch":
            read_requests(content)
        owner = request_owner(request)
        async with stored.db().transaction() as connection:
            await stored.check_quota(connection, owner, len(content))
            return await files.add(connection, owner, purpose, file.filename or "upload", content)

    @app.get("/v1/files", responses=ERROR_RESPONSES)
    async def list_files(
        request: Request,
        purpose: str | None = None,
        limit: int = Query(10_000, ge=1, le=10_000),
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        async with stored.db().transaction() as connection:
            rows, more = await files.listed(connection, request_owner(request), purpose, after, limit, order == "asc")
        return list_page([files.file_object(row._mapping) for row in rows], more)

    @app.get("/v1/files/{file_id}", responses=ERROR_RESPONSES)
    async def retrieve_file(file_id: str, request: Request) -> dict[str, Any]:
        async with stored.db().transaction() as connection:
            row = await files.get(connection, request_owner(request), file_id)
        if row is None:
            raise file_not_found(file_id)
        return files.file_object(row._mapping)

    @app.delete("/v1/files/{file_id}", responses=ERROR_RESPONSES)
    async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
        async with stored.db().transaction() as connection:
            if not await files.remove(connection, request_owner(request), file_id):
                raise file_not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.get("/v1/files/{file_id}/content", responses=ERROR_RESPONSES)
    async def file_content(file_id: str, request: Request) -> Response:
        async with stored.db().transaction() as connection:
            content = await files.content(connection, request_owner(request), file_id)
        if content is None:
            raise file_not_found(file_id)
        return Response(content, media_type="application/octet-stream")
