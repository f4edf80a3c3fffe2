"""The chart's CRD and the operator agree; the example InferenceServices fit the CRD.

The operator reads the CR through `pagedinfer.operator.spec` and builds its children in
`pagedinfer.operator.resources`. Both are fed a spec with every field of the CRD's
schema filled in, through mappings that record each key read; every key the operator
reads must exist in the schema, so a renamed or misspelt field fails here instead of
being silently ignored in a cluster.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
from chart_tools import (
    EXAMPLES_DIR,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAME,
    VERSION,
    crd_version_schema,
    load_all,
    schema_errors,
)

from pagedinfer.operator import resources, spec

# -- names -------------------------------------------------------------------------


def test_crd_names_are_the_design_contract(crd):
    names = crd["spec"]["names"]
    assert crd["spec"]["group"] == GROUP
    assert (names["kind"], names["plural"], names["shortNames"]) == (KIND, PLURAL, [SHORT_NAME])
    assert crd["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    assert crd["spec"]["scope"] == "Namespaced"
    assert [v["name"] for v in crd["spec"]["versions"] if v["served"]] == [VERSION]


def test_operator_uses_the_crd_names(crd):
    names = crd["spec"]["names"]
    operator_names = (spec.GROUP, spec.VERSION, spec.API_VERSION, spec.KIND, spec.PLURAL)
    crd_names = (
        crd["spec"]["group"],
        VERSION,
        f"{GROUP}/{VERSION}",
        names["kind"],
        names["plural"],
    )
    assert operator_names == crd_names


# -- schema paths ------------------------------------------------------------------


def schema_at(schema: dict, path: str) -> dict | None:
    """The sub-schema at a dotted path ('spec.template.env[].name'), or None if absent.

    Any key is allowed under a map (`additionalProperties`) or below
    `x-kubernetes-preserve-unknown-fields`.
    """
    node = schema
    for part in re.findall(r"[^.\[\]]+|\[\]", path):
        if node.get("x-kubernetes-preserve-unknown-fields") and "properties" not in node:
            return node
        if part == "[]":
            node = node.get("items")
        elif part in node.get("properties", {}):
            node = node["properties"][part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        elif node.get("x-kubernetes-preserve-unknown-fields"):
            return node
        else:
            return None
        if node is None:
            return None
    return node


def test_scale_subresource_and_printer_columns_point_at_schema_fields(crd):
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == VERSION]
    schema = version["schema"]["openAPIV3Schema"]
    assert "status" in version["subresources"]
    scale = version["subresources"]["scale"]
    paths = [scale["specReplicasPath"], scale["statusReplicasPath"], scale["labelSelectorPath"]]
    assert paths == [".spec.replicas", ".status.replicas", ".status.selector"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Ready", "Replicas", "Desired", "FreeBlocks", "Age", "URL"]
    for path in [*paths, *columns.values()]:
        if path.startswith(".metadata."):
            continue
        plain = re.sub(r"\[\?\(.*?\)\]", "[]", path.lstrip("."))
        assert schema_at(schema, plain) is not None, path


# -- the fields the operator reads -------------------------------------------------


def sample(schema: dict) -> Any:
    """An instance with every property of schema filled in (CEL rules not honoured)."""
    if "default" in schema and schema.get("type") not in ("object", "array"):
        return schema["default"]
    if "enum" in schema:
        return schema["enum"][-1]
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        if "properties" in schema:
            return {k: sample(v) for k, v in schema["properties"].items()}
        if isinstance(schema.get("additionalProperties"), dict):
            return {"example.com/key": sample(schema["additionalProperties"])}
        return {}
    if kind == "array":
        return [sample(schema.get("items", {}))]
    if kind == "integer":
        return max(schema.get("minimum", 1), 1)
    if kind == "number":
        return 0.5
    if kind == "boolean":
        return False
    if schema.get("x-kubernetes-int-or-string"):
        return "1"
    if kind == "string":
        for candidate in ("a", "1Gi", "/models/m", "a/b"):
            if re.search(schema.get("pattern", ""), candidate):
                return candidate
    raise AssertionError(f"no sample for {schema}")


class ReadRecorder(dict):
    """A dict that notes the path of every key read through it, present or not."""

    def __init__(self, data: dict, path: str, reads: set[str]):
        super().__init__({k: record(v, _join(path, k), reads) for k, v in data.items()})
        self._path, self._reads = path, reads

    def _note(self, key: Any) -> None:
        self._reads.add(_join(self._path, key))

    def get(self, key: Any, default: Any = None) -> Any:
        self._note(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self._note(key)
        return super().__contains__(key)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def record(value: Any, path: str, reads: set[str]) -> Any:
    if isinstance(value, dict):
        return ReadRecorder(value, path, reads)
    if isinstance(value, list):
        return [record(v, f"{path}[]", reads) for v in value]
    return value


@pytest.fixture
def full_body(crd) -> dict:
    """An InferenceService with every spec field of the CRD set."""
    full_spec = sample(crd_version_schema(crd)["properties"]["spec"])
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": "full", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": full_spec,
    }


def recording_parse_spec(reads: set[str]) -> Callable[[Any], spec.InferenceServiceSpec]:
    """parse_spec whose result carries its plain-dict fields as ReadRecorders too, so that
    the builders' reads of spec.engine, spec.template and spec.resources are recorded."""

    def parse(raw: Any) -> spec.InferenceServiceSpec:
        parsed = spec.parse_spec(raw)
        return dataclasses.replace(
            parsed,
            resources=record(dict(parsed.resources), "spec.resources", reads),
            engine=record(dict(parsed.engine), "spec.engine", reads),
            template=record(dict(parsed.template), "spec.template", reads),
        )

    return parse


def test_every_spec_field_the_operator_reads_exists_in_the_crd(crd, full_body, monkeypatch):
    schema = crd_version_schema(crd)
    reads: set[str] = set()
    monkeypatch.setattr(resources, "parse_spec", recording_parse_spec(reads))
    body = record(full_body, "", reads)
    spec.parse_spec(body["spec"])
    spec.validation_errors(body)
    resources.build_deployment(body, replicas=2, default_image="pagedinfer:test")
    resources.build_service(body)
    resources.service_url(body)
    resources.grpc_url(body)

    spec_reads = sorted(r for r in reads if r.startswith("spec."))
    # Through the typed spec's mappings too, not only parse_spec's own reads.
    assert {"spec.autoscaling.targetFreeBlockRatio", "spec.engine.maxNumSeqs"} <= set(spec_reads)
    assert "spec.template.nodeSelector" in spec_reads
    missing = [r for r in spec_reads if schema_at(schema, r) is None]
    assert not missing, f"the operator reads fields the CRD does not define: {missing}"


def test_every_engine_field_of_the_crd_reaches_the_server(crd):
    engine = crd_version_schema(crd)["properties"]["spec"]["properties"]["engine"]
    handled = set(resources.ENGINE_FLAGS) | {"enablePrefixCaching", "extraArgs"}
    assert handled == set(engine["properties"])


def test_server_args_the_operator_builds_are_accepted_by_pagedinfer_serve(full_body):
    from pagedinfer.service.cli import build_parser

    deployment = resources.build_deployment(full_body, replicas=1, default_image="x")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["pagedinfer"]
    extra = full_body["spec"]["engine"]["extraArgs"]  # the sample's, not real flags
    assert container["args"][-len(extra) :] == extra
    parsed = build_parser("serve").parse_args(container["args"][: -len(extra)])
    assert parsed.command == "serve"
    assert parsed.http_port == resources.HTTP_PORT
    assert parsed.grace_period == full_body["spec"]["lifecycle"]["drainSeconds"]
    assert parsed.served_model_name == [full_body["spec"]["model"]["name"]]


@pytest.mark.parametrize(
    "engine",
    [
        {"numSpeculativeTokens": 0},
        {"numSpeculativeTokens": 16, "promptLookupMin": 32, "promptLookupMax": 32},
        {"numSpeculativeTokens": 4, "promptLookupMin": 3},
        {"numSpeculativeTokens": 4, "speculativeMaxRunning": 1},
    ],
)
def test_speculative_decoding_settings_the_crd_admits_start_the_server(engine, isvc_validator):
    """Within the CRD's bounds and rules, the server's own config takes the values."""
    from pagedinfer.service.cli import build_parser
    from pagedinfer.service.config import config_from_args

    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": "spec-decode"},
        "spec": {"engine": engine},
    }
    assert schema_errors(isvc_validator, body) == []
    assert spec.validation_errors(body) == []
    args = resources.server_args(spec.parse_spec(body["spec"]))
    config = config_from_args(build_parser("serve").parse_args(args))
    assert config.num_speculative_tokens == engine["numSpeculativeTokens"]
    assert config.prompt_lookup_min == engine.get("promptLookupMin", 1)
    assert config.prompt_lookup_max == engine.get("promptLookupMax", 3)
    assert config.speculative_max_running == engine.get("speculativeMaxRunning", 64)


# -- examples ----------------------------------------------------------------------


def example_objects() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(EXAMPLES_DIR.glob("**/*.y*ml")):
        for obj in load_all(path.read_text()):
            if obj.get("kind") == KIND:
                found.append((f"{path.relative_to(EXAMPLES_DIR)}:{obj['metadata']['name']}", obj))
    return found


EXAMPLES = example_objects()


def test_there_are_example_inferenceservices():
    assert EXAMPLES, f"no {KIND} in {EXAMPLES_DIR}"


@pytest.mark.parametrize(("where", "obj"), EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_example_is_valid_against_the_crd(where, obj, isvc_validator):
    assert obj["apiVersion"] == f"{GROUP}/{VERSION}"
    assert schema_errors(isvc_validator, obj) == []
    # The CEL rules, which only an API server evaluates, as the operator repeats them.
    assert spec.validation_errors(obj) == []


def test_schema_check_names_the_bad_field(crd, isvc_validator):
    """The validator these checks rely on refuses unknown and out-of-range fields."""
    bad = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": "bad"},
        "spec": {
            "autoscaling": {"maxReplicas": 2, "targetFreeBlockRatio": 1.5},
            "engine": {"blockSize": 17, "gpuMemoryUtilization": 0},
            "replica": 3,
        },
    }
    errors = "\n".join(schema_errors(isvc_validator, bad))
    assert "spec.autoscaling.targetFreeBlockRatio" in errors
    assert "spec.engine.blockSize" in errors
    assert "spec.engine.gpuMemoryUtilization" in errors  # exclusiveMinimum: 0
    assert "'replica' was unexpected" in errors


def test_the_full_sample_is_itself_a_valid_inferenceservice(full_body, isvc_validator):
    assert schema_errors(isvc_validator, full_body) == []


# -- the fields the operator writes ------------------------------------------------


def test_every_status_field_the_operator_writes_exists_in_the_crd(full_body, isvc_validator):
    """Fields the schema lacks would be pruned by the API server, silently."""
    from pagedinfer.operator import autoscaler, status

    now = 1_800_000_000.0
    deployment = {
        "metadata": {"generation": 3},
        "spec": {"replicas": 2},
        "status": {
            "replicas": 2,
            "readyReplicas": 1,
            "updatedReplicas": 2,
            "observedGeneration": 3,
        },
    }
    written = status.deployment_status(full_body, deployment, now)
    written |= status.static_scaling_status(written, now)
    decision = autoscaler.Decision(
        desired=3,
        reason="ScaleUp",
        message="2 -> 3: utilization 0.90 vs target 0.70 on 1 pod(s)",
        recommendation=3,
        utilization=0.9,
        free_ratio=0.1,
        pods_with_metrics=1,
        missing=("pod-b",),
    )
    written |= status.autoscaling_status(written, decision, 2, {"pod-b": "timed out"}, now)
    written_fields = {"url", "grpcUrl", "selector", "conditions", "desiredReplicas", "autoscaling"}
    assert written_fields <= set(written)
    assert written["autoscaling"]["history"], "a scaling action was recorded"
    assert schema_errors(isvc_validator, {**full_body, "status": written}) == []

    refused = status.deployment_status(full_body, None, now, invalid=["spec.replicas: bad"])
    assert schema_errors(isvc_validator, {**full_body, "status": refused}) == []
