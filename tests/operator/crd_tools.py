"""Checking InferenceServices against the CRD offline, the way an API server would.

An API server defaults the object from the schema, validates it against the OpenAPI
schema, then evaluates the CEL rules (`x-kubernetes-validations`). Here jsonschema does
the second step and cel-python the third, on the rules as written in the CRD.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "charts/pagedinfer/crds/inferenceservices.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("inferenceservice*.yaml"))


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def openapi_schema(crd: dict[str, Any] | None = None) -> dict[str, Any]:
    crd = crd or load_crd()
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """`value` with the schema's defaults filled in, parents before children."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in set(value) - set(schema.get("properties", {})):
                value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], v) for v in value]
    return value


def schema_errors(obj: dict[str, Any], schema: dict[str, Any] | None = None) -> list[str]:
    """OpenAPI violations as 'dotted.path: message'. OpenAPI 3.0's schema dialect is
    closest to JSON Schema draft 4 (boolean exclusiveMinimum); x-kubernetes-* keywords
    are ignored by jsonschema."""
    validator = jsonschema.Draft4Validator(schema or openapi_schema())
    return [
        ".".join(str(p) for p in e.absolute_path) + ": " + e.message
        for e in validator.iter_errors(obj)
    ]


def _rules(schema: dict[str, Any], value: Any, path: str) -> Iterator[tuple[str, dict, Any]]:
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule, value
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                yield from _rules(sub, value[key], f"{path}.{key}".lstrip("."))
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from _rules(schema["items"], item, f"{path}[{i}]")


def cel_errors(obj: dict[str, Any], schema: dict[str, Any] | None = None) -> list[str]:
    """The CRD's CEL rules that `obj` breaks, as 'path: message' (fieldPath included)."""
    import celpy

    env = celpy.Environment()
    errors = []
    for path, rule, value in _rules(schema or openapi_schema(), obj, ""):
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            where = f"{path}{rule.get('fieldPath', '')}".lstrip(".")
            errors.append(f"{where}: {rule['message']}")
    return errors


def admission_errors(obj: dict[str, Any]) -> list[str]:
    """What an API server would refuse `obj` for: schema first, then CEL on the
    defaulted object (CEL rules run only on schema-valid objects)."""
    schema = openapi_schema()
    obj = apply_defaults(schema, obj)
    return schema_errors(obj, schema) or cel_errors(obj, schema)


def all_cel_rules(schema: dict[str, Any] | None = None) -> list[str]:
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.extend(r["rule"] for r in node.get("x-kubernetes-validations", []))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema or openapi_schema())
    return found
