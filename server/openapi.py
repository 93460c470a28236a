"""The OpenAPI document at /openapi.json: FastAPI's, corrected to say exactly what the server accepts and answers.

Three corrections. Exact bounds: FastAPI passes every schema through its own OpenAPI model, whose numeric bounds
are floats (the seed's 2**63 - 1 came out as 9.223372036854776e18), so the request models' own JSON schemas
replace them. Refused values: a field the server knows but cannot honour (OpenAI's `tools`, say) is advertised
with only the values it accepts (none or empty) instead of everything OpenAI's API would take. And `model`
(in bodies and in /v1/models/{model_id}) lists the served names (the base model's and its LoRA adapters', unless
adapters come and go while serving), and every response declares its X-Request-Id.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_NULL = {"type": "null"}

REFUSED_VALUES: dict[str, dict[str, dict[str, Any]]] = {
    "ChatCompletionRequest": {
        "functions": {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]},
        "function_call": {"enum": ["none", None]},
        "audio": _NULL,
        "modalities": {"enum": [["text"], None]},
        "verbosity": _NULL,
        "web_search_options": _NULL,
    },
    "ChatMessage": {
        "function_call": _NULL,
        "audio": _NULL,
    },
    "ContentPart": {"type": {"const": "text"}, "text": {"type": "string"}},
    "StreamOptions": {"include_obfuscation": {"enum": [False, None]}},
    "CompletionRequest": {
        "suffix": {"anyOf": [{"type": "string", "maxLength": 0}, _NULL]},
        "best_of": {"enum": [1, None]},
    },
}
"""Per schema, the values each refused field accepts (a 400 names the field for any other)."""

REQUIRED: dict[str, list[str]] = {"ContentPart": ["type", "text"]}
"""Fields a schema must carry for the server to accept it (a content part is text, and so has its text)."""

_REQUEST_ID_HEADER = {
    "X-Request-Id": {
        "description": "The client's own X-Request-Id (visible ASCII, at most 128 characters) or a new one.",
        "schema": {"type": "string", "minLength": 1, "maxLength": 128},
    }
}


def openapi_document(app: FastAPI, request_models: list[type[BaseModel]], model_names: tuple[str, ...] | None) -> dict:
    """The corrected document for `app`, whose request bodies are `request_models` and whose `model` fields take
    `model_names` (None: any string, for names that change while serving)."""
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = document["components"]["schemas"]
    for model in request_models:
        exact = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(exact.pop("$defs", {}))
        schemas[model.__name__] = exact
    for name, fields in REFUSED_VALUES.items():
        properties = schemas[name]["properties"]
        for field, accepted in fields.items():
            properties[field] = {**_annotations(properties[field]), **accepted}
    for name, required in REQUIRED.items():
        schemas[name]["required"] = sorted(set(schemas[name].get("required", [])) | set(required))
    for name, schema in schemas.items():
        if model_names is not None and name.endswith("Request") and "model" in schema["properties"]:
            model_field = schema["properties"]["model"]
            names = list(model_names) if "model" in schema.get("required", []) else [*model_names, None]
            schema["properties"]["model"] = {**_annotations(model_field), "enum": names}
    for path in document["paths"].values():
        for operation in path.values():
            for parameter in operation.get("parameters", ()):
                if parameter["name"] == "model_id" and model_names is not None:
                    parameter["schema"] = {**_annotations(parameter["schema"]), "enum": list(model_names)}
            for response in operation["responses"].values():
                response.setdefault("headers", {}).update(_REQUEST_ID_HEADER)
    return document


def _annotations(schema: dict[str, Any]) -> dict[str, Any]:
    """What describes a field without constraining it (title, description, default)."""
    return {key: schema[key] for key in ("title", "description", "default") if key in schema}
