"""pagedinfer's data plane: engine, scheduler, block manager, model, gRPC server.

`from pagedinfer.service import LLM, SamplingParams` is the offline API. `LLM` is
imported lazily so that the pure-Python parts (scheduler, block manager) never pull in
torch.
"""

from pagedinfer.service.config import EngineConfig
from pagedinfer.service.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from pagedinfer.service import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'pagedinfer.service' has no attribute {name!r}")
