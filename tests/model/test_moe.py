"""MoE (spec §3.9): routing, the grouped expert op, the module against transformers' own
DeepSeek-V4 MoE block with shared random weights, and official-numerics input quantization."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4.formats import fake_quant_fp8, quant_mxfp4, QuantWeight
from dsv4.model.moe import MoE
from dsv4.ops import get_ops
from dsv4.ops import torch_dense as td
from test_parity_util import hf_config, hf_modeling, small_config

E, I, D, K = 8, 16, 32, 2


def _random_moe(cfg, layer_id: int, seed: int, numerics: str = "bf16",
                dtype: torch.dtype = torch.float32) -> MoE:
    g = torch.Generator().manual_seed(seed)
    moe = MoE(cfg, layer_id, numerics, get_ops("torch"), dtype)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(E, D, generator=g) * 0.5)
        if moe.gate.is_hash:
            moe.gate.tid2eid.copy_(torch.stack(
                [torch.randperm(E, generator=g)[:K] for _ in range(cfg.vocab_size)]))
        else:
            moe.gate.bias.copy_(torch.randn(E, generator=g) * 0.3)
        # Large enough that the ±swiglu_limit clamp is active for some channels.
        for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2):
            w.copy_(torch.randn(w.shape, generator=g) * 1.5)
        for lin in (moe.shared_experts.w1, moe.shared_experts.w2, moe.shared_experts.w3):
            lin.load_weight(torch.randn(lin.weight.shape, generator=g) * 1.5)
    return moe


def _naive_experts(x, ids, weights, w1, w3, w2, limit):
    """Per-token, per-pick loop of spec §3.9 (the op must equal it)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g = (w1[e].double() @ x[t].double()).clamp(max=limit)
            u = (w3[e].double() @ x[t].double()).clamp(-limit, limit)
            out[t] += w2[e].double() @ (weights[t, j].double() * F.silu(g) * u)
    return out


def test_moe_experts_equals_per_token_loop_and_clamps() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, D, generator=g) * 3
    ids = torch.randint(0, E, (11, K), generator=g)
    weights = torch.rand(11, K, generator=g)
    w = td.ExpertWeights(torch.randn(E, I, D, generator=g), torch.randn(E, I, D, generator=g),
                         torch.randn(E, D, I, generator=g))
    y = td.moe_experts(x, ids, weights, w, 10.0)
    assert y.dtype == torch.float32 and y.shape == (11, D)
    torch.testing.assert_close(y.double(), _naive_experts(x, ids, weights, w.w1, w.w3, w.w2, 10.0),
                               rtol=1e-4, atol=1e-3)
    # The clamp matters at these magnitudes: without it the result differs.
    y_noclamp = td.moe_experts(x, ids, weights, w, 0.0)
    assert (y - y_noclamp).abs().max() > 1.0


def test_moe_experts_skips_ids_outside_the_local_experts() -> None:
    """Expert-parallel shards pass ids they do not hold (e.g. -1 or >= E): they add nothing."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, D, generator=g)
    ids = torch.randint(0, E, (5, K), generator=g)
    weights = torch.rand(5, K, generator=g)
    w = td.ExpertWeights(torch.randn(E, I, D, generator=g), torch.randn(E, I, D, generator=g),
                         torch.randn(E, D, I, generator=g))
    masked = ids.clone()
    masked[:, 1] = torch.tensor([-1, E, E + 3, -1, E])
    only_first = td.moe_experts(x, ids[:, :1], weights[:, :1], w, 10.0)
    torch.testing.assert_close(td.moe_experts(x, masked, weights, w, 10.0), only_first)
    assert td.moe_experts(x[:0], ids[:0], weights[:0], w, 10.0).shape == (0, D)


def test_gate_routing_rules() -> None:
    cfg = small_config()
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(2))
    ids_in = torch.tensor([3, 7, 7, 0, 95, 12])
    # Hash layer: the picks are tid2eid rows; weights are normalized sqrtsoftplus scores.
    hash_gate = _random_moe(cfg, 0, 3).gate
    w, ids = hash_gate(x, ids_in)
    assert torch.equal(ids, hash_gate.tid2eid[ids_in])
    s = F.softplus(x.double() @ hash_gate.weight.double().T).sqrt()
    ref = s.gather(1, ids)
    torch.testing.assert_close(w.double(), ref / ref.sum(-1, keepdim=True) * cfg.route_scale)
    # Learned layer: the bias steers the selection but not the weights.
    gate = _random_moe(cfg, 1, 4).gate
    w, ids = gate(x, ids_in)
    s = F.softplus(x.double() @ gate.weight.double().T).sqrt()
    assert torch.equal(ids.sort(-1).values, (s + gate.bias.double()).topk(K).indices.sort(-1).values)
    ref = s.gather(1, ids)
    torch.testing.assert_close(w.double(), ref / ref.sum(-1, keepdim=True) * cfg.route_scale)
    torch.testing.assert_close(w.sum(-1), torch.full((6,), cfg.route_scale))


@pytest.mark.parametrize("layer_id", [0, 1])
def test_moe_matches_transformers_block(layer_id: int) -> None:
    mod = hf_modeling()
    cfg = small_config()
    ours = _random_moe(cfg, layer_id, 10 + layer_id)
    theirs = mod.DeepseekV4SparseMoeBlock(hf_config(cfg), layer_id).float()
    assert theirs.is_hash == ours.gate.is_hash
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.gate.weight)
        if ours.gate.is_hash:
            theirs.gate.tid2eid.copy_(ours.gate.tid2eid)
        else:
            theirs.gate.e_score_correction_bias.copy_(ours.gate.bias)
        theirs.experts.gate_up_proj.copy_(torch.cat([ours.experts.w1, ours.experts.w3], dim=1))
        theirs.experts.down_proj.copy_(ours.experts.w2)
        theirs.shared_experts.gate_proj.weight.copy_(ours.shared_experts.w1.weight)
        theirs.shared_experts.up_proj.weight.copy_(ours.shared_experts.w3.weight)
        theirs.shared_experts.down_proj.weight.copy_(ours.shared_experts.w2.weight)
    g = torch.Generator().manual_seed(20)
    x = torch.randn(13, D, generator=g) * 2
    ids_in = torch.randint(0, cfg.vocab_size, (13,), generator=g)
    with torch.no_grad():
        y = ours(x, ids_in)
        y_hf = theirs(x[None], input_ids=ids_in[None])[0]
    assert y.shape == (13, D) and y.dtype == torch.float32
    # The routing weight multiplies before w2 here (reference) and after it in transformers:
    # equal up to fp32 rounding.
    torch.testing.assert_close(y, y_hf, rtol=1e-5, atol=1e-4)


def test_official_numerics_quantizes_expert_inputs() -> None:
    """A quantized checkpoint under official numerics feeds the experts FP8 fake-quantized
    inputs (block = weight_block_size); bf16 numerics does not."""
    cfg = small_config(quantization_config=dict(
        quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0", weight_block_size=[32, 32]),
        expert_dtype="fp4", q_lora_rank=32, moe_intermediate_size=32)
    plain = _random_moe(cfg, 1, 5, numerics="bf16")
    official = _random_moe(cfg, 1, 5, numerics="official")
    assert plain.experts.act_block is None and official.experts.act_block == 32
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(6))
    ids = torch.randint(0, cfg.vocab_size, (7,))
    with torch.no_grad():
        w, picks = official.gate(x, ids)
        ew = official.experts.weights()
        # Hand-built: quantize the input, then the weighted activation before w2.
        ref = torch.zeros(7, D)
        for t in range(7):
            xq = fake_quant_fp8(x[t:t + 1], 32)
            for j in range(K):
                e = int(picks[t, j])
                a = td.swiglu(xq @ ew.w1[e].T, xq @ ew.w3[e].T, cfg.swiglu_limit) * w[t, j]
                ref[t] += (fake_quant_fp8(a, 32) @ ew.w2[e].T)[0]
        routed = td.moe_experts(x, picks, w, ew, cfg.swiglu_limit)
        torch.testing.assert_close(routed, ref, rtol=1e-5, atol=1e-4)
        assert not torch.allclose(official(x, ids), plain(x, ids), atol=1e-3)


def test_experts_load_dense_and_quantized_rows() -> None:
    cfg = small_config()
    moe = MoE(cfg, 1, "bf16", get_ops("torch"), torch.float32)
    targets = moe.experts.official_targets("layers.1.ffn.experts.")
    assert len(targets) == 3 * E and "layers.1.ffn.experts.7.w2.weight" in targets
    w = torch.randn(I, D)
    targets["layers.1.ffn.experts.3.w1.weight"](w)
    torch.testing.assert_close(moe.experts.w1[3], w)
    packed, scale = quant_mxfp4(torch.randn(I, D))
    qw = QuantWeight(packed, scale, "fp4", 32, (I, D))
    targets["layers.1.ffn.experts.5.w3.weight"](qw)
    torch.testing.assert_close(moe.experts.w3[5], qw.dequantize(torch.float32))
    assert moe.experts.w3[4].abs().sum() == 0  # other rows untouched
    with pytest.raises(ValueError, match=r"experts\.2\.w3\.weight: expected logical shape"):
        targets["layers.1.ffn.experts.2.w3.weight"](torch.randn(I, D + 1))
    with pytest.raises(ValueError, match="MoE: expected x"):
        moe(torch.randn(3, D), torch.zeros(4, dtype=torch.long))
