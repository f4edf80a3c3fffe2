"""OpenAI's error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every refusal of the HTTP API is an `APIError` (or a pydantic `ValidationError` made
into one), so a client always gets the status its SDK maps to an exception class
(400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 429 RateLimitError,
503 InternalServerError) and a message that names the offending field.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pagedinfer.service.openai.protocol import ErrorBody, ErrorResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A refusal with its HTTP status; `param` names the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        error = ErrorBody(
            message=self.message,
            type=ERROR_TYPES.get(self.status, "invalid_request_error"),
            param=self.param,
            code=self.code,
        )
        return ErrorResponse(error=error).model_dump()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def field_path(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming its field."""
    return from_errors(exc.errors(include_url=False))


def from_errors(errors: list[Any], *, skip: int = 0) -> APIError:
    """The first of pydantic's error records as a 400 naming its field.

    skip: leading location parts that are not fields (FastAPI's "body").
    """
    if not errors:  # pragma: no cover - pydantic always reports at least one
        return bad_request("invalid request body")
    error = errors[0]
    kind = error["type"]
    loc = tuple(error["loc"])[skip:]
    # Union members add their type name to the location; it names no field.
    loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES)))
    path = field_path(loc)
    message = error["msg"].removeprefix("Value error, ")
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", message)
        return bad_request(f"the request body is not valid JSON: {detail}")
    if kind in ("model_type", "model_attributes_type") and not loc:
        return bad_request("the request body must be a JSON object")
    if kind == "extra_forbidden":
        return bad_request(f"unknown field: {path}", param=path)
    if kind == "missing":
        return bad_request(f"missing required field: {path}", param=path)
    if kind == "literal_error":
        message = f"must be {error['ctx']['expected']}, got {error.get('input')!r}"
    return bad_request(f"{path}: {message}" if path else message, param=path or None)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "function-plain", "none"}
