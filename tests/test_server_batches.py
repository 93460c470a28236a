"""The Files and Batch APIs end to end: the official OpenAI SDK against a real `ferry serve`, its state in SQLite
and in a real PostgreSQL server. A batch's answers equal the same requests sent directly (greedy); bad lines land
in the error file and never stop it; interactive requests are admitted ahead of a running batch's (read from
the engine's step log, in scheduling order); a server stopped (at once resumed) or killed (once its lease runs out)
mid-batch resumes it on restart with every request's result recorded once, even by replicas racing to record it;
a line the server turns away (full queue, stopping) is no failure; two keys never see each other's files or
batches."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy.exc import IntegrityError
from starlette.requests import Request
from starlette.responses import JSONResponse

from server.metrics import ServerMetrics
from server.openai import batches as batches_api
from server.openai.errors import APIError, service_unavailable
from server.openai.generation import is_batch
from server.openai.schemas import CompletionRequest
from server.settings import ServerSettings
from server.state import batches, files
from server.state.database import Database, database_url
from server.state.keys import request_owner
from server.state.stored import StoredState
from tests.postgres_server import PostgresServer
from tests.server_harness import ServerProcess, metric, metric_samples, server_process

MODEL = "tiny"
KEY_A, KEY_B = "key-a", "key-b"
MAX_FILE_BYTES = 200_000
PROMPTS = [f"The number {i} is" for i in range(200)]


def _lines(url: str, bodies: list[dict[str, Any]]) -> bytes:
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body} for i, body in enumerate(bodies)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}


def _serve(model: Path, keys: Path, *extra: str) -> Any:
    return server_process(
        model, "--served-model-name", MODEL, "--api-keys-file", str(keys), "--max-file-bytes", str(MAX_FILE_BYTES),
        "--batch-concurrency", "4", "--max-num-seqs", "4", "--log-level", "warning", *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(f"# two teams\n{KEY_A}\n{KEY_B}\n")
    return path


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest, model_dir: Callable[[str], Path], keys: Path) -> Iterator[ServerProcess]:
    extra: tuple[str, ...] = ()
    if request.param == "postgresql":
        postgres: PostgresServer = request.getfixturevalue("postgres")
        extra = ("--database-url", postgres.new_database())
    with _serve(model_dir("llama"), keys, *extra) as running:
        yield running


def _client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def _wait(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} is still {batch.status}")


def _jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [] if file_id is None else [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_answers_as_the_requests_sent_directly(server: ServerProcess) -> None:
    client = _client(server, KEY_A)
    bodies = [_completion(prompt) for prompt in PROMPTS]
    uploaded = client.files.create(
        file=("requests.jsonl", io.BytesIO(_lines("/v1/completions", bodies))), purpose="batch"
    )
    assert (uploaded.purpose, uploaded.filename, uploaded.status) == ("batch", "requests.jsonl", "processed")
    assert client.files.retrieve(uploaded.id).bytes == uploaded.bytes
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h", metadata={"run": "one"}
    )
    assert batch.status == "validating" and batch.metadata == {"run": "one"}
    assert batch.id in [b.id for b in client.batches.list()]
    done = _wait(client, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (200, 200, 0)
    assert done.error_file_id is None and done.in_progress_at and done.completed_at
    output = _jsonl(client, done.output_file_id)
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(200)]  # the input's order
    direct = [client.completions.create(**body) for body in bodies]
    for line, answer in zip(output, direct, strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["choices"][0]["text"] == answer.choices[0].text
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    with httpx.Client(base_url=server.base_url) as http:
        samples = metric_samples(http)
    assert metric(samples, "ferry:batch_requests_total", model_name=MODEL, outcome="completed") >= 200
    assert metric(samples, "ferry:batches", model_name=MODEL, status="completed") >= 1
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_bad_lines_land_in_the_error_file_and_never_stop_the_batch(server: ServerProcess) -> None:
    client = _client(server, KEY_A)
    bodies = [_completion("one"), _completion("two", max_tokens=-1), _completion("three", no_such_field=1),
              _completion("four")]  # fmt: skip
    uploaded = client.files.create(file=("mixed.jsonl", _lines("/v1/completions", bodies)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    done = _wait(client, batch.id, ("completed", "failed"))
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 2)
    assert [line["custom_id"] for line in _jsonl(client, done.output_file_id)] == ["req-0", "req-3"]
    errors = _jsonl(client, done.error_file_id)
    assert [line["custom_id"] for line in errors] == ["req-1", "req-2"]
    assert all(line["response"]["status_code"] == 400 for line in errors)
    assert "max_tokens" in json.dumps(errors[0]) and "no_such_field" in json.dumps(errors[1])
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY_A}"}) as http:
        for line, body in zip(errors, bodies[1:3], strict=True):  # the very 400 the route answers the same body
            assert line["response"]["body"] == http.post("/v1/completions", json=body).json()


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\nnot json\n', "Line 2"),
        (b'{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}\n', "Line 1.*method"),
        (_lines("/v1/completions", [{}]) + _lines("/v1/completions", [{}]), "Line 2.*custom_id 'req-0'"),
    ],
)
def test_a_malformed_batch_file_is_refused_naming_its_line(server: ServerProcess, content: bytes, match: str) -> None:
    with pytest.raises(openai.BadRequestError, match=match):
        _client(server, KEY_A).files.create(file=("bad.jsonl", content), purpose="batch")


def test_limits_and_a_batch_for_another_endpoint(server: ServerProcess) -> None:
    client = _client(server, KEY_A)
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert too_large.value.status_code == 413
    # Past the form's limit (the file's and a mebibyte) the upload is cut off as it streams in, unbuffered.
    part = b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
    chunks = itertools.chain([part], (b"x" * 2**16 for _ in range((MAX_FILE_BYTES + 2**20) // 2**16 + 2)))
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY_A}"}) as http:
        streamed = http.post("/v1/files", content=chunks, headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert (streamed.status_code, streamed.json()["error"]["code"]) == (413, "request_too_large")
    uploaded = client.files.create(file=("c.jsonl", _lines("/v1/completions", [_completion("x")])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="another endpoint"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def test_two_keys_never_see_each_others_files_or_batches(server: ServerProcess) -> None:
    a, b = _client(server, KEY_A), _client(server, KEY_B)
    uploaded = a.files.create(file=("mine.jsonl", _lines("/v1/completions", [_completion("x")])), purpose="batch")
    batch = a.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    for read in (lambda: b.files.retrieve(uploaded.id), lambda: b.files.content(uploaded.id),
                 lambda: b.files.delete(uploaded.id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                          completion_window="24h")):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            read()
    assert uploaded.id not in [f.id for f in b.files.list()] and batch.id not in [x.id for x in b.batches.list()]
    assert a.files.retrieve(uploaded.id).id == uploaded.id
    _wait(a, batch.id, ("completed",))


def test_a_cancelled_batch_keeps_what_it_did(server: ServerProcess) -> None:
    client = _client(server, KEY_A)
    bodies = [_completion(prompt, max_tokens=16) for prompt in PROMPTS]
    uploaded = client.files.create(file=("many.jsonl", _lines("/v1/completions", bodies)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    _wait(client, batch.id, ("in_progress",))
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = _wait(client, batch.id, ("cancelled",))
    assert done.cancelled_at and done.request_counts.completed < 200
    assert len(_jsonl(client, done.output_file_id)) == done.request_counts.completed
    with pytest.raises(openai.APIStatusError) as again:
        client.batches.cancel(batch.id)
    assert again.value.status_code == 409


def test_interactive_requests_are_scheduled_ahead_of_a_running_batch(
    model_dir: Callable[[str], Path], keys: Path, tmp_path: Path
) -> None:
    """Read from the engine's step log: the waiting queue each step was planned from, and whom it admitted. Two
    sequences a step and eight batch requests in flight keep six of them waiting throughout; each interactive
    request sent meanwhile must be admitted while batch requests that came before it still wait, and no step
    may admit a batch request while an interactive one is left waiting."""
    steps_path = tmp_path / "steps.jsonl"
    server_flags = ("--max-num-seqs", "2", "--batch-concurrency", "8", "--step-log", str(steps_path))
    with _serve(model_dir("llama"), keys, *server_flags) as server:
        client = _client(server, KEY_A)
        bodies = [_completion(prompt, max_tokens=24) for prompt in PROMPTS]
        uploaded = client.files.create(file=("long.jsonl", _lines("/v1/completions", bodies)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while not _batch_requests_waiting(steps_path):
            assert time.monotonic() < deadline, "the batch did not start"
            time.sleep(0.05)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda body: client.completions.create(**body), bodies[:4]))
        assert all(answer.choices[0].text for answer in answers)
        done = _wait(client, batch.id, ("completed",))
        assert done.request_counts.completed == len(bodies)
    steps = [json.loads(line) for line in steps_path.read_text().splitlines()]
    waited: set[str] = set()  # interactive requests seen waiting
    ahead: set[str] = set()  # ... and admitted while batch requests stayed in the queue
    for step in steps:
        scheduled = {request_id for request_id, _, _ in step["scheduled"]}
        admitted = [(request_id, batch) for request_id, batch in step["queue"] if request_id in scheduled]
        left = [(request_id, batch) for request_id, batch in step["queue"] if request_id not in scheduled]
        waited |= {request_id for request_id, batch in step["queue"] if not batch}
        if any(batch for _, batch in admitted):
            assert all(batch for _, batch in left), f"a batch request admitted before an interactive one: {step}"
        if any(batch for _, batch in left):
            ahead |= {request_id for request_id, batch in admitted if not batch}
    assert len(waited) == 4 and ahead == waited, (waited, ahead)
    assert sum(batch for step in steps for _, batch in step["queue"]) > 0


def _batch_requests_waiting(steps_path: Path) -> bool:
    """Whether the engine's last step was planned with batch requests waiting (the log's last whole line)."""
    lines = steps_path.read_text().splitlines() if steps_path.exists() else []
    return len(lines) > 1 and any(batch for _, batch in json.loads(lines[-2])["queue"])


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_result_is_recorded_once_when_two_replicas_race_to_record_it(
    dialect: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if dialect == "sqlite":
        url = database_url(None, str(tmp_path))
    else:
        url = database_url(request.getfixturevalue("postgres").new_database(), None)

    async def race() -> None:
        database = await Database.open(url)
        batch = batches.new_batch("owner", "/v1/completions", "file_x", None)
        async with database.transaction() as connection:
            await batches.add(connection, "owner", batch)

        async def record(replica: int) -> bool:
            try:
                async with database.transaction() as connection:
                    return await batches.record(connection, batch["id"], 1, "same", False, {"replica": replica})
            except IntegrityError:  # the insert that lost the race (both found no row first)
                return False

        assert sorted(await asyncio.gather(*(record(replica) for replica in range(8)))) == [False] * 7 + [True]
        with pytest.raises(RuntimeError):  # a rolled-back transaction records nothing, however it recorded it
            async with database.transaction() as connection:
                assert await batches.record(connection, batch["id"], 2, "other", True, {})
                raise RuntimeError
        async with database.transaction() as connection:
            assert await batches.recorded_lines(connection, batch["id"]) == {1}
        await database.close()

    asyncio.run(race())


def test_a_line_the_server_turns_away_runs_again_later_and_is_no_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process, the runner over a stand-in endpoint: a full queue (429) is retried, a server that stops
    taking requests (503) leaves the batch to resume, lease given back; neither is recorded as the line's result."""
    calls: Counter[str] = Counter()
    stopping = True

    async def serve(ctx: Any, body: CompletionRequest, request: Request) -> JSONResponse:
        assert is_batch(request) and request_owner(request) == "owner" and body.stream is False
        calls[body.prompt] += 1
        if body.prompt == "busy" and calls["busy"] <= 2:
            raise APIError(429, "The queue is full.", code="queue_full", headers={"Retry-After": "0"})
        if body.prompt == "stopping" and stopping:
            raise service_unavailable("The server is shutting down.", "draining")
        return JSONResponse({"text": body.prompt})

    monkeypatch.setitem(batches_api._ENDPOINTS, "/v1/completions", (CompletionRequest, serve))
    serving = SimpleNamespace(lifecycle=SimpleNamespace(check_accepting=lambda: None))
    stored = StoredState(ServerSettings(batch_concurrency=1))
    runner = batches_api.BatchRunner(stored, lambda: serving, ServerMetrics(MODEL))  # type: ignore[arg-type]

    async def run(prompts: list[str]) -> tuple[bool, dict[str, Any], list[bool]]:
        """Upload a batch of `prompts`, claim it and work it once: (closed, the batch, its results' errors)."""
        async with stored.db().transaction() as connection:
            content = _lines("/v1/completions", [_completion(prompt, stream=True) for prompt in prompts])
            uploaded = await files.add(connection, "owner", "batch", "in.jsonl", content)
            batch = batches.new_batch("owner", "/v1/completions", uploaded["id"], None)
            await batches.add(connection, "owner", batch)
        async with stored.db().transaction() as connection:
            assert await batches.claim(connection, stored.worker) == batch["id"]
        closed = await runner._work(batch["id"])
        async with stored.db().transaction() as connection:
            results = [error for error, _ in await batches.results(connection, batch["id"])]
            return closed, await batches.get(connection, None, batch["id"]), results

    async def scenario() -> None:
        nonlocal stopping
        stored.database = await Database.open(database_url(None, str(tmp_path)))
        closed, busy, results = await run(["a", "busy", "c"])
        assert closed and busy["status"] == "completed" and results == [False] * 3 and calls["busy"] == 3
        closed, left, results = await run(["x", "stopping", "y"])
        assert not closed and left["status"] == "in_progress" and results == [False]  # "x" only
        async with stored.db().transaction() as connection:
            assert await batches.claim(connection, "another_replica") == left["id"]  # its lease was given back
            await batches.release(connection, "another_replica")
            assert await batches.claim(connection, stored.worker) == left["id"]
        stopping = False
        assert await runner._work(left["id"])
        async with stored.db().transaction() as connection:
            resumed = await batches.get(connection, None, left["id"])
            output = (await files.content(connection, "owner", resumed["output_file_id"]) or b"").splitlines()
        assert resumed["status"] == "completed" and resumed["request_counts"]["completed"] == 3
        assert [json.loads(line)["response"]["body"]["text"] for line in output] == ["x", "stopping", "y"]
        assert calls["x"] == 1  # recorded before the stop: not run again
        await stored.db().close()

    asyncio.run(scenario())


def _recorded(state: Path, batch_id: str) -> list[tuple[str, bool]]:
    """The batch's result rows as the database holds them: (custom_id, error)."""
    with sqlite3.connect(state / "ferry.db", timeout=10) as database:
        query = "SELECT custom_id, error FROM batch_results WHERE batch_id = ?"
        return [(custom_id, bool(error)) for custom_id, error in database.execute(query, (batch_id,)).fetchall()]


def _wait_recorded(state: Path, batch_id: str, rows: int, timeout: float) -> None:
    """Until the batch has `rows` results recorded (the rows themselves: the batch's counts lag up to a second)."""
    deadline = time.monotonic() + timeout
    while len(_recorded(state, batch_id)) < rows:
        assert time.monotonic() < deadline, f"fewer than {rows} results after {timeout}s"
        time.sleep(0.02)


def test_a_server_stopped_or_killed_mid_batch_resumes_it_and_records_each_result_once(
    model_dir: Callable[[str], Path], keys: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    restartable = ("--state-dir", str(state))
    bodies = [_completion(prompt, max_tokens=16) for prompt in PROMPTS]
    with _serve(model_dir("llama"), keys, *restartable) as first:
        client = _client(first, KEY_A)
        uploaded = client.files.create(file=("r.jsonl", _lines("/v1/completions", bodies)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        _wait_recorded(state, batch.id, 20, timeout=120)
        assert first.stop() == 0  # SIGTERM: the lines in flight finish, the next ones wait for the restart
    stopped = _recorded(state, batch.id)
    assert 20 <= len(stopped) < 200, "stopped mid-batch"
    assert not any(error for _, error in stopped), "a line the draining server turned away is no failure"
    with _serve(model_dir("llama"), keys, *restartable) as second:
        # The stopped server gave its lease back: the batch resumes at once, not when the lease would run out.
        _wait_recorded(state, batch.id, len(stopped) + 20, timeout=10)
        client = _client(second, KEY_A)
        late = client.files.create(file=("late.jsonl", _lines("/v1/completions", bodies[:3])), purpose="batch")
        queued = client.batches.create(input_file_id=late.id, endpoint="/v1/completions", completion_window="24h")
        second.process.send_signal(signal.SIGKILL)  # no shutdown: its lease must run out
        second.process.wait()
    killed = len(_recorded(state, batch.id))
    assert killed < 200, "killed mid-batch"
    with sqlite3.connect(state / "ferry.db") as database:  # the queued batch's 24 hours are over
        database.execute("UPDATE batches SET batch = json_set(batch, '$.expires_at', 0) WHERE id = ?", (queued.id,))
    with _serve(model_dir("llama"), keys, *restartable) as third:
        client = _client(third, KEY_A)
        done = _wait(client, batch.id, ("completed", "failed"), timeout=180)
        assert done.status == "completed" and done.request_counts.completed == 200
        output = _jsonl(client, done.output_file_id)
        direct = [client.completions.create(**body).choices[0].text for body in bodies[:5]]
        expired = _wait(client, queued.id, ("expired",))
        assert expired.expired_at and (expired.request_counts.total, expired.request_counts.failed) == (3, 3)
        assert [line["error"]["code"] for line in _jsonl(client, expired.error_file_id)] == ["batch_expired"] * 3
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(200)]
    assert [line["response"]["body"]["choices"][0]["text"] for line in output[:5]] == direct
    rows = _recorded(state, batch.id)
    assert len(rows) == 200 and len(set(rows)) == 200
