"""benchmarks/soak.py for a quarter of a minute, so that it cannot rot: its own server
under the day's mix of requests, sampled, drained to every block free. The memory's
figures are printed, not asserted: a short run mostly shows the warm-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_a_short_soak_serves_every_kind_of_request_and_leaks_no_block(
    tmp_path: Path, default_model_dir: Path
) -> None:
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--minutes", "0.25", "--concurrency", "3",
         "--max-tokens", "8", "--threads", "1", "--kv-cache-memory", "64MiB",
         "--max-model-len", "512", "--json", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    result = json.loads(out.read_text())
    assert result == json.loads(done.stdout)
    requests = result["requests"]
    assert requests["failed"] == 0 and requests["total"] > 0, result["first_failures"]
    assert requests["total"] == sum(v for k, v in requests.items() if k != "total")
    assert result["blocks_leaked"] == 0 and result["blocks_total"] > 0
    assert len(result["samples"]) >= 2
    assert all(s["rss_mib"] > 0 and "blocks_free" in s for s in result["samples"])
    rss = result["rss_mib"]
    assert rss["first_quarter_mean"] <= rss["max"] and rss["last_quarter_mean"] <= rss["max"]
