"""The FastAPI app: routes, OpenAI-shaped errors for every failure, guards, and the engine's start and stop.

Uvicorn starts serving while the model loads in the background, so /health and /ready answer during loading
(/ready says 503 until the engine is up). Generation routes hand off to server/openai/chat.py and completions.py.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from sqlalchemy.engine import make_url
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from engine.config import EngineConfig
from engine.models.gguf import DENSE_TYPES, source_info
from engine.models.tokenizer import UnsupportedTokenizer
from engine.pooling.config import PoolingConfig
from server.client import EngineClient, EngineDeadError, EngineProcess
from server.lifecycle import Lifecycle, Phase
from server.lora import LoadLoRAAdapterRequest, ServedAdapter, UnloadLoRAAdapterRequest, startup_registry
from server.media import MediaPolicy
from server.metrics import ServerMetrics, rejection_reason
from server.middleware import APIKeyMiddleware, BodySizeLimitMiddleware, RequestIdMiddleware
from server.openai.batches import add_batch_routes
from server.openai.chat import serve_chat_completion
from server.openai.completions import serve_completion
from server.openai.conversations import add_conversation_routes
from server.openai.embeddings import serve_embeddings
from server.openai.errors import (
    ERROR_RESPONSES,
    APIError,
    ErrorResponse,
    internal_error,
    service_unavailable,
    validation_error,
)
from server.openai.files import add_file_routes
from server.openai.generation import ServingContext
from server.openai.harmony import Harmony, load_encoding
from server.openai.images import ImagePrompts
from server.openai.pooling_schemas import (
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from server.openai.responses import serve_response
from server.openai.responses_schemas import ResponseObject, ResponsesRequest
from server.openai.schemas import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelCheckpointQuantization,
    ModelGGUF,
    ModelList,
    ModelPooling,
)
from server.openai.scoring import serve_rerank, serve_score
from server.openai.stored_responses import add_stored_response_routes
from server.openai.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    serve_detokenize,
    serve_tokenize,
)
from server.openai.tool_parsers import detect_tool_call_parser
from server.openai.tool_parsers.hermes import call_tags as hermes_call_tags
from server.openapi import openapi_document
from server.reasoning import ReasoningParser
from server.settings import ServerSettings
from server.state.database import Database, database_url
from server.state.keys import read_keys
from server.state.stored import StoredState
from server.tokens import ChatTemplateError, Tokenizer
from server.ui import mount_ui

logger = logging.getLogger(__name__)

PROMETHEUS_TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""/metrics' format, named exactly: prometheus_client's CONTENT_TYPE_LATEST moved on to 1.0.0, which Prometheus
servers before 3.0 do not know."""

_ERRORS = ERROR_RESPONSES
_UNAVAILABLE: dict[int | str, dict[str, Any]] = {503: {"model": ErrorResponse}}
_JSON_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for status in ("4XX", "5XX")
}
"""The errors of a route that answers text: JSON all the same (a `model` would take the route's text type)."""
_RESPONSES_STREAM: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"description": "With `stream: true`: named events (`event: <type>`, "
                                                           "`data: {event}`), response.created first and "
                                                           "response.completed (or .incomplete, .failed) last, "
                                                           "carrying a ResponseObject."}}},
    **_ERRORS,
}  # fmt: skip


def _stream_response(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A route's responses: JSON, or with `stream: true` SSE events whose data is a `chunk` (then [DONE])."""
    events = {
        "schema": {"$ref": f"#/components/schemas/{chunk.__name__}"},
        "description": "With `stream: true`: `data: {chunk}` events, then `data: [DONE]`.",
    }
    return {200: {"content": {"text/event-stream": events}}, **_ERRORS}  # fmt: skip


class FerryAPI(FastAPI):
    """The app, whose OpenAPI schema also describes the chunks of its streams (no route returns them as JSON)."""

    STREAM_CHUNKS = (ChatCompletionChunk, CompletionResponse)

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            schema = super().openapi()
            _, definitions = models_json_schema(
                [(chunk, "serialization") for chunk in self.STREAM_CHUNKS], ref_template="#/components/schemas/{model}"
            )
            for name, definition in definitions["$defs"].items():
                schema["components"]["schemas"].setdefault(name, definition)
        return self.openapi_schema  # type: ignore[return-value]


def ferry_version() -> str:
    try:
        return importlib.metadata.version("ferry")
    except importlib.metadata.PackageNotFoundError:  # running from a source checkout that was never installed
        return "unknown"


class ServerState:
    """What the routes share: the engine client, the serving logic once loaded, metrics, lifecycle."""

    def __init__(
        self,
        engine_config: EngineConfig,
        settings: ServerSettings,
        lifecycle: Lifecycle,
        engine: EngineProcess | None = None,
    ) -> None:
        self.engine_config = engine_config
        self.settings = settings
        self.lifecycle = lifecycle
        self.model_names = settings.served_model_name or (Path(engine_config.model.path).name,)
        """The base model's names, which clients may send as `model`; the first is the one responses report."""
        self.model_name = self.model_names[0]
        self.adapters = startup_registry(engine_config, settings, self.model_names)
        lora = engine_config.lora
        self.metrics = ServerMetrics(
            self.model_name,
            engine_config.parallel.tensor_parallel_size,
            max_loras=lora.max_loras if lora.enable_lora else None,
        )
        self.gguf_card: ModelGGUF | None = None
        """The card's account of the GGUF file the model came from, once the engine is ready (None: a directory)."""
        self.created = int(time.time())
        self.client = EngineClient(
            engine_config,
            log_level=settings.log_level,
            log_format=settings.log_format,
            step_log=settings.step_log,
            on_stats=self.metrics.observe_engine_stats,
            on_death=lifecycle.fail,
            engine=engine,
        )
        self.serving: ServingContext | None = None
        self.stored = StoredState(settings)

    async def open_database(self) -> bool:
        """Open the state database and apply its migrations; False (the lifecycle failed, saying why) if not."""
        url = database_url(self.settings.database_url, self.settings.state_dir)
        try:
            self.stored.database = await Database.open(url)
        except Exception as exc:
            logger.error("Cannot open the state database (%s): %s", _shown_url(url), exc)
            self.lifecycle.fail()
            return False
        logger.info("Stored state in %s", _shown_url(url))
        return True

    async def load(self) -> None:
        """Start the engine first (spawning it, unless `ferry serve` did), so that it loads the model while this
        process loads the tokenizer."""
        try:
            self.client.start()
            tokenizer = await asyncio.to_thread(
                Tokenizer.load, self.settings.tokenizer or self.engine_config.model.path
            )
            reasoning = ReasoningParser.for_model(self.settings.reasoning_parser, tokenizer)
            # What exists now lives as long as the server: spare the collector from rescanning it. Done while the
            # engine still loads (0.1 s of the demo model's start, when done after).
            gc.collect()
            gc.freeze()
            info = await self.client.wait_ready()
        except EngineDeadError:
            return  # the client has already reported the death to the lifecycle
        except UnsupportedTokenizer as exc:
            logger.error("Cannot serve this model: %s", exc)
            self.lifecycle.fail()
            return
        except Exception:
            logger.exception("Failed to start serving")
            self.lifecycle.fail()
            return
        chat_format = self.settings.chat_format
        harmony = None
        if chat_format == "harmony" or (chat_format == "auto" and info.model_type == "gpt_oss"):
            try:
                harmony = Harmony(await asyncio.to_thread(load_encoding))
            except Exception:
                logger.exception("Cannot load gpt-oss's Harmony encoding")
                self.lifecycle.fail()
                return
            reasoning = None  # Harmony reads reasoning and calls by channel, not by the template's markers
            for flag, value in (("--reasoning-parser", self.settings.reasoning_parser),
                                ("--tool-call-parser", self.settings.tool_call_parser)):  # fmt: skip
                if value != "auto":
                    logger.warning("%s %s is not used: gpt-oss's Harmony format reads replies itself", flag, value)
        parser = None if harmony else resolve_tool_call_parser(self.settings.tool_call_parser, tokenizer)
        images = None
        if info.max_images:
            policy = MediaPolicy.of(
                self.settings.allowed_media_domains, self.settings.max_image_bytes, self.settings.media_fetch_timeout
            )
            try:
                images = await asyncio.to_thread(ImagePrompts, self.engine_config.model.path, policy, info.max_images)
            except Exception:
                logger.exception("Cannot load the image model's processor")
                self.lifecycle.fail()
                return
        self.serving = ServingContext(
            client=self.client,
            tokenizer=tokenizer,
            model_dir=self.engine_config.model.path,
            metrics=self.metrics,
            lifecycle=self.lifecycle,
            model_names=self.model_names,
            adapters=self.adapters,
            max_model_len=info.max_model_len,
            request_timeout=self.settings.request_timeout or None,
            sse_ping=self.settings.sse_ping_interval,
            reasoning=reasoning,
            tool_call_parser=parser,
            call_tags=_call_tags(parser, tokenizer),
            pooling=info.pooling,
            max_batch_tokens=self.engine_config.scheduler.max_batch_tokens,
            max_queue_size=self.engine_config.scheduler.max_queue_size,
            reranker_template=self.engine_config.model.reranker_template,
            stored=self.stored,
            harmony=harmony,
            images=images,
        )
        self.lifecycle.on_drain_timeout = lambda: self.client.fail_all(
            service_unavailable("The server shut down before the request finished.", "shutting_down")
        )
        self.metrics.set_model_info(info.weight_bytes, info.quantization, info.kv_cache_dtype)
        stored_format = info.checkpoint_quantization[0] if info.checkpoint_quantization else None
        self.gguf_card = _model_gguf(source_info(self.engine_config.model.path), kept=stored_format == "gguf")
        self.lifecycle.set_ready()
        logger.info(
            "Serving %s (max_model_len=%d, %s, %s)",
            self.model_name,
            info.max_model_len,
            _served_tasks(info.pooling),
            "chat format: harmony"
            if harmony
            else f"reasoning parser: {reasoning.name if reasoning else 'none'}, "
            f"tool-call parser: {self.serving.tool_call_parser or 'none'}",
        )
        if self.adapters.adapters:
            logger.info("LoRA adapters: %s", ", ".join(adapter.request.name for adapter in self.adapters.adapters))
        if self.settings.ui:
            logger.info("Playground and engine view: http://%s:%d/", self.settings.host, self.settings.port)

    def get_serving(self) -> ServingContext:
        if self.serving is None:
            self.lifecycle.check_accepting()
            raise service_unavailable("The engine is not running.", "engine_dead")
        return self.serving

    @property
    def healthy(self) -> bool:
        if self.lifecycle.phase is Phase.DEAD:
            return False
        return self.lifecycle.phase is Phase.LOADING or self.client.healthy


# The request bodies: their own JSON schemas go into the OpenAPI document (server/openapi.py); create_app adds the
# LoRA endpoints' where it serves them.
_REQUEST_MODELS: list[type[BaseModel]] = [
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    DetokenizeRequest,
]


class _FerryApp(FastAPI):
    """FastAPI with the request-id middleware around its whole stack, Starlette's own error middleware included,
    so that every response (an unhandled error's 500 too) carries X-Request-Id; and an OpenAPI document that says
    exactly what the server accepts, the chunks of its streams included (no route returns them as JSON)."""

    STREAM_CHUNKS = (ChatCompletionChunk, CompletionResponse)

    def __init__(
        self, request_models: list[type[BaseModel]], model_names: tuple[str, ...] | None, **options: Any
    ) -> None:
        """`request_models`: the request bodies, whose own schemas the document gives; `model_names`: what requests
        may send as `model` (None: names that change while serving, so the document lists none)."""
        super().__init__(**options)
        self.request_models = request_models
        self.model_names = model_names

    def build_middleware_stack(self) -> ASGIApp:
        return RequestIdMiddleware(super().build_middleware_stack())

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            schema = openapi_document(self, self.request_models, self.model_names)
            _, definitions = models_json_schema(
                [(chunk, "serialization") for chunk in self.STREAM_CHUNKS], ref_template="#/components/schemas/{model}"
            )
            for name, definition in definitions["$defs"].items():
                schema["components"]["schemas"].setdefault(name, definition)
            self.openapi_schema = schema
        return self.openapi_schema


def _shown_url(url: str) -> str:
    """A database URL for the log: its password hidden."""
    return make_url(url).render_as_string(hide_password=True)


def _served_tasks(pooling: PoolingConfig | None) -> str:
    """What the model answers, for the start-up log line."""
    if pooling is None:
        return "generates"
    pools = {"embed": "embeddings", "classify": "cross-encoder scores", "yes_no": "yes/no reranker scores"}
    return pools[pooling.kind] + (" and generates" if pooling.generates else "")


def _model_gguf(source: dict[str, Any] | None, kept: bool) -> ModelGGUF | None:
    """The card's account of the GGUF file the model came from (None, so absent, for a model directory): which of
    its quantized types run as stored (`kept`: the engine runs the file's codes, engine/quantization/gguf.py),
    which were dequantized as they loaded."""
    if source is None:
        return None
    types: dict[str, int] = source["tensor_types"]
    if kept:
        kept_types, dequantized = source["kept_types"], source["dequantized_types"]
    else:
        kept_types, dequantized = [], sorted(name for name in types if name not in DENSE_TYPES)
    return ModelGGUF(file=Path(source["file"]).name, tensor_types=types, dequantized=dequantized, kept=kept_types)


def _model_pooling(pooling: PoolingConfig | None) -> ModelPooling | None:
    """The card's account of what the model pools (None, so absent, for a model that only generates)."""
    if pooling is None:
        return None
    matryoshka = pooling.matryoshka_dimensions
    return ModelPooling(
        kind=pooling.kind,
        dimensions=pooling.dimensions,
        matryoshka_dimensions=list(matryoshka) if matryoshka is not None else None,
        generates=pooling.generates,
    )


def _call_tags(parser: str | None, tokenizer: Tokenizer) -> tuple[str, str] | None:
    """The model's own call format where the grammar can write it: Hermes calls as its chat template writes
    them (a template that renders no such call, or rejects one, or tags that are single tokens, leave enforced
    calls in the JSON-array form)."""
    if parser != "hermes" or tokenizer.chat_template is None:
        return None

    def render(call: dict[str, Any]) -> str:
        tool = {"type": "function", "function": {"name": call["name"], "parameters": {"type": "object"}}}
        turn = {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": call}]}
        messages = [{"role": "user", "content": "x"}, turn]
        return tokenizer.render_chat_template(messages, add_generation_prompt=False, tools=[tool])

    try:
        tags = hermes_call_tags(render)
    except ChatTemplateError:
        return None
    # A tag that is one added token of the vocabulary (Qwen's are) is read back through the detokenizer's kept
    # markers, not as text: those models keep the JSON-array form.
    if tags is None or any(len(tokenizer.encode(tag.strip(), add_special_tokens=False)) == 1 for tag in tags):
        return None
    return tags


def resolve_tool_call_parser(setting: str, tokenizer: Tokenizer) -> str | None:
    """`--tool-call-parser`: a parser's name as given, `auto` the one the chat template shows, `none` None."""
    if setting == "auto":
        return detect_tool_call_parser(tokenizer.chat_template)
    return None if setting == "none" else setting


def create_app(
    engine_config: EngineConfig, settings: ServerSettings, lifecycle: Lifecycle, engine: EngineProcess | None = None
) -> FastAPI:
    """`engine`: the engine process when it was spawned already (`ferry serve` spawns it before importing this
    module); the app's start-up spawns it otherwise."""
    state = ServerState(engine_config, settings, lifecycle, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        lifecycle.attach(asyncio.get_running_loop())
        if not await state.open_database():
            yield
            return
        loading = asyncio.create_task(state.load())
        jobs = [asyncio.create_task(job()) for job in state.stored.jobs]
        try:
            yield
        finally:
            loading.cancel()
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            for hook in state.stored.on_shutdown:
                await hook()
            await state.client.shutdown()
            await state.stored.db().close()

    runtime_lora = settings.allow_runtime_lora_updating
    lora_requests = [LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest] if runtime_lora else []
    # With adapters loaded and unloaded while serving, the names `model` takes change: the document lists none.
    names = None if runtime_lora else (*state.model_names, *(a.request.name for a in state.adapters.adapters))
    app = _FerryApp(
        [*_REQUEST_MODELS, *lora_requests], names, title="Ferry", version=ferry_version(), lifespan=lifespan
    )
    _add_error_handlers(app, state.metrics)
    # Starlette runs the last-added middleware first: the key check comes before reading any body.
    # An upload to /v1/files has a limit of its own: --max-file-bytes for the file (checked by the route), and a
    # mebibyte for the multipart form around it.
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=settings.max_request_bytes,
        metrics=state.metrics,
        uploads={("POST", "/v1/files"): settings.max_file_bytes + 2**20},
    )
    api_keys = read_keys(settings.api_key, settings.api_keys_file)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys, metrics=state.metrics)

    @app.post(
        "/v1/chat/completions", response_model=ChatCompletionResponse, responses=_stream_response(ChatCompletionChunk)
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await serve_chat_completion(state.get_serving(), body, request)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_stream_response(CompletionResponse))
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await serve_completion(state.get_serving(), body, request)

    @app.post("/v1/responses", response_model=ResponseObject, responses=_RESPONSES_STREAM)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        """The Responses API: stored by default, and continued by `previous_response_id`."""
        return await serve_response(state.get_serving(), body, request)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
        """OpenAI's embeddings, from a pooling model (sentence-transformers' prompts and vLLM's extras too)."""
        return await serve_embeddings(state.get_serving(), body, request)

    @app.post("/v1/rerank", response_model=RerankResponse, responses=_ERRORS)
    @app.post("/v2/rerank", response_model=RerankResponse, responses=_ERRORS)
    @app.post("/rerank", response_model=RerankResponse, responses=_ERRORS)
    async def rerank(body: RerankRequest, request: Request) -> Response:
        """Jina's and Cohere's rerank: documents ranked by relevance to a query, best first."""
        return await serve_rerank(state.get_serving(), body, request)

    @app.post("/v1/score", response_model=ScoreResponse, responses=_ERRORS)
    @app.post("/score", response_model=ScoreResponse, responses=_ERRORS)
    async def score(body: ScoreRequest, request: Request) -> Response:
        """vLLM's score: one text against many, or two lists pairwise."""
        return await serve_score(state.get_serving(), body, request)

    def model_card(name: str, adapter: ServedAdapter | None = None) -> ModelCard:
        """The base model's card under `name`, or an adapter's: the base's numbers (it runs on them), with its
        directory as `root` and the model it adapts as `parent`, as vLLM's cards have them."""
        serving = state.get_serving()
        info = state.client.info
        assert info is not None  # serving exists only once the engine reported ready
        tensor_parallel_size = engine_config.parallel.tensor_parallel_size
        stored = info.checkpoint_quantization
        checkpoint = None if stored is None else ModelCheckpointQuantization(format=stored[0], weights=stored[1])
        return ModelCard(
            id=name,
            created=state.created,
            root=adapter.request.path if adapter else None,
            parent=adapter.parent if adapter else None,
            max_model_len=serving.max_model_len,
            tensor_parallel_size=tensor_parallel_size if tensor_parallel_size > 1 else None,
            quantization=info.quantization,
            checkpoint_quantization=checkpoint,
            weight_bytes=info.weight_bytes,
            kv_cache_dtype=info.kv_cache_dtype,
            pooling=None if adapter else _model_pooling(info.pooling),
            gguf=None if adapter else state.gguf_card,
        )

    # A field left None (tensor_parallel_size on one device) is left out, as OpenAI's cards carry no nulls.
    @app.get("/v1/models", responses=_ERRORS, response_model_exclude_none=True)
    async def list_models() -> ModelList:
        """The base model under each served name, then every LoRA adapter."""
        cards = [model_card(name) for name in state.model_names]
        return ModelList(data=cards + [model_card(a.request.name, a) for a in state.adapters.adapters])

    @app.get("/v1/models/{model_id:path}", responses=_ERRORS, response_model_exclude_none=True)
    async def retrieve_model(model_id: str) -> ModelCard:
        if model_id in state.model_names:
            return model_card(model_id)
        adapter = state.adapters.get(model_id)
        if adapter is None:
            raise APIError(404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found")
        return model_card(model_id, adapter)

    if settings.allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_JSON_ERRORS)
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
            """vLLM's: serve a LoRA adapter under a new name (or, with load_inplace, new files under a name)."""
            await state.adapters.load(body)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_JSON_ERRORS)
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            """vLLM's: stop serving a LoRA adapter; requests already running with it finish with it."""
            state.adapters.unload(body)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's: a prompt or a conversation (through the chat template) to the model's token ids."""
        return serve_tokenize(state.get_serving(), body)

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's: token ids to the text they stand for (special tokens included)."""
        return serve_detokenize(state.get_serving(), body)

    @app.get("/health", responses=_UNAVAILABLE)
    async def health() -> JSONResponse:
        """Liveness: 200 while the engine process is alive and its loop makes progress."""
        if state.healthy:
            return JSONResponse({"status": "ok"})
        return service_unavailable("The engine is not running.", "engine_dead").response()

    @app.get("/ready", responses=_UNAVAILABLE)
    async def ready() -> JSONResponse:
        """Readiness: 200 only when new requests are accepted (not while loading or draining)."""
        try:
            lifecycle.check_accepting()
        except APIError as exc:
            return exc.response()
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus' text exposition format, version 0.0.4 (what every Prometheus scrapes)."""
        return Response(state.metrics.render(), media_type=PROMETHEUS_TEXT_CONTENT_TYPE)

    @app.get("/metrics.json")
    async def metrics_json() -> dict[str, Any]:
        """The headline numbers of /metrics as one JSON object (what the built-in page's engine view reads)."""
        return state.metrics.snapshot()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": ferry_version()}

    add_stored_response_routes(app, state.stored)
    add_conversation_routes(app, state.stored, lambda: state.serving is not None and state.serving.images is not None)
    add_file_routes(app, state.stored)
    add_batch_routes(app, state.stored, state.get_serving, state.metrics)

    if settings.ui:
        mount_ui(app)

    return app


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def respond(error: APIError) -> JSONResponse:
        reason = rejection_reason(error.status_code)
        if reason is not None:
            metrics.count_rejection(reason)
        return error.response()

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return respond(exc)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return respond(validation_error(exc.errors()))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        # Unknown routes and wrong methods: not API requests, so not counted as rejections.
        assert isinstance(exc, StarletteHTTPException)
        error = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
        return error.response()

    async def on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("Unhandled error on %s", request.url.path, exc_info=exc)
        return internal_error().response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)
