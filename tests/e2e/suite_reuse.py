"""How the end-to-end and reliability suites reuse other test folders' helpers instead
of copying them: the server harness of tests/service/test_server.py, the invariant
checker of tests/service/test_properties.py, the emulator, fake pods and helpers of
tests/operator and the chart tools of tests/charts.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]


def reuse(*folders: str) -> None:
    """Makes the helper modules of other test folders importable by their plain names,
    as pytest does for a folder when it collects it."""
    for folder in folders:
        path = str(TESTS / folder)
        if path not in sys.path:
            sys.path.append(path)


def operator_fixtures() -> ModuleType:
    """tests/operator/conftest.py, loaded under a name of its own (every test folder has
    a `conftest` module), so that a conftest can re-export its fixtures: the emulated
    API server (`cluster`, `kmock_options`), the operator, fake pods and their kubelet."""
    reuse("operator")
    spec = importlib.util.spec_from_file_location(
        "operator_conftest", TESTS / "operator" / "conftest.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
