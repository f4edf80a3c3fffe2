"""pagedinfer's data plane: engine, scheduler, block manager, model, gRPC server.

`from pagedinfer.service import LLM, SamplingParams` is the offline API. `LLM` is
imported lazily so that the pure-Python parts (scheduler, block manager) never pull in
torch.
"""

import os
import sys

# OpenMP's threads (torch's and MKL's, from GNU libgomp) spin after each parallel region
# before they sleep, 300,000 times by default: milliseconds in which they hold the cores
# that the engine's compiled kernels need right after torch's ops. 30,000 spins still
# bridge the gaps between torch's back-to-back ops. libgomp reads this when torch loads,
# so it is set only where torch is not loaded yet, and never over an operator's own
# GOMP_SPINCOUNT or OMP_WAIT_POLICY.
OPENMP_SPIN_COUNT = "30000"
if "torch" not in sys.modules and not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(os.environ):
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT

from pagedinfer.service.config import EngineConfig  # noqa: E402
from pagedinfer.service.outputs import RequestOutput  # noqa: E402
from pagedinfer.service.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from pagedinfer.service.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedinfer.service' has no attribute {name!r}")
