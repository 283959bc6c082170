"""Sampling parameters and request outputs, with vLLM's names and defaults.

``SamplingParams`` validates itself on construction: a bad value raises ``ValueError`` naming the
field, the value and the allowed range.  ``RequestOutput`` / ``CompletionOutput`` carry the
cumulative state of a request (text and token ids so far), as vLLM's offline API does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS; spec §5 uses max(T, 1e-5)).
GREEDY_EPS = 1e-5


def _bad(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"SamplingParams.{name}={value!r} is invalid; allowed: {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How to sample one request (vLLM names and defaults).

    ``top_k`` of 0 or -1 and ``top_p`` of 1.0 switch those filters off; ``temperature`` 0 is
    greedy.  ``max_tokens=None`` means "until max_model_len".  ``seed`` makes the request's
    samples reproducible and independent of whatever else is in the batch; with ``n > 1``
    sequence ``i`` uses ``seed + i``.  ``logprobs=k`` returns, per generated token, the top-k
    tokens plus the sampled one; ``prompt_logprobs=k`` the same for every prompt token after the
    first.  Log-probabilities are those of the raw model distribution (before temperature,
    penalties and filters), as vLLM's default ``raw_logprobs`` mode.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Normalize the list-like fields first so that later code sees one shape.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature, "a finite number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "-1 or 0 (off) or an integer >= 1")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad("min_p", self.min_p, "a number in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", self.seed, "an integer or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", self.max_tokens, "an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"<= max_tokens={self.max_tokens}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise _bad(f"stop[{i}]", s, "a non-empty string")
        for i, t in enumerate(self.stop_token_ids):
            if not _is_int(t) or t < 0:
                raise _bad(f"stop_token_ids[{i}]", t, "a token id >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise _bad(name, value, "a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _bad("repetition_penalty", self.repetition_penalty, "a number > 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise _bad(name, value, "an integer >= 0 or None")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "True or False")

    # ------------------------------------------------------------------ derived facts
    @property
    def greedy(self) -> bool:
        """Temperature 0 (below 1e-5): argmax, no randomness."""
        return self.temperature < GREEDY_EPS

    @property
    def top_k_active(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 when none)."""
        return max((len(s) for s in self.stop), default=0)

    def clone(self, **changes: Any) -> "SamplingParams":
        """A validated copy with some fields changed."""
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values["stop"] = list(self.stop)
        values["stop_token_ids"] = list(self.stop_token_ids)
        values.update(changes)
        return SamplingParams(**values)


@dataclass
class Logprob:
    """The log-probability of one token, its 1-based rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the top-N and the sampled/actual token).
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic()`` seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    """One generated sequence of a request (cumulative so far).

    ``finish_reason`` is None while running, then "stop" (eos, a stop token or a stop string),
    "length" (max_tokens or max_model_len) or "abort".  ``stop_reason`` is the stop string or
    stop token id that ended it (None for eos and length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step: its prompt and its ``n`` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None)
