"""Fixtures of the end-to-end test: the operator tests' emulated API server and
operator (re-exported, see suite_reuse.py), and a kubelet that runs real servers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from suite_reuse import operator_fixtures, reuse

reuse("service", "operator")

from operator_fakes import NAMESPACE  # noqa: E402
from server_kubelet import ServerKubelet  # noqa: E402

_operator = operator_fixtures()
cluster, operator, kmock_options = _operator.cluster, _operator.operator, _operator.kmock_options


@pytest_asyncio.fixture
async def server_kubelet(cluster, tmp_path) -> AsyncIterator[ServerKubelet]:
    kubelet = ServerKubelet(cluster, NAMESPACE, tmp_path)
    kubelet.start()
    yield kubelet
    await kubelet.stop()
