"""Structured outputs over HTTP: which field of a request asks for one, checked with 400s.

A request may constrain its output through OpenAI's `response_format` (json_object or
json_schema), vLLM's `structured_outputs` (json, regex, choice, grammar, json_object) or
its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; at most
one of them. The spec is compiled (and cached) before the request is queued, so a
schema, regex or grammar the engine cannot enforce is a 400 naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from pagedinfer.service.openai.errors import bad_request
from pagedinfer.service.openai.protocol import GuidedFields
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.structured_output import GrammarError, StructuredOutput

if TYPE_CHECKING:
    from pagedinfer.service.async_engine import AsyncLLMEngine


def requested_output(request: GuidedFields) -> tuple[StructuredOutput, str] | None:
    """(spec, field name) of the structured output a request asks for; None for free
    text; 400 when it asks in more than one way or gives no constraint."""
    found: list[tuple[StructuredOutput, str]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append((StructuredOutput.json_object(), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request(
                "response_format of type json_schema needs json_schema.schema",
                "response_format.json_schema",
            )
        found.append(
            (
                _json_spec(fmt.json_schema.json_schema, "response_format.json_schema.schema"),
                "response_format.json_schema.schema",
            )
        )
    elif fmt is not None and fmt.json_schema is not None:
        raise bad_request(
            "response_format.json_schema is only allowed with type json_schema",
            "response_format",
        )
    so = request.structured_outputs
    if so is not None:
        given = [
            name
            for name in ("json_schema", "regex", "choice", "grammar", "json_object")
            if getattr(so, name) not in (None, False)
        ]
        if len(given) != 1:
            raise bad_request(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object (got {len(given)})",
                "structured_outputs",
            )
        name = given[0]
        param = f"structured_outputs.{'json' if name == 'json_schema' else name}"
        found.append((_spec(name, getattr(so, name), param), param))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(request, name)
        if value is not None:
            found.append((_spec(name.removeprefix("guided_"), value, name), name))
    if len(found) > 1:
        raise bad_request(
            "ask for one structured output, got " + ", ".join(p for _, p in found),
            found[1][1],
        )
    return found[0] if found else None


def _spec(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind in ("json", "json_schema"):
        return _json_spec(value, param)
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind == "choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
        return StructuredOutput.choice(value)
    if not value:
        raise bad_request(f"{param} must not be empty", param)
    return StructuredOutput(kind, value)


def _json_spec(schema: Any, param: str) -> StructuredOutput:
    if isinstance(schema, str):  # vLLM takes a schema as JSON text too
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise bad_request(f"{param} is not valid JSON: {err}", param) from None
    if not isinstance(schema, dict | bool):
        raise bad_request(f"{param} must be a JSON schema object", param)
    return StructuredOutput.json_schema(schema)


def check_output(engine: AsyncLLMEngine, output: StructuredOutput, param: str) -> None:
    """400 naming `param` if the engine cannot compile `output` (cached per spec)."""
    try:
        engine.engine.grammars.check(output)
    except GrammarError as err:
        raise bad_request(f"{param}: {err}", param) from None


def constrained(
    engine: AsyncLLMEngine, request: GuidedFields, params: SamplingParams
) -> SamplingParams:
    """`params` with the request's structured output, checked; unchanged without one."""
    found = requested_output(request)
    if found is None:
        return params
    output, param = found
    if params.use_beam_search:
        raise bad_request(f"{param} is not supported with use_beam_search", param)
    check_output(engine, output, param)
    return dataclasses.replace(params, structured_output=output)
