"""OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, and the exception that carries it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from starlette.responses import JSONResponse


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """Raised anywhere while serving a request; the app turns it into an OpenAI error response."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        # Messages quote what the client sent (a model name, a field name), which may not be encodable text: a lone
        # surrogate is written as its escape, so that no error response fails to encode.
        self.info = ErrorInfo(message=_encodable(message), type=type, param=param and _encodable(param), code=code)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.info).model_dump()

    def json(self) -> str:
        return ErrorResponse(error=self.info).model_dump_json()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported_parameter(param: str, detail: str = "") -> APIError:
    message = f"'{param}' is not supported by this server" + (f": {detail}" if detail else ".")
    return APIError(400, message, param=param, code="unsupported_parameter")


def file_not_found(file_id: str, param: str | None = None) -> APIError:
    """A stored file that does not exist, or is another key's (the same answer)."""
    return APIError(404, f"No such File object: {file_id}", param=param, code="file_not_found")


def service_unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, type="service_unavailable_error", code=code)


def engine_failure(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="engine_error")


def internal_error() -> APIError:
    """What a client learns of a bug: nothing but that it happened (the log has the traceback)."""
    return APIError(500, "Internal server error.", type="server_error", code="internal_error")


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {"4XX": {"model": ErrorResponse}, "5XX": {"model": ErrorResponse}}
"""A route's documented error responses: OpenAI's error object (FastAPI would otherwise advertise its 422 shape)."""


# Segments of a pydantic error location that name a union member (`str`, `list[int]`, `ContentPart`) rather
# than a field: left out of the `param` reported to the client.
_FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(location: Sequence[int | str]) -> str | None:
    param = ""
    for part in location:
        if isinstance(part, int):
            param += f"[{part}]"
        elif _FIELD_NAME.match(part) and part not in _TYPE_NAMES:
            param += f".{part}" if param else part
    return param or None


def validation_error(errors: Sequence[Any]) -> APIError:
    """FastAPI's validation errors as OpenAI's 400 (never FastAPI's 422 shape)."""
    error = errors[0]
    location = list(error.get("loc", ()))
    if location[:1] == ["body"]:
        location = location[1:]
    param = _param(location)
    kind = error.get("type", "")
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", "invalid JSON")
        return invalid_request(f"We could not parse the JSON body of your request ({detail}).", code="invalid_json")
    if kind == "extra_forbidden":
        return invalid_request(f"Unrecognized request argument supplied: {param}", param, code="unknown_parameter")
    if kind == "missing":
        return invalid_request(f"Missing required parameter: '{param}'.", param, code="missing_required_parameter")
    if param is None:
        return invalid_request(f"Invalid request body: {error.get('msg', 'invalid')}.", code="invalid_request_body")
    return invalid_request(f"Invalid value for '{param}': {error.get('msg', 'invalid')}.", param, code="invalid_value")
