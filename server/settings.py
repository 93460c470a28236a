"""Options of the HTTP server itself (the engine's live in engine.config.EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """When set, /v1/* requires `Authorization: Bearer <api_key>`."""
    ui: bool = True
    """Serve the built-in page (chat playground and engine view) at `/`; without it `/` answers 404."""
    served_model_name: str | None = None
    """The `model` clients send; defaults to the model directory's name."""
    request_timeout: float = 600.0
    """Seconds from arrival to the end of the response; 0 disables."""
    max_request_bytes: int = 8 * 1024 * 1024
    drain_timeout: float = 30.0
    """Seconds in-flight requests get to finish after SIGTERM."""
    log_level: str = "info"
