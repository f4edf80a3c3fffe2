"""Fixtures of the reliability suite: two real servers shared by the whole folder, and
the emulated cluster and operator of the operator tests (re-exported, not copied; see
tests/e2e/suite_reuse.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "e2e"))
from suite_reuse import operator_fixtures, reuse

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

_operator = operator_fixtures()
cluster, operator, kmock_options = _operator.cluster, _operator.operator, _operator.kmock_options
fake_pods, kubelet = _operator.fake_pods, _operator.kubelet


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
