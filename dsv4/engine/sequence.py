"""Per-sequence state shared by the scheduler, the runner and the engine (no tensors).

A request with ``n`` completions becomes ``n`` sequences that share the prompt ids and sample
independently.  A sequence's tokens are ``prompt + outputs`` in one list; the cache holds the
first ``num_computed_tokens`` of them.  When ``num_computed_tokens`` reaches ``num_tokens - 1``
the next step is a decode; preemption by recompute simply sets it back to 0.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dsv4.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


# The key of a sequence in the cache manager and in sampler results.
SeqKey = tuple[str, int]


@dataclass(eq=False)
class Sequence:
    """One sequence being generated.

    Args:
        request_id: the user's request id.
        index: which of the request's ``n`` completions this is.
        prompt_token_ids: the prompt (shared, not copied, between the ``n`` sequences).
        params: the request's sampling parameters.
        arrival: global admission order (smaller = older); FCFS and preemption use it.
        token_types: V4.1 per-prompt-token image marks (−1 text); generated tokens are text.
    """

    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    token_types: list[int] | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Next prompt position whose logprob is still missing (position 0 has none).
    prompt_logprobs_next: int = 1
    token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def key(self) -> SeqKey:
        return (self.request_id, self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose KV is not in the cache yet (1 for a decode)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_types_at(self, start: int, stop: int) -> list[int]:
        """Token types of positions ``start..stop-1`` (−1 beyond the prompt)."""
        if self.token_types is None:
            return [-1] * (stop - start)
        out = self.token_types[start:min(stop, self.num_prompt_tokens)]
        return out + [-1] * (stop - start - len(out))

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))
