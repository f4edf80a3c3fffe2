"""pagedinfer's data plane: engine, scheduler, block manager, model, gRPC server.

`from pagedinfer.service import LLM, SamplingParams` is the offline API. `LLM` is
imported lazily so that the pure-Python parts (scheduler, block manager) never pull in
torch. Importing it changes no environment variable: the OpenMP settings the CPU engine
wants are applied where an engine starts (`pagedinfer.service.openmp`).
"""

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]

# Found as a top-level `service` (by a process started at the repository root), this
# folder stays an empty module: it never imports pagedinfer, which that process may lack.
if __name__ == "pagedinfer.service":
    from pagedinfer.service.config import EngineConfig
    from pagedinfer.service.outputs import RequestOutput
    from pagedinfer.service.sampling_params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":
        from pagedinfer.service.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedinfer.service' has no attribute {name!r}")
