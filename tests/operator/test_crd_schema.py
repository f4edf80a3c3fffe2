"""The InferenceService CRD: a valid CRD, the API contract, and what it refuses.

What a real API server alone enforces, and how its logic is covered here:
- the CEL rules (`x-kubernetes-validations`): evaluated with cel-python on the rules
  as written in the CRD (the CEL runtime and cost limits of the server are not), and
  mirrored by `spec.validation_errors`, which the operator applies itself;
- defaulting: emulated by `crd_tools.apply_defaults`, and the operator's own defaults
  are checked equal to the CRD's below;
- pruning of unknown fields, and structural-schema rules beyond kubernetes-validate's
  CRD schema: not emulated.
"""

from __future__ import annotations

import copy
import dataclasses

import kubernetes_validate
import pytest
import yaml
from crd_tools import (
    EXAMPLES,
    admission_errors,
    all_cel_rules,
    apply_defaults,
    load_crd,
    openapi_schema,
)

from pagedinfer.operator.spec import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SERVER_PROMPT_LOOKUP_MAX,
    SERVER_PROMPT_LOOKUP_MIN,
    VERSION,
    parse_spec,
    validation_errors,
)

pytest.importorskip("celpy", reason="cel-python evaluates the CRD's CEL rules")


@pytest.mark.parametrize("k8s", ["1.29", kubernetes_validate.utils.latest_version()])
def test_the_crd_is_a_valid_customresourcedefinition(k8s: str) -> None:
    kubernetes_validate.validate(load_crd(), k8s, strict=True)


def test_the_crd_keeps_the_api_contract() -> None:
    crd = load_crd()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    assert (spec["group"], spec["scope"]) == (GROUP, "Namespaced")
    assert spec["names"]["kind"] == KIND
    assert spec["names"]["plural"] == PLURAL
    assert spec["names"]["shortNames"] == ["pisvc"]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == (VERSION, True, True)
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Replicas", "Desired", "FreeBlocks", "Age", "URL"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for field in (
        "observedGeneration",
        "replicas",
        "readyReplicas",
        "desiredReplicas",
        "selector",
        "url",
        "grpcUrl",
        "autoscaling",
        "conditions",
    ):
        assert field in status


def test_every_cel_rule_compiles() -> None:
    import celpy

    env = celpy.Environment()
    rules = all_cel_rules()
    assert len(rules) == 13
    for rule in rules:
        env.compile(rule)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_examples_are_admitted(path) -> None:
    obj = yaml.safe_load(path.read_text())
    assert obj["apiVersion"] == API_VERSION and obj["kind"] == KIND
    assert admission_errors(obj) == []
    assert validation_errors(obj) == []


def test_the_chart_example_spec_is_admitted() -> None:
    values = yaml.safe_load((EXAMPLES[0].parents[1] / "charts/pagedinfer/values.yaml").read_text())
    obj = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": values["example"]["name"]},
        "spec": {**values["example"]["spec"], "image": "pagedinfer:0.1.0"},
    }
    assert admission_errors(obj) == []


def isvc(spec: dict, name: str = "llm") -> dict:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec}


AUTOSCALED = {"autoscaling": {"minReplicas": 1, "maxReplicas": 4}}

# spec -> the field the refusal names. `cel` marks the rules only CEL enforces.
INVALID = {
    "replicas and autoscaling together": ({"replicas": 2, **AUTOSCALED}, "spec.replicas", True),
    "minReplicas above maxReplicas": (
        {"autoscaling": {"minReplicas": 5, "maxReplicas": 4}},
        "spec.autoscaling.minReplicas",
        True,
    ),
    "defaulted minReplicas above maxReplicas": (
        {"autoscaling": {"maxReplicas": 0}},
        "spec.autoscaling.maxReplicas",
        False,
    ),
    "autoscaling without maxReplicas": (
        {"autoscaling": {"minReplicas": 1}},
        "spec.autoscaling",
        False,
    ),
    "a free-block target of 1": (
        {"autoscaling": {"maxReplicas": 3, "targetFreeBlockRatio": 1.0}},
        "spec.autoscaling.targetFreeBlockRatio",
        False,
    ),
    "a negative tolerance": (
        {"autoscaling": {"maxReplicas": 3, "tolerance": -0.1}},
        "spec.autoscaling.tolerance",
        False,
    ),
    "a zero sync period": (
        {"autoscaling": {"maxReplicas": 3, "syncPeriodSeconds": 0}},
        "spec.autoscaling.syncPeriodSeconds",
        False,
    ),
    "a zero scrape timeout": (
        {"autoscaling": {"maxReplicas": 3, "scrapeTimeoutSeconds": 0}},
        "spec.autoscaling.scrapeTimeoutSeconds",
        False,
    ),
    "a scale-down percent above 100": (
        {"autoscaling": {"maxReplicas": 3, "scaleDown": {"percent": 150}}},
        "spec.autoscaling.scaleDown.percent",
        False,
    ),
    "negative replicas": ({"replicas": -1}, "spec.replicas", False),
    "a block size off the list": ({"engine": {"blockSize": 17}}, "spec.engine.blockSize", False),
    "maxModelLen below blockSize": (
        {"engine": {"blockSize": 32, "maxModelLen": 16}},
        "spec.engine.maxModelLen",
        True,
    ),
    "a KV budget that is not a size": (
        {"engine": {"kvCacheMemory": "lots"}},
        "spec.engine.kvCacheMemory",
        False,
    ),
    "a GPU share of 0": (
        {"engine": {"gpuMemoryUtilization": 0}},
        "spec.engine.gpuMemoryUtilization",
        False,
    ),
    "an unknown dtype": ({"engine": {"dtype": "int4"}}, "spec.engine.dtype", False),
    "more draft tokens than the server verifies": (
        {"engine": {"numSpeculativeTokens": 17}},
        "spec.engine.numSpeculativeTokens",
        False,
    ),
    "a negative number of draft tokens": (
        {"engine": {"numSpeculativeTokens": -1}},
        "spec.engine.numSpeculativeTokens",
        False,
    ),
    "a zero-token n-gram": (
        {"engine": {"promptLookupMin": 0}},
        "spec.engine.promptLookupMin",
        False,
    ),
    "drafts with no request running": (
        {"engine": {"speculativeMaxRunning": 0}},
        "spec.engine.speculativeMaxRunning",
        False,
    ),
    "an n-gram longer than the bound": (
        {"engine": {"promptLookupMax": 33}},
        "spec.engine.promptLookupMax",
        False,
    ),
    "promptLookupMin above promptLookupMax": (
        {"engine": {"promptLookupMin": 4, "promptLookupMax": 2}},
        "spec.engine.promptLookupMin",
        True,
    ),
    "promptLookupMin above the server's default promptLookupMax": (
        {"engine": {"numSpeculativeTokens": 4, "promptLookupMin": 4}},
        "spec.engine.promptLookupMin",
        True,
    ),
    "both model sources": (
        {"model": {"source": {"image": {"path": "/m"}, "pvc": {"claimName": "c"}}}},
        "spec.model.source",
        True,
    ),
    "an empty model source": ({"model": {"source": {}}}, "spec.model.source", True),
    "a relative image path": (
        {"model": {"source": {"image": {"path": "models/x"}}}},
        "spec.model.source.image.path",
        False,
    ),
    "a PVC path escaping the volume": (
        {"model": {"source": {"pvc": {"claimName": "c", "path": "../etc"}}}},
        "spec.model.source.pvc.path",
        True,
    ),
    "a PVC without a claim": (
        {"model": {"source": {"pvc": {"path": "x"}}}},
        "spec.model.source.pvc",
        False,
    ),
    "an unknown service type": (
        {"service": {"type": "ExternalName"}},
        "spec.service.type",
        False,
    ),
    "a port out of range": ({"service": {"port": 70000}}, "spec.service.port", False),
    "an HTTP port out of range": ({"service": {"httpPort": 0}}, "spec.service.httpPort", False),
    "the gRPC port on the default HTTP port": (
        {"service": {"port": 8000}},
        "spec.service.httpPort",
        True,
    ),
    "the HTTP port on the metrics port": ({"service": {"httpPort": 9464}}, "spec.service", True),
    "extra flags moving the HTTP port": (
        {"engine": {"extraArgs": ["--http-port=9000"]}},
        "spec.engine.extraArgs",
        True,
    ),
    "extra flags shortening the drain": (
        {"engine": {"extraArgs": ["--seed", "1", "--grace-period", "5"]}},
        "spec.engine.extraArgs",
        True,
    ),
    "a startup timeout under 10 s": (
        {"lifecycle": {"startupTimeoutSeconds": 5}},
        "spec.lifecycle.startupTimeoutSeconds",
        False,
    ),
    "a negative drain": ({"lifecycle": {"drainSeconds": -1}}, "spec.lifecycle.drainSeconds", False),
    "a preStop sleep over 5 minutes": (
        {"lifecycle": {"preStopSleepSeconds": 301}},
        "spec.lifecycle.preStopSleepSeconds",
        False,
    ),
    "a malformed quantity": (
        {"resources": {"limits": {"memory": "2 GB"}}},
        "spec.resources.limits.memory",
        False,
    ),
    "zero accelerators": ({"accelerator": {"count": 0}}, "spec.accelerator.count", False),
    "KV events without a model name": ({"kvEvents": {}}, "spec.kvEvents", True),
    "KV events on the metrics port": (
        {"model": {"name": "m"}, "kvEvents": {"port": 9464}},
        "spec.kvEvents.port",
        True,
    ),
    "a KV replay port equal to the events port": (
        {"model": {"name": "m"}, "kvEvents": {"port": 6000, "replayPort": 6000}},
        "spec.kvEvents.replayPort",
        True,
    ),
    "a privileged KV events port": (
        {"model": {"name": "m"}, "kvEvents": {"port": 80}},
        "spec.kvEvents.port",
        False,
    ),
    "an unknown image pull policy": (
        {"imagePullPolicy": "Sometimes"},
        "spec.imagePullPolicy",
        False,
    ),
}


@pytest.mark.parametrize("spec, field, cel", INVALID.values(), ids=INVALID.keys())
def test_invalid_specs_are_refused_naming_the_field(spec: dict, field: str, cel: bool) -> None:
    errors = admission_errors(isvc(spec))
    assert errors, "admitted"
    assert any(e.split(":")[0] == field for e in errors), errors
    if cel:
        # The operator repeats each CEL rule, for servers that do not enforce them.
        assert any(e.startswith(field) for e in validation_errors(isvc(spec)))


@pytest.mark.parametrize("name", ["a" * 64, "Llm", "1llm", "llm.v2", "llm-"])
def test_names_that_cannot_name_a_service_are_refused(name: str) -> None:
    assert admission_errors(isvc({}, name=name)) == [
        ": metadata.name must be a DNS-1035 label of at most 63 characters (it names the Service)"
    ]
    assert validation_errors(isvc({}, name=name))


def test_python_rules_agree_with_the_crd_on_valid_objects() -> None:
    for spec in [
        {},
        {"replicas": 0},
        AUTOSCALED,
        {"model": {"source": {"pvc": {"claimName": "c"}}}},
        {"engine": {"numSpeculativeTokens": 0}},
        {"engine": {"numSpeculativeTokens": 16, "promptLookupMin": 32, "promptLookupMax": 32}},
        {"engine": {"promptLookupMin": 3}},  # up to the server's default max
        {"engine": {"promptLookupMax": 1}},  # down to the server's default min
        {"service": {"port": 8000, "httpPort": 8080}},
        {"lifecycle": {"drainSeconds": 0, "preStopSleepSeconds": 0}},
        # Flags that only start like the ones the operator sets.
        {"engine": {"extraArgs": ["--portal", "--hostname=x", "--tls-cert", "/tls/crt"]}},
    ]:
        assert admission_errors(isvc(spec)) == []
        assert validation_errors(isvc(spec)) == []


def test_the_extra_flags_refusal_names_the_flags() -> None:
    body = isvc({"engine": {"extraArgs": ["--port", "1", "--metrics-port=2", "--seed", "3"]}})
    (error,) = validation_errors(body)
    assert error.startswith("spec.engine.extraArgs: must not set --host, --port")
    assert error.endswith("(got --port, --metrics-port=2)")


def test_the_promptlookup_refusal_names_both_values() -> None:
    body = isvc({"engine": {"promptLookupMin": 5, "promptLookupMax": 4}})
    assert validation_errors(body) == [
        "spec.engine.promptLookupMin: must not exceed promptLookupMax (5 > 4)"
    ]


def test_the_speculative_decoding_bounds_are_the_servers() -> None:
    from pagedinfer.service.config import MAX_SPECULATIVE_TOKENS, EngineConfig

    engine = openapi_schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    spec_tokens = engine["numSpeculativeTokens"]
    assert (spec_tokens["minimum"], spec_tokens["maximum"]) == (0, MAX_SPECULATIVE_TOKENS)
    assert engine["promptLookupMin"]["minimum"] == engine["promptLookupMax"]["minimum"] == 1
    # The CEL rule and validation_errors assume the server's defaults for an unset bound.
    server = EngineConfig()
    assert server.prompt_lookup_min == SERVER_PROMPT_LOOKUP_MIN
    assert server.prompt_lookup_max == SERVER_PROMPT_LOOKUP_MAX


def test_the_operator_defaults_equal_the_crd_defaults() -> None:
    # Every defaulted field set: the operator must read the same values whether or not
    # the API server filled the defaults in.
    spec = {
        "model": {"source": {"pvc": {"claimName": "c"}}},
        "accelerator": {"count": 1},
        "autoscaling": {"maxReplicas": 3},
        "service": {},
        "lifecycle": {},
    }
    schema = openapi_schema()["properties"]["spec"]
    defaulted = apply_defaults(schema, copy.deepcopy(spec))
    assert defaulted != spec
    assert parse_spec(defaulted) == parse_spec(spec)
    # and with nothing at all
    assert dataclasses.asdict(parse_spec(apply_defaults(schema, {}))) == dataclasses.asdict(
        parse_spec({})
    )
