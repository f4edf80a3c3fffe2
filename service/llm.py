"""The offline API (docs/architecture.md section 8): `LLM().generate(prompts,
SamplingParams(...))`.

The engine (and with it torch) is imported when an `LLM` is made, after the CPU engine's
OpenMP settings are applied (`openmp.spin_env`): they count only before torch loads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedinfer.service import openmp
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.outputs import CompletionOutput, RequestOutput
from pagedinfer.service.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedinfer.service.engine import LLMEngine


class LLM:
    """Batch generation in this process: every prompt runs to completion in one call."""

    def __init__(self, model: str | None = None, **engine_args):
        os.environ.update(openmp.spin_env())
        from pagedinfer.service.engine import LLMEngine

        self.engine: LLMEngine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. `prompts` is a string, a list of token ids,
        or a list of either; `sampling_params` one for all, or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params)} entries for {len(prompts)} prompts"
            )
        # Every request is checked before any is queued: a bad one leaves nothing behind.
        requests = [
            self.engine.make_request(self._encode(prompt), p)
            for prompt, p in zip(prompts, params, strict=True)
        ]
        outputs: dict[str, RequestOutput] = {}
        for request in requests:
            self.engine.add_request(request)
            outputs[request.request_id] = RequestOutput(
                request.request_id,
                request.prompt_token_ids,
                [CompletionOutput(i) for i in range(request.sampling_params.n)],
            )
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                outputs[delta.request_id].add(delta)
        return list(outputs.values())

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.engine.encode_prompt(prompt=prompt)
        return self.engine.encode_prompt(prompt_token_ids=prompt)
