"""SamplingParams defaults and validation messages."""

from __future__ import annotations

import pytest

from dsv4.engine.sampling_params import SamplingParams


def test_vllm_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == \
        (1, 1.0, 1.0, 0, 0.0, None, 16)
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="x").stop == ["x"]


@pytest.mark.parametrize("field, value, allowed", [
    ("n", 0, ">= 1"),
    ("temperature", -0.1, ">= 0"),
    ("temperature", float("nan"), ">= 0"),
    ("top_p", 0.0, r"\(0, 1\]"),
    ("top_p", 1.5, r"\(0, 1\]"),
    ("top_k", -2, "-1 or 0"),
    ("min_p", 1.1, r"\[0, 1\]"),
    ("max_tokens", 0, ">= 1"),
    ("presence_penalty", 2.5, r"\[-2, 2\]"),
    ("frequency_penalty", -3, r"\[-2, 2\]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("logprobs", -1, ">= 0"),
    ("prompt_logprobs", 1.5, ">= 0"),
    ("seed", "7", "integer"),
    ("ignore_eos", 1, "True or False"),
])
def test_invalid_values_name_field_value_and_range(field: str, value, allowed: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*allowed: .*{allowed}"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens=5.*max_tokens=3"):
        SamplingParams(min_tokens=5, max_tokens=3)


def test_clone_validates() -> None:
    p = SamplingParams(stop=["a"], seed=3)
    q = p.clone(seed=4)
    assert q.seed == 4 and q.stop == ["a"] and p.seed == 3
    with pytest.raises(ValueError, match="top_k"):
        p.clone(top_k=-5)
