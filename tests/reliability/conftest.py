"""Fixtures of the reliability suite: two real servers shared by the whole folder, and
the emulated cluster and operator of the operator tests.

The suite reuses the other folders' helpers rather than copying them: the server
harness of tests/service/test_server.py, the invariant checker of
tests/service/test_properties.py, the emulator and fake pods of tests/operator and the
chart tools of tests/charts. pytest puts each test folder on sys.path when it collects
it; `reuse` does the same for the folders whose helpers this one imports.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def reuse(*folders: str) -> None:
    """Makes the helper modules of other test folders importable by their plain names."""
    for folder in folders:
        path = str(TESTS / folder)
        if path not in sys.path:
            sys.path.append(path)


reuse("service", "operator", "charts")

from reliability_servers import (  # noqa: E402
    MAX_MODEL_LEN,
    TIGHT_BLOCKS,
    TIGHT_MAX_QUEUE,
    TIGHT_MAX_SEQS,
    TOKEN,
    make_certificate,
)
from test_server import Server, start_server, stop_server  # noqa: E402


def _operator_fixtures():
    """tests/operator/conftest.py, loaded under a name of its own (every folder has a
    conftest module), so that its fixtures can be re-exported here."""
    spec = importlib.util.spec_from_file_location(
        "operator_conftest", TESTS / "operator" / "conftest.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ops = _operator_fixtures()
cluster, operator, kmock_options = _ops.cluster, _ops.operator, _ops.kmock_options
fake_pods, kubelet = _ops.fake_pods, _ops.kubelet


@pytest.fixture(scope="session")
def roomy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Plain gRPC, the default 64 MiB KV cache (about 90 blocks): never preempts the
    suite's requests."""
    server = start_server(tmp_path_factory.mktemp("roomy"), "--max-model-len", str(MAX_MODEL_LEN))
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def tight_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """TLS with a certificate made here, a bearer token, an 8-block KV cache, three
    running sequences and a waiting queue of three."""
    directory = tmp_path_factory.mktemp("tight")
    server = start_server(
        directory,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--num-gpu-blocks", str(TIGHT_BLOCKS),
        "--max-num-seqs", str(TIGHT_MAX_SEQS),
        "--max-queue", str(TIGHT_MAX_QUEUE),
        token=TOKEN,
        tls=make_certificate(directory),
    )  # fmt: skip
    yield server
    stop_server(server)
