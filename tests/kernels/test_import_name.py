"""The repository's `kernels/` folder is `pagedinfer.kernels`, never the top-level `kernels`.

Run from a checkout's root (`python -m ...`), the root is on sys.path and the folder is
found as a top-level package `kernels`, the name of a PyPI package that transformers
imports. These run a fresh interpreter in the root, as the tests' servers are started.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_in_root(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def installed_kernels() -> bool:
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not installed_kernels(), reason="no PyPI package `kernels` installed")
def test_top_level_kernels_is_the_installed_package_in_a_checkout_root():
    done = run_in_root("import kernels; print(kernels.__file__)")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).parent != ROOT / "kernels"


def test_transformers_model_configs_import_in_a_checkout_root():
    done = run_in_root("from transformers import LlamaConfig; print(LlamaConfig.model_type)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "llama"


def test_pagedinfer_kernels_is_this_folder():
    done = run_in_root("import pagedinfer.kernels as k; print(k.__file__, k.write_kv.__name__)")
    assert done.returncode == 0, done.stderr
    path, name = done.stdout.split()
    assert Path(path) == ROOT / "kernels" / "__init__.py"
    assert name == "write_kv"


@pytest.mark.parametrize("folder", ["kernels", "service"])
def test_a_process_without_pagedinfer_imports_the_folder_as_an_empty_module(folder):
    """A peer's process (vLLM's, in its own environment) started in the root: pagedinfer
    is not importable there, and transformers' probe for a `kernels` package imports
    whatever it finds under that name."""
    done = run_in_root(
        "import sys; sys.modules['pagedinfer'] = None\n"
        "sys.path[:] = [p for p in sys.path if 'site-packages' not in p]  # nor `kernels`\n"
        f"import {folder}\n"
        f"print({folder}.__file__)\n"
        f"print([n for n in {folder}.__all__ if n in vars({folder})])"
    )
    assert done.returncode == 0, done.stderr
    path, names = done.stdout.splitlines()
    assert Path(path) == ROOT / folder / "__init__.py" and names == "[]"


def test_transformers_finds_no_kernels_package_in_a_root_without_pagedinfer():
    done = run_in_root(
        "import sys; sys.modules['pagedinfer'] = None\n"
        "from transformers.utils import import_utils\n"
        "print(import_utils.is_kernels_available())"
    )
    assert done.returncode == 0, done.stderr
    if not installed_kernels():  # else the installed package answers for itself
        assert done.stdout.strip() == "False"
