"""/v1/batches: OpenAI's Batch API, and the runner that works through batches in the background.

A batch's input is a stored file of requests (`custom_id`, `method`, `url`, `body`), checked when uploaded. Any
replica's runner takes a runnable batch by a lease (server/state/batches.py), runs its requests through the same
serving code as the HTTP routes, marked as batch requests (the engine schedules them behind every interactive
request), at most --batch-concurrency at once, and records each result once by its `custom_id`. When every
request has a result, it writes the output file (successes) and the error file (failures), in input order. A
replica that stops releases its lease; one that dies lets it run out; either way the batch resumes where its
results stop: a request in flight at a crash runs again, but only its first result is kept.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection
from starlette.responses import Response

from server.metrics import ServerMetrics
from server.openai.chat import serve_chat_completion
from server.openai.completions import serve_completion
from server.openai.embeddings import serve_embeddings
from server.openai.errors import (
    ERROR_RESPONSES,
    APIError,
    file_not_found,
    internal_error,
    invalid_request,
    validation_error,
)
from server.openai.generation import BATCH_SCOPE_KEY, ServingContext
from server.openai.pooling_schemas import EmbeddingRequest
from server.openai.responses import serve_response
from server.openai.responses_schemas import ResponsesRequest
from server.openai.schemas import ChatCompletionRequest, CompletionRequest
from server.state import batches, files
from server.state.keys import OWNER_SCOPE_KEY, request_owner
from server.state.stored import LEASE_SECONDS, StoredState, list_page, now

logger = logging.getLogger(__name__)

MAX_REQUESTS = 50_000
"""Requests in one batch's input file at most (OpenAI's limit)."""
POLL_SECONDS = 1.0
"""How often an idle runner looks for a batch to take, and a running one for a cancel."""

_ENDPOINTS: dict[str, tuple[type[BaseModel], Callable[[ServingContext, Any, Request], Awaitable[Response]]]] = {
    "/v1/chat/completions": (ChatCompletionRequest, serve_chat_completion),
    "/v1/completions": (CompletionRequest, serve_completion),
    "/v1/embeddings": (EmbeddingRequest, serve_embeddings),
    "/v1/responses": (ResponsesRequest, serve_response),
}


@dataclass(frozen=True)
class BatchRequest:
    """One line of a batch's input file."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


def read_requests(content: bytes) -> list[BatchRequest]:
    """A batch input file's requests; a 400 naming the first line that is not one (or a repeated custom_id)."""
    requests: list[BatchRequest] = []
    seen: set[str] = set()
    for number, raw in enumerate(content.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError as exc:
            raise invalid_request(f"Line {number} of the batch file is not JSON ({exc}).", "file") from None
        problem = _problem(line, seen)
        if problem:
            raise invalid_request(f"Line {number} of the batch file: {problem}.", "file")
        seen.add(line["custom_id"])
        requests.append(BatchRequest(number, line["custom_id"], line["url"], line["body"]))
        if len(requests) > MAX_REQUESTS:
            raise invalid_request(f"A batch file holds at most {MAX_REQUESTS} requests.", "file")
    if not requests:
        raise invalid_request("The batch file holds no request.", "file")
    return requests


def _problem(line: Any, seen: set[str]) -> str | None:
    if not isinstance(line, dict):
        return "a request is a JSON object"
    if not isinstance(line.get("custom_id"), str) or not line["custom_id"]:
        return "`custom_id` must be a non-empty string"
    if line["custom_id"] in seen:
        return f"the custom_id {line['custom_id']!r} is used by an earlier line"
    if line.get("method") != "POST":
        return "`method` must be POST"
    if line.get("url") not in _ENDPOINTS:
        return f"`url` must be one of {', '.join(_ENDPOINTS)}"
    if not isinstance(line.get("body"), dict):
        return "`body` must be a JSON object"
    return None


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None


def batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No batch found with id '{batch_id}'.", code="batch_not_found")


def add_batch_routes(
    app: FastAPI, stored: StoredState, serving: Callable[[], ServingContext], metrics: ServerMetrics
) -> None:
    runner = BatchRunner(stored, serving, metrics)
    stored.jobs.append(runner.run)
    stored.on_shutdown.append(runner.release)

    @app.post("/v1/batches", responses=ERROR_RESPONSES)
    async def create_batch(body: CreateBatchRequest, request: Request) -> dict[str, Any]:
        """Run the requests of an uploaded `batch` file in the background, at a lower priority than interactive
        requests; their answers come back as the batch's output and error files."""
        owner = request_owner(request)
        async with stored.db().transaction() as connection:
            row = await files.get(connection, owner, body.input_file_id)
            if row is None:
                raise file_not_found(body.input_file_id, "input_file_id")
            if row.purpose != "batch":
                raise invalid_request(f"The file {body.input_file_id} was not uploaded for `batch`.", "input_file_id")
            content = await files.content(connection, owner, body.input_file_id)
            assert content is not None
            wrong = [r.line for r in read_requests(content) if r.url != body.endpoint]
            if wrong:
                raise invalid_request(
                    f"Line {wrong[0]} of the batch file is for another endpoint than {body.endpoint}.", "endpoint"
                )
            batch = batches.new_batch(owner, body.endpoint, body.input_file_id, body.metadata)
            await batches.add(connection, owner, batch)
        return batch

    @app.get("/v1/batches/{batch_id}", responses=ERROR_RESPONSES)
    async def retrieve_batch(batch_id: str, request: Request) -> dict[str, Any]:
        async with stored.db().transaction() as connection:
            batch = await batches.get(connection, request_owner(request), batch_id)
        if batch is None:
            raise batch_not_found(batch_id)
        return batch

    @app.get("/v1/batches", responses=ERROR_RESPONSES)
    async def list_batches(
        request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)
    ) -> dict[str, Any]:
        async with stored.db().transaction() as connection:
            data, more = await batches.listed(connection, request_owner(request), after, limit)
        return list_page(data, more)

    @app.post("/v1/batches/{batch_id}/cancel", responses=ERROR_RESPONSES)
    async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
        """Stop starting the batch's requests; those running finish, and the files hold what was done. A batch
        already cancelling is returned as it is (a retried cancel); one that ended is a 409."""
        async with stored.db().transaction() as connection:
            while True:  # until the cancel is written, or the runner closed the batch between the read and it
                batch = await batches.get(connection, request_owner(request), batch_id)
                if batch is None:
                    raise batch_not_found(batch_id)
                seen = batch["status"]
                if seen == "cancelling":
                    return batch
                if seen not in batches.RUNNABLE:
                    raise APIError(409, f"A batch that is {seen} cannot be cancelled.", code="invalid_state")
                batch.update(status="cancelling", cancelling_at=now())
                if await batches.save(connection, batch, seen):
                    return batch


class _NotNow(Exception):
    """The server could not take a line now (429 `queue_full`; 503: loading, draining, its engine gone): no
    answer to record, the line runs again later. `retry_after`: seconds to wait (a full queue), None: stop the
    batch here and leave it to resume (a 503)."""

    def __init__(self, retry_after: float | None) -> None:
        super().__init__()
        self.retry_after = retry_after


class _Changed(Exception):
    """The batch's status changed (a cancel) while it was being closed: close it again, as it now is."""


class BatchRunner:
    """This replica's worker of batches: one batch at a time, its requests `batch_concurrency` at a time."""

    def __init__(self, stored: StoredState, serving: Callable[[], ServingContext], metrics: ServerMetrics) -> None:
        self.stored = stored
        self.serving = serving
        self.metrics = metrics

    async def run(self) -> None:
        while True:
            try:
                async with self.stored.db().transaction() as connection:
                    self.metrics.set_batches(await batches.statuses(connection))
                    batch_id = await batches.claim(connection, self.stored.worker) if self._ready() else None
                if batch_id is None or not await self._work(batch_id):
                    await asyncio.sleep(POLL_SECONDS)
            except asyncio.CancelledError:
                raise
            except Exception:  # a database that went away for a moment: try again, never stop the loop
                logger.exception("The batch runner failed; retrying")
                await asyncio.sleep(POLL_SECONDS)

    async def release(self) -> None:
        async with self.stored.db().transaction() as connection:
            await batches.release(connection, self.stored.worker)

    def _ready(self) -> bool:
        """Whether the server takes requests (not loading, draining or dead): no batch is taken before."""
        try:
            self.serving().lifecycle.check_accepting()
        except APIError:
            return False
        return True

    async def _work(self, batch_id: str) -> bool:
        """Run the batch's requests that have no result yet, then close it. False: it was left to resume (the
        server stopped taking requests, or another replica took the batch over), its lease given back."""
        db = self.stored.db()
        async with db.transaction() as connection:
            batch = await batches.get(connection, None, batch_id)
            owner = await batches.owner_of(connection, batch_id)
            content = await files.content(connection, owner, batch["input_file_id"])
            done = await batches.recorded_lines(connection, batch_id)
        if content is None:
            await self._end(batch_id, "failed", errors=[("input_file_missing", "The input file was deleted.")])
            return True
        try:
            requests = read_requests(content)
        except APIError as exc:  # checked at upload: only a file an older Ferry took fails here
            await self._end(batch_id, "failed", errors=[("invalid_input_file", exc.info.message)])
            return True
        if batch["status"] == "validating":
            counts = {"total": len(requests), "completed": 0, "failed": 0}
            started = {**batch, "status": "in_progress", "in_progress_at": now(), "request_counts": counts}
            async with db.transaction() as connection:
                await batches.save(connection, started, "validating")  # lost to a cancel: the first line sees it
        pending = iter([request for request in requests if request.line not in done])
        stop, left = asyncio.Event(), asyncio.Event()
        if now() >= batch["expires_at"]:
            stop.set()

        async def lines() -> None:
            for request in pending:  # one iterator for every worker: each request is taken once
                if stop.is_set():
                    return
                await self._line(batch_id, owner, request, stop, left)

        keeper = asyncio.create_task(self._keep(batch_id, batch["expires_at"], stop, left))
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(self.stored.settings.batch_concurrency):
                    group.create_task(lines())
        finally:
            stop.set()
            keeper.cancel()
            await asyncio.wait([keeper])  # its last write of the counts lands before the batch is closed
        if left.is_set():
            async with db.transaction() as connection:
                await batches.release(connection, self.stored.worker, batch_id)
            return False
        await self._end(batch_id, "expired" if now() >= batch["expires_at"] else "completed", requests)
        return True

    async def _line(
        self, batch_id: str, owner: str, request: BatchRequest, stop: asyncio.Event, left: asyncio.Event
    ) -> None:
        """Run one request and record its result, unless the batch is cancelled first (a cancel stops the very
        next request) or the server cannot take it (`left`)."""
        while not stop.is_set():
            async with self.stored.db().transaction() as connection:
                if await batches.status(connection, batch_id) == "cancelling":
                    stop.set()
                    return
            try:
                error, result = await self._answer(owner, request)
            except _NotNow as not_now:
                if not_now.retry_after is None:
                    left.set()
                    stop.set()
                    return
                await asyncio.sleep(not_now.retry_after)
                continue
            try:
                async with self.stored.db().transaction() as connection:
                    first = await batches.record(connection, batch_id, request.line, request.custom_id, error, result)
            except IntegrityError:  # another replica recorded it first (see batches.record)
                first = False
            if first:
                self.metrics.count_batch_request(error)
            return

    async def _keep(self, batch_id: str, expires_at: int, stop: asyncio.Event, left: asyncio.Event) -> None:
        """Every POLL_SECONDS: renew the lease (every third of it), publish the counts, and stop starting requests
        once the batch is cancelled, past its window, or (a lease lost while this replica stalled) another's."""
        renewed = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(POLL_SECONDS)
            try:
                async with self.stored.db().transaction() as connection:
                    if time.monotonic() - renewed > LEASE_SECONDS / 3:
                        if not await batches.renew(connection, self.stored.worker, batch_id):
                            left.set()
                            stop.set()
                            return
                        renewed = time.monotonic()
                    current = await batches.get(connection, None, batch_id)
                    if current["status"] == "cancelling" or now() >= expires_at:
                        stop.set()
                    completed, failed = await batches.counts(connection, batch_id)
                    current["request_counts"].update(completed=completed, failed=failed)
                    await batches.save(connection, current, current["status"])  # lost to a cancel: next time
                    self.metrics.set_batches(await batches.statuses(connection))
            except Exception:  # a database that went away for a moment: the next tick tries again
                logger.exception("Keeping batch %s failed; retrying", batch_id)

    async def _answer(self, owner: str, request: BatchRequest) -> tuple[bool, dict[str, Any]]:
        """(failed, the output or error file's line) of one request, answered as the route would answer it."""
        request_id = f"batch_req_{uuid.uuid4().hex}"
        model, serve = _ENDPOINTS[request.url]
        try:
            body = model.model_validate({**request.body, "stream": False} if "stream" in model.model_fields
                                        else request.body)  # fmt: skip
            response = await serve(self.serving(), body, _batch_request(request.url, owner))
        except pydantic.ValidationError as exc:  # the body a route would have refused, with the route's 400
            response = validation_error(exc.errors()).response()
        except APIError as exc:
            if exc.info.code == "queue_full":  # (not every 429: a key over its storage quota stays over it)
                raise _NotNow(float(exc.headers.get("Retry-After", POLL_SECONDS))) from exc
            if exc.status_code == 503 or (exc.status_code >= 500 and not self._ready()):
                raise _NotNow(None) from exc  # the server's state (its engine died under the line), not an answer
            response = exc.response()
        except Exception:  # a bug: the route's own answer to one (a 500 that says nothing), and the line goes on
            logger.exception("A batch request failed (%s)", request.custom_id)
            response = internal_error().response()
        answer = {"status_code": response.status_code, "request_id": request_id, "body": json.loads(response.body)}
        line = {"id": request_id, "custom_id": request.custom_id, "response": answer, "error": None}
        return response.status_code >= 400, line

    async def _end(
        self,
        batch_id: str,
        status: str,
        requests: list[BatchRequest] | None = None,
        errors: list[tuple[str, str]] | None = None,
    ) -> None:
        """Close the batch as `status` (or cancelled, if a cancel came first) with its output and error files;
        `requests`: the input's (an expired batch records those without a result as expired)."""
        if status != "failed":  # shown while the files are written (one transaction, long for a large batch)
            async with self.stored.db().transaction() as connection:
                batch = await batches.get(connection, None, batch_id)
                finalizing = {**batch, "status": "finalizing", "finalizing_at": now()}
                await batches.save(connection, finalizing, "in_progress")  # lost to a cancel: closed as cancelled
        while True:
            try:
                async with self.stored.db().transaction() as connection:
                    expired = await self._close(connection, batch_id, status, requests or [], errors)
            except _Changed:
                continue
            for _ in range(expired):
                self.metrics.count_batch_request(True)
            return

    async def _close(
        self,
        connection: AsyncConnection,
        batch_id: str,
        status: str,
        requests: list[BatchRequest],
        errors: list[tuple[str, str]] | None,
    ) -> int:
        """`_end` in one transaction (the files and the status together, or neither): the number of requests
        recorded as expired. Raises _Changed, rolling it all back, if the batch's status changed meanwhile."""
        batch = await batches.get(connection, None, batch_id)
        seen = batch["status"]
        if seen not in batches.RUNNABLE:
            return 0  # closed already, by a replica that took it over
        if seen == "cancelling" and status != "failed":
            status = "cancelled"
        owner = await batches.owner_of(connection, batch_id)
        expired = 0
        if status == "expired":
            recorded = await batches.recorded_lines(connection, batch_id)
            for request in requests:
                if request.line not in recorded:
                    reason = {"code": "batch_expired", "message": "The batch's completion window ended first."}
                    line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id,
                            "response": None, "error": reason}  # fmt: skip
                    await batches.record(connection, batch_id, request.line, request.custom_id, True, line)
                    expired += 1
            if not expired:
                status = "completed"  # its last requests finished just as its window ended
        results = await batches.results(connection, batch_id)
        completed, failed = await batches.counts(connection, batch_id)
        batch["request_counts"].update(completed=completed, failed=failed)
        if requests:  # (a cancel before the batch started left its total unset)
            batch["request_counts"]["total"] = len(requests)
        for failures, kind in ((False, "output"), (True, "error")):
            lines = [json.dumps(result) for error, result in results if error == failures]
            if lines:
                content = ("\n".join(lines) + "\n").encode()
                added = await files.add(connection, owner, "batch_output", f"{batch_id}_{kind}.jsonl", content)
                batch[f"{kind}_file_id"] = added["id"]
        if errors:
            data = [{"code": code, "message": message, "param": None, "line": None} for code, message in errors]
            batch["errors"] = {"object": "list", "data": data}
        closed = now()
        if status != "failed":
            batch["finalizing_at"] = batch["finalizing_at"] or closed
        batch.update(status=status, **{f"{status}_at": closed})
        if not await batches.save(connection, batch, seen, release=True):
            raise _Changed
        return expired


def _batch_request(path: str, owner: str) -> Request:
    """The request a batch's line runs as: marked a batch request, owned by the batch's owner, never disconnected
    (nobody waits on a connection for it)."""
    scope = {
        "type": "http", "method": "POST", "path": path, "headers": [], "query_string": b"",
        BATCH_SCOPE_KEY: True, OWNER_SCOPE_KEY: owner,
    }  # fmt: skip
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.disconnect"}

    return Request(scope, receive)
