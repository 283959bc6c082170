"""Single-pass mHC helpers (spec §4.6) and V4.1 MoE routing (spec §4.8)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dsv4.model.v41 import (hc_collapse, hc_final_collapse, hc_mixes, identity_pre_mix,
                            route_v41, single_pass_block)
from dsv4.ops import get_ops

N, D = 4, 8


def _hc_params(g: torch.Generator) -> SimpleNamespace:
    mix = (2 + N) * N
    return SimpleNamespace(fn=torch.randn(mix, N * D, generator=g) * 0.1,
                           scale=torch.rand(3, generator=g) + 0.5,
                           base=torch.randn(mix, generator=g) * 0.1)


def test_identity_pre_mix_selects_stream_0() -> None:
    pre = identity_pre_mix(N)
    assert pre.tolist() == [1.0, 0.0, 0.0, 0.0] and pre.dtype == torch.float32
    x = torch.randn(3, N, D).to(torch.bfloat16)
    assert torch.equal(hc_collapse(x, pre), x[:, 0])
    assert torch.equal(hc_collapse(x, identity_pre_mix(N, 3)), x[:, 0])
    with pytest.raises(ValueError, match="n_hc"):
        identity_pre_mix(0)


def test_collapse_by_hand_and_errors() -> None:
    x = torch.tensor([[[1.0, 2.0], [10.0, 20.0]]])
    assert hc_collapse(x, torch.tensor([[0.5, 0.25]])).tolist() == [[3.0, 6.0]]  # 0.5·1 + 0.25·10, 0.5·2 + 0.25·20
    assert torch.equal(hc_final_collapse(x, torch.tensor([0.5, 0.25])), hc_collapse(
        x, torch.tensor([[0.5, 0.25]])))
    with pytest.raises(ValueError, match="hc_collapse"):
        hc_collapse(x, torch.ones(3))


def test_mixes_agree_with_v4_hc_pre() -> None:
    """Collapsing with a sublayer's own pre gives V4's hc_pre output; post/comb are the same."""
    g = torch.Generator().manual_seed(0)
    p = _hc_params(g)
    x = torch.randn(5, N, D, generator=g)
    pre, post, comb = hc_mixes(x, p.fn, p.scale, p.base, 1e-20, 1e-6, 20)
    y, post4, comb4 = get_ops("torch").hc_pre(x, p.fn, p.scale, p.base, 1e-20, 1e-6, 20)
    torch.testing.assert_close(hc_collapse(x, pre), y, rtol=1e-6, atol=1e-6)
    assert torch.equal(post, post4) and torch.equal(comb, comb4)
    assert pre.shape == (5, N) and bool((pre > 0).all())
    with pytest.raises(ValueError, match="fn must be"):
        hc_mixes(x, p.fn[:, :-1], p.scale, p.base, 1e-20, 1e-6, 20)


def test_single_pass_block_wiring() -> None:
    """Attention reads the previous pre-mix, the FFN the attention mixes' pre; the block hands
    on the FFN mixes' pre (spec §4.6 pseudo-code, two layers from the identity)."""
    g = torch.Generator().manual_seed(1)
    layers = [(_hc_params(g), _hc_params(g)) for _ in range(2)]
    seen: list[torch.Tensor] = []

    def attn(y: torch.Tensor) -> torch.Tensor:
        seen.append(y)
        return torch.tanh(y) * 2

    def ffn(y: torch.Tensor) -> torch.Tensor:
        seen.append(y)
        return y.square() - 1

    x0 = torch.randn(3, N, D, generator=g)
    x, pre_mix = x0, identity_pre_mix(N, 3)
    for hc_a, hc_f in layers:
        x, pre_mix = single_pass_block(x, pre_mix, hc_a, hc_f, attn, ffn, 1e-20, 1e-6, 20)
    # the same two layers written out step by step
    ops = get_ops("torch")
    X, pm, expect_inputs = x0, identity_pre_mix(N, 3), []
    for hc_a, hc_f in layers:
        a_pre, a_post, a_comb = hc_mixes(X, hc_a.fn, hc_a.scale, hc_a.base, 1e-20, 1e-6, 20)
        y = hc_collapse(X, pm)
        expect_inputs.append(y)
        X = ops.hc_post(torch.tanh(y) * 2, X, a_post, a_comb)
        f_pre, f_post, f_comb = hc_mixes(X, hc_f.fn, hc_f.scale, hc_f.base, 1e-20, 1e-6, 20)
        y = hc_collapse(X, a_pre)
        expect_inputs.append(y)
        X = ops.hc_post(y.square() - 1, X, f_post, f_comb)
        pm = f_pre
    assert torch.equal(seen[0], x0[:, 0])  # layer 0's attention sees stream 0 only
    assert all(torch.equal(a, b) for a, b in zip(seen, expect_inputs))
    assert torch.equal(x, X) and torch.equal(pre_mix, pm)


def _sqrt_softplus(z: float) -> float:
    return math.sqrt(math.log1p(math.exp(z)))


def test_route_by_hand() -> None:
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    gate_w = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 0.0], [-1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])      # steers text tokens to expert 2
    bias_vl = torch.tensor([0.0, 0.0, 0.0, 9.0])   # steers image tokens to expert 3
    image = torch.tensor([False, True])
    ids, w = route_v41(x, gate_w, bias, bias_vl, image, top_k=2, route_scale=1.5, gate_temp=2.0)
    s = [_sqrt_softplus(z / 2.0) for z in (2.0, 1.0, 0.0, -1.0)]
    assert ids.tolist() == [[2, 0], [3, 0]]
    want = [[s[2], s[0]], [s[3], s[0]]]
    for row, (a, b) in zip(w.tolist(), want):
        assert row == pytest.approx([1.5 * a / (a + b + 1e-20), 1.5 * b / (a + b + 1e-20)],
                                    rel=1e-6)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    # no image mask (or no bias_vl): every token uses bias
    ids2, _ = route_v41(x, gate_w, bias, bias_vl, None, 2, 1.5, 2.0)
    assert ids2.tolist() == [[2, 0], [2, 0]]
    # top-1 and norm_topk_prob False: the raw score times route_scale
    ids3, w3 = route_v41(x, gate_w, torch.zeros(4), None, None, 1, 1.5, 1.0)
    assert ids3.tolist() == [[0], [0]] and w3[0, 0].item() == pytest.approx(1.5 * _sqrt_softplus(2.0))
    _, w4 = route_v41(x, gate_w, bias, None, None, 2, 1.0, 1.0, norm_topk_prob=False)
    assert w4[0].tolist() == pytest.approx([_sqrt_softplus(0.0), _sqrt_softplus(2.0)])


def test_route_eps_keeps_all_zero_weights_finite() -> None:
    # softplus of a very negative logit underflows to 0: the +1e-20 avoids 0/0
    x = torch.tensor([[1.0]])
    gate_w = torch.tensor([[-200.0], [-300.0], [-250.0]])
    _, w = route_v41(x, gate_w, torch.zeros(3), None, None, 2, 1.5)
    assert torch.isfinite(w).all()


def test_route_errors() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="top_k"):
        route_v41(x, torch.zeros(4, 3), torch.zeros(4), None, None, 5, 1.0)
    with pytest.raises(ValueError, match="gate_w"):
        route_v41(x, torch.zeros(4, 2), torch.zeros(4), None, None, 2, 1.0)
    with pytest.raises(ValueError, match="image_mask"):
        route_v41(x, torch.zeros(4, 3), torch.zeros(4), torch.zeros(4),
                  torch.zeros(3, dtype=torch.bool), 2, 1.0)
