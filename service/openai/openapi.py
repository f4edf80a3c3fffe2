"""The served `/openapi.json`: FastAPI's document of the routes, completed with what it
cannot see. The POST routes read their bodies themselves (strictly, with errors in
OpenAI's shape), so FastAPI knows neither their request schemas nor their error
responses; this adds both, from the same pydantic models the routes validate with, so
that clients and fuzzers generated from the document send what the server accepts.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pagedinfer.service.openai.protocol import ErrorResponse

REF = "#/components/schemas/{model}"
# The statuses a route may refuse with, each with an OpenAI error body.
ERROR_STATUSES = {
    "400": "invalid request: the message and `param` name the field",
    "401": "missing or wrong bearer token",
    "404": "unknown model",
    "413": "request body too large",
    "429": "the waiting queue is full; retry after the Retry-After header's seconds",
    "503": "the model is still loading, or the server is draining",
}


# One server-sent event of a streamed answer: JSON chunks in `data`, then "[DONE]" (the
# Responses API also names each event).
SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Makes `app.openapi()` document each POST route of `bodies` (path -> its request
    model) and every route's error responses."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app, bodies)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    _add_model(schemas, ErrorResponse)
    error = {
        "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}
    }
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            operation["responses"].pop("422", None)  # validation errors answer 400
            for status, meaning in ERROR_STATUSES.items():
                operation["responses"].setdefault(status, {"description": meaning, **error})
            model = bodies.get(path) if method == "post" else None
            content = operation["responses"].get("200", {}).get("content", {})
            if path == "/metrics":
                content.clear()
                content["text/plain"] = {"schema": {"type": "string"}}
            elif model is not None and "stream" in model.model_fields:
                content["text/event-stream"] = {"schema": SSE_EVENT}
            if model is not None:
                _add_model(schemas, model)
                operation["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}
                    },
                }
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    return doc


def _add_model(schemas: dict[str, Any], model: type[BaseModel]) -> None:
    schema = model.model_json_schema(ref_template=REF, mode="validation")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
