"""The offline API of DESIGN.md section 3: `LLM().generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence

from pagedinfer.service.config import EngineConfig
from pagedinfer.service.engine import LLMEngine
from pagedinfer.service.outputs import CompletionOutput, RequestOutput
from pagedinfer.service.sampling_params import SamplingParams


class LLM:
    """Batch generation in this process: every prompt runs to completion in one call."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
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
