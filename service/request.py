"""One generation request as the scheduler and block manager see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedinfer.service.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """ "stop", "length" or "abort" for a finished request, None otherwise."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)  # identity semantics: two requests are never "equal"
class Request:
    """Token ids and progress of one sequence.

    `num_computed_tokens` counts the leading tokens of `all_token_ids` whose KV is in the
    cache. The last sampled token is never computed until the next step, so a running
    request always has at least one token left to compute. `block_table` is maintained
    only by the KV cache manager.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    parent_id: str | None = None  # set on the children of a fork (n > 1)
    index: int = 0  # sample number within its parent's family
    output_token_ids: list[int] = field(default_factory=list, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # prefix-cache hit at latest admission
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    block_table: list[int] = field(default_factory=list, init=False)
    first_scheduled_at: float | None = field(default=None, init=False)  # monotonic seconds

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        # Kept alongside the two parts so that reading all tokens costs no copy.
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. Read-only: use append_output_token to extend."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
