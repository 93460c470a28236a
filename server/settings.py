"""Options of the HTTP server itself (the engine's live in engine.config.EngineConfig).

As there, each field's docstring is its `ferry serve --help` text and its metadata the help section it is listed
under (server/flags.py turns every field into a flag).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from server.reasoning import ReasoningParserName

LogLevel = Literal["critical", "error", "warning", "info", "debug"]
LogFormat = Literal["text", "json"]
ToolCallParserName = Literal["auto", "none", "hermes", "kimi_k2", "llama3_json", "mistral"]
ChatFormatName = Literal["auto", "template", "harmony"]

_MODEL = {"group": "model"}
_SERVER = {"group": "server"}
_LORA = {"group": "LoRA adapters"}
_MEDIA = {"group": "images"}
_STATE = {"group": "stored state"}
"""The help section of what outlives a request: stored responses, conversations, files, batches (server/state/)."""
"""The help section engine.config.LoRAConfig's flags are listed under."""


@dataclass(frozen=True)
class LoRAModule:
    """One adapter of --lora-modules: `name=path`, or vLLM's JSON form `{"name", "path", "base_model_name"}`."""

    name: str
    """What requests send as `model` to use it."""
    path: str
    """The directory PEFT saved it in."""
    base_model_name: str | None = None
    """The served name /v1/models gives as its `parent`; None: the first served name."""

    def __post_init__(self) -> None:
        if not self.name or not self.path:
            raise ValueError(f"a LoRA module needs a name and a path, got name={self.name!r} path={self.path!r}")

    @classmethod
    def from_flag(cls, text: str) -> LoRAModule:
        if not text.lstrip().startswith("{"):
            name, equals, path = text.partition("=")
            if not equals:
                raise ValueError(f"{text!r} is neither name=path nor a JSON object")
            return cls(name, path)
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{text!r} is not JSON: {error}") from None
        if not isinstance(values, dict) or set(values) - {"name", "path", "base_model_name"}:
            raise ValueError(f"{text!r}: the JSON form is an object of name, path and base_model_name")
        if not all(isinstance(values.get(key, ""), str) for key in ("name", "path")):
            raise ValueError(f"{text!r}: name and path are strings")
        if not isinstance(values.get("base_model_name"), str | None):
            raise ValueError(f"{text!r}: base_model_name is a string")
        return cls(values.get("name", ""), values.get("path", ""), values.get("base_model_name"))


@dataclass(frozen=True)
class ServerSettings:
    host: str = field(default="127.0.0.1", metadata=_SERVER)
    """Address to listen on (0.0.0.0 for all interfaces, e.g. in a container)."""
    port: int = field(default=8000, metadata=_SERVER)
    """Port to listen on."""
    api_key: str | None = field(default=None, metadata=_SERVER)
    """Require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize (probes and /metrics stay open).
    `ferry serve` falls back to $FERRY_API_KEY, which keeps the key out of `ps` output and shell history; neither
    means no key."""
    ui: bool = field(default=True, metadata=_SERVER)
    """Serve the built-in chat playground and engine view at / (with --no-ui, / and /ui/* answer 404)."""
    served_model_name: tuple[str, ...] | None = field(default=None, metadata=_MODEL)
    """Names clients may send as `model`, one or several (`--served-model-name a b`); responses report the first.
    By default --model as given: the Hub id, or the model directory's name."""
    tokenizer: str | None = field(default=None, metadata=_MODEL)
    """Tokenizer to use instead of the model's own: a local directory or a Hugging Face Hub id."""
    revision: str | None = field(default=None, metadata=_MODEL)
    """Revision of a Hub --model: a branch, a tag or a commit (by default `main`)."""
    tokenizer_revision: str | None = field(default=None, metadata=_MODEL)
    """Revision of a Hub --tokenizer (by default `main`)."""
    download_dir: str | None = field(default=None, metadata=_MODEL)
    """Hugging Face cache that Hub models are read from and downloaded into; by default $HF_HUB_CACHE (or
    $HF_HOME/hub). With HF_HUB_OFFLINE=1 nothing is downloaded: a model must already be in the cache."""
    reasoning_parser: ReasoningParserName = field(default="auto", metadata=_MODEL)
    """How chat answers are split from the model's `<think>…</think>` reasoning (`reasoning_content`): `qwen3`
    (reasoning only where the output, or the prompt, opens it), `deepseek_r1` (the output starts in reasoning),
    `none`; `auto` picks qwen3 for a chat template that knows `</think>`, none otherwise."""
    chat_format: ChatFormatName = field(default="auto", metadata=_MODEL)
    """How chat and Responses conversations become prompts and replies become answers: `template` (the tokenizer's
    chat template, read back with --reasoning-parser and --tool-call-parser), `harmony` (gpt-oss's format, rendered
    and read by the openai-harmony package: the analysis channel is `reasoning_content`, calls to `functions.*` are
    `tool_calls`, the final channel the answer); `auto` picks harmony for a gpt-oss model."""
    request_timeout: float = field(default=600.0, metadata=_SERVER)
    """Seconds a request may take from arrival to its last byte before it is aborted (504); 0 disables."""
    sse_ping_interval: float = field(default=15.0, metadata=_SERVER)
    """Seconds between keep-alive comments (`: ping`) on an open event stream, so that proxies keep a connection
    open while its request waits in the queue or in a long prefill; 0 sends none."""
    max_request_bytes: int = field(default=8 * 1024 * 1024, metadata=_SERVER)
    """Largest request body accepted (413 beyond)."""
    drain_timeout: float = field(default=30.0, metadata=_SERVER)
    """On SIGTERM, seconds in-flight requests get to finish before the server exits."""
    tool_call_parser: ToolCallParserName = field(default="auto", metadata=_MODEL)
    """How `tool_choice: auto` answers are read for calls: hermes (Hermes / Qwen `<tool_call>` JSON), kimi_k2 (Kimi
    K2's `<|tool_calls_section_begin|>`), llama3_json (Llama 3.x JSON, `<|python_tag|>`), mistral (`[TOOL_CALLS]`);
    auto picks the one the chat template writes, and none (or a template that shows none) refuses `auto` with tools.
    `required` and a named tool_choice need no parser: the grammar enforces them."""
    log_level: LogLevel = field(default="info", metadata=_SERVER)
    """Log level of the server and the engine process."""
    log_format: LogFormat = field(default="text", metadata=_SERVER)
    """`text`: one readable line per record; `json`: one JSON object per line (time, level, logger, message,
    request_id) for log shippers. Either way a request's records carry its X-Request-Id."""
    step_log: str | None = field(default=None, metadata=_SERVER)
    """Append one JSON line per engine step to this file: the waiting queue the step was planned from, the
    requests it scheduled (and so admitted), those preempted and finished, its phase times. For reading the
    scheduler's decisions after the fact; it costs a copy of the waiting queue each step."""
    lora_modules: tuple[LoRAModule, ...] | None = field(default=None, metadata={**_LORA, "repeatable": True})
    """LoRA adapters served from the start (with --enable-lora): each `name=path`, or a JSON object `{"name": ...,
    "path": ..., "base_model_name": ...}` (its `parent` in /v1/models, by default the first served name); several
    per flag, and the flag may repeat. A request uses one by sending its name as `model`. Each is checked against
    the model at start-up: one that does not fit stops the server, saying why."""
    allowed_media_domains: str | None = field(default=None, metadata=_MEDIA)
    """Hosts an image model's requests may name http(s) image URLs on, comma-separated (`images.example.com`
    allows its subdomains too); unset, only data: URLs are taken and nothing is fetched. A host resolving to a
    private, loopback or link-local address is refused unless that address (or a network holding it,
    `10.0.0.0/8`) is listed too."""
    max_image_bytes: int = field(default=20 * 2**20, metadata=_MEDIA)
    """Largest image accepted, as fetched or decoded from a data: URL (400 beyond)."""
    media_fetch_timeout: float = field(default=10.0, metadata=_MEDIA)
    """Seconds one image's fetch may take, redirects included (400 beyond)."""
    allow_runtime_lora_updating: bool = field(default=False, metadata=_LORA)
    """Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), which add and remove adapters while
    serving (with --enable-lora). Requests already running with an adapter finish with it when it is unloaded."""

    api_keys_file: str | None = field(default=None, metadata=_STATE)
    """A file of API keys, one a line (blank lines and `#` comments skipped), each accepted as --api-key is.
    What a key stores (responses, conversations, files, batches) belongs to that key: other keys cannot see it."""
    state_dir: str | None = field(default=None, metadata=_STATE)
    """Folder of the embedded SQLite database that stored responses, conversations, files and batches live in
    (one replica); by default $FERRY_STATE_DIR, else $XDG_DATA_HOME/ferry (~/.local/share/ferry)."""
    database_url: str | None = field(default=None, metadata=_STATE)
    """A PostgreSQL server to keep that state in instead (`postgresql://user:password@host:5432/db`): what
    several replicas share. `ferry serve` falls back to $FERRY_DATABASE_URL, which keeps the password out of `ps`."""
    store_retention_days: float = field(default=30.0, metadata=_STATE)
    """Days a stored response is kept after it was created (OpenAI keeps them 30 days); 0 keeps them until
    deleted."""
    max_stored_bytes_per_key: int = field(default=10 * 2**30, metadata=_STATE)
    """Most bytes one API key may keep stored (responses, conversation items, files) before new stores are refused
    (429, `insufficient_quota`); 0: no limit."""
    max_file_bytes: int = field(default=200 * 2**20, metadata=_STATE)
    """Largest file `POST /v1/files` accepts (413 beyond); a batch's input file holds at most 50,000 requests."""
    batch_concurrency: int = field(default=16, metadata=_STATE)
    """Requests of one batch a replica keeps in the engine at once; they run at a lower priority than interactive
    requests, so the engine admits an interactive request ahead of any waiting batch request."""

    def __post_init__(self) -> None:
        if self.store_retention_days < 0:
            raise ValueError(f"store_retention_days must be >= 0, got {self.store_retention_days}")
        if self.max_stored_bytes_per_key < 0:
            raise ValueError(f"max_stored_bytes_per_key must be >= 0, got {self.max_stored_bytes_per_key}")
        if self.max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be >= 1, got {self.max_file_bytes}")
        if self.batch_concurrency < 1:
            raise ValueError(f"batch_concurrency must be >= 1, got {self.batch_concurrency}")
        if self.request_timeout < 0:
            raise ValueError(f"request_timeout must be >= 0, got {self.request_timeout}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.served_model_name is not None and not all(self.served_model_name):
            raise ValueError("served_model_name: every name must be non-empty")
        if self.sse_ping_interval < 0:
            raise ValueError(f"sse_ping_interval must be >= 0, got {self.sse_ping_interval}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        names = [module.name for module in self.lora_modules or ()]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"lora_modules: each adapter needs a name of its own, and {', '.join(repeated)} repeat")
