"""Sampler on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.engine.sampler import Sampler, SamplingRow, token_logprobs
from dsv4.engine.sampling_params import SamplingParams


def row(**kw) -> SamplingRow:
    extra = {k: kw.pop(k) for k in ("prompt_token_ids", "output_token_ids", "generator") if k in kw}
    return SamplingRow(params=SamplingParams(**kw), **extra)


def logits_of_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log().unsqueeze(0)


def test_greedy_is_argmax_and_consumes_no_randomness() -> None:
    s = Sampler(seed=0)
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    state = s.generator.get_state()
    out = s.sample(logits, [row(temperature=0.0), row(temperature=0.0)])
    assert out.token_ids == [1, 0]
    assert torch.equal(s.generator.get_state(), state)


def test_penalties_on_hand_made_logits() -> None:
    s = Sampler()
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    rep = s._apply_penalties(logits, [row(repetition_penalty=2.0, prompt_token_ids=[0],
                                          output_token_ids=[1])])
    assert rep.tolist() == [[1.0, -2.0, 0.5, 1.0]]
    freq = s._apply_penalties(logits, [row(frequency_penalty=0.5, presence_penalty=0.25,
                                           prompt_token_ids=[2], output_token_ids=[3, 3, 0])])
    # token 3 seen twice: 1.0 - 2*0.5 - 0.25; token 0 once: 2.0 - 0.5 - 0.25; prompt ignored
    assert freq.tolist() == [[1.25, -1.0, 0.5, -0.25]]
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 1.0]]))  # input untouched
    # Penalties act before greedy: token 0 is the argmax only without them.
    out = s.sample(logits, [row(temperature=0, frequency_penalty=2.0, output_token_ids=[0])])
    assert out.token_ids == [3]


def test_filters_keep_the_expected_sets() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    lg = logits_of_probs(probs)

    def kept(**kw) -> list[int]:
        p = Sampler._filtered_probs(lg, [row(**kw)])[0]
        return [i for i, v in enumerate(p.tolist()) if v > 0]

    assert kept() == [0, 1, 2, 3]
    assert kept(top_k=2) == [0, 1]
    assert kept(top_k=-1) == [0, 1, 2, 3]
    assert kept(top_p=0.8) == [0, 1]
    assert kept(top_p=0.81) == [0, 1, 2]
    assert kept(top_p=0.01) == [0]
    assert kept(min_p=0.2) == [0, 1, 2]  # threshold 0.1
    assert kept(min_p=0.7) == [0]
    # top-p renormalizes after top-k: (0.5 + 0.3) / 0.95 = 0.842 reaches 0.84, 0.8 would not
    assert kept(top_k=3, top_p=0.84) == [0, 1]
    assert kept(top_p=0.84) == [0, 1, 2]
    # Kept mass is renormalized.
    p = Sampler._filtered_probs(lg, [row(top_k=2)])[0]
    assert p[:2].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8])


def test_temperature_scales_logits() -> None:
    lg = torch.tensor([[1.0, 2.0, 3.0]])
    p = Sampler._filtered_probs(lg, [row(temperature=0.5)])[0]
    assert torch.allclose(p, torch.softmax(lg[0] / 0.5, dim=-1))


def test_sampling_frequencies_follow_the_filtered_distribution() -> None:
    s = Sampler(seed=123)
    lg = logits_of_probs([0.5, 0.3, 0.15, 0.05]).expand(4000, 4).contiguous()
    toks = torch.tensor(s.sample(lg, [row(top_k=3) for _ in range(4000)]).token_ids)
    freq = torch.bincount(toks, minlength=4).float() / 4000
    expect = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert freq[3] == 0
    assert torch.allclose(freq, expect, atol=0.03), freq


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    vocab = 50
    torch.manual_seed(0)
    steps = [torch.randn(3, vocab) for _ in range(5)]

    def run(batch_rows: int, seeded_at: int) -> list[int]:
        s = Sampler(seed=99 + batch_rows)
        gen = s.make_generator(7)
        got = []
        for lg in steps:
            rows = [row() for _ in range(batch_rows)]
            rows[seeded_at] = row(generator=gen)
            big = lg[0:1].expand(batch_rows, vocab).clone()
            big[seeded_at] = lg[1]
            got.append(s.sample(big, rows).token_ids[seeded_at])
        return got

    alone = run(1, 0)
    assert run(3, 2) == alone
    assert run(4, 0) == alone
    # A different seed gives a different stream (5 draws over 50 tokens).
    s = Sampler()
    other = s.make_generator(8)
    assert [s.sample(lg[1:2], [row(generator=other)]).token_ids[0] for lg in steps] != alone


def test_logprobs_values_and_ranks() -> None:
    s = Sampler()
    lg = torch.tensor([[1.0, 3.0, 2.0, 3.0 - 1e-3, -5.0]])
    out = s.sample(lg, [row(temperature=0, logprobs=3, frequency_penalty=2.0,
                            output_token_ids=[1])])
    # Penalties change the pick (token 3) but logprobs are of the raw logits.
    assert out.token_ids == [3]
    lp = torch.log_softmax(lg[0], dim=-1)
    info = out.logprobs[0]
    tok, val, rank = info.token
    assert (tok, rank) == (3, 2) and val == pytest.approx(lp[3].item())
    assert [(t, r) for t, _, r in info.top] == [(1, 1), (3, 2), (2, 3)]
    assert [v for _, v, _ in info.top] == pytest.approx(lp[[1, 3, 2]].tolist())
    assert math.isclose(sum(math.exp(v) for v in lp.tolist()), 1.0, rel_tol=1e-6)
    none = s.sample(lg, [row(temperature=0)])
    assert none.logprobs == [None]
    zero = s.sample(lg, [row(temperature=0, logprobs=0)]).logprobs[0]
    assert zero.top == [] and zero.token[0] == 1 and zero.token[2] == 1


def test_token_logprobs_of_given_targets() -> None:
    lg = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    got = token_logprobs(lg, [0, 0], [1, 2])
    assert got[0].token[2] == 3 and got[1].token[2] == 1
    assert [t for t, _, _ in got[0].top] == [2]
    assert [t for t, _, _ in got[1].top] == [0, 1]


def test_shape_mismatch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"shape \(2, 3\) for 1 rows"):
        Sampler().sample(torch.zeros(2, 3), [row()])
