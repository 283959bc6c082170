"""The compressor alone: pooling formula (spec §3.7) and bit-identical entries whatever the split
into steps.  Inputs and weights are small integers, so every projection is exact in fp32 and
any difference could only come from the pooling itself."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.tensors import HybridCache
from dsv4.model.compressor import Compressor, entry_plan
from dsv4.model.context import StepContext
from dsv4.ops import get_ops
from test_attention_helpers import LAYER_CSA, LAYER_HCA, tiny_config


def _int_tensor(shape, seed: int, lo: int = -2, hi: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).float()


def _compressor(layer: int, name: str = "attn"):
    cfg = tiny_config()
    cache = HybridCache.allocate(cfg, 4, 3, 128, torch.float32)
    state = cache.compressor_state(layer, name)
    comp = Compressor(cfg, layer, state.spec, "bf16", get_ops("torch"), torch.float32,
                      rotate=name == "index")
    w = state.spec.state_width
    with torch.no_grad():
        comp.wkv.weight.copy_(_int_tensor((w, cfg.dim), 1) / 8)
        comp.wgate.weight.copy_(_int_tensor((w, cfg.dim), 2) / 16)
        comp.ape.copy_(_int_tensor(comp.ape.shape, 3) / 4)
    return comp, cache, state


def _pool_steps(comp, cache, state, x, sizes, slot=0):
    """Pooled entries (fp32, before the norm) of one request fed in chunks of ``sizes``."""
    cache.reset_slots([slot])
    out, pos, k = [], 0, 0
    while pos < x.shape[0]:
        n = min(sizes[min(k, len(sizes) - 1)], x.shape[0] - pos)
        ctx = StepContext.build(torch.zeros(n, dtype=torch.long), [n], [pos], [slot], [[0, 1]])
        plan, pooled = comp.pool(x[pos:pos + n], ctx, state)
        assert plan.entry.tolist() == list(range(pos // comp.spec.ratio, (pos + n) // comp.spec.ratio))
        out.append(pooled)
        pos, k = pos + n, k + 1
    return torch.cat(out)


def _direct(comp, x: torch.Tensor) -> torch.Tensor:
    """Entry j from the formula, in float64."""
    spec = comp.spec
    r, d = spec.ratio, spec.dim
    kv = x.double() @ comp.wkv.weight.double().T
    sc = x.double() @ comp.wgate.weight.double().T
    sc = sc + comp.ape.double()[torch.arange(x.shape[0]) % r]
    out = []
    for j in range(x.shape[0] // r):
        cur = slice(j * r, j * r + r)
        if spec.overlap:
            prev = slice((j - 1) * r, j * r)
            if j == 0:
                k_rows, s_rows = kv[cur, d:], sc[cur, d:]
            else:
                k_rows = torch.cat([kv[prev, :d], kv[cur, d:]])
                s_rows = torch.cat([sc[prev, :d], sc[cur, d:]])
        else:
            k_rows, s_rows = kv[cur], sc[cur]
        out.append((torch.softmax(s_rows, 0) * k_rows).sum(0))
    return torch.stack(out)


@pytest.mark.parametrize("layer,name", [(LAYER_CSA, "attn"), (LAYER_CSA, "index"),
                                        (LAYER_HCA, "attn")])
def test_pooling_formula_and_split_invariance(layer: int, name: str) -> None:
    comp, cache, state = _compressor(layer, name)
    x = _int_tensor((261, comp.cfg.dim), 7)
    one_shot = _pool_steps(comp, cache, state, x, [261])
    torch.testing.assert_close(one_shot.double(), _direct(comp, x), rtol=1e-5, atol=1e-5)
    splits = ([1] * 9 + [40], [3, 1, 1, 6, 37], [5, 60], [126, 1, 1, 1, 1, 100], [130])
    for sizes in splits:
        assert torch.equal(_pool_steps(comp, cache, state, x, sizes), one_shot), sizes


def test_state_keeps_open_group_and_previous_group() -> None:
    comp, cache, state = _compressor(LAYER_CSA)
    x = _int_tensor((10, comp.cfg.dim), 9)
    _pool_steps(comp, cache, state, x, [10])
    r = comp.spec.ratio
    kv = x @ comp.wkv.weight.T
    # after 10 tokens: previous complete group = positions 4..7, open group = positions 8, 9
    assert torch.equal(state.kv[0, :r], kv[4:8])
    assert torch.equal(state.kv[0, r:r + 2], kv[8:10])
    assert (state.kv[0, r + 2:] == 0).all() and torch.isneginf(state.score[0, r + 2:]).all()
    assert torch.isneginf(state.score[1]).all()           # other slots untouched


def test_two_requests_in_one_step_use_their_own_state() -> None:
    comp, cache, state = _compressor(LAYER_CSA)
    xa = _int_tensor((23, comp.cfg.dim), 11)
    xb = _int_tensor((17, comp.cfg.dim), 12)
    ref_a = _pool_steps(comp, cache, state, xa, [23])
    ref_b = _pool_steps(comp, cache, state, xb, [17], slot=2)
    cache.reset_slots([0, 2])
    got_a, got_b = [], []
    for (na, nb), (pa, pb) in (((6, 3), (0, 0)), ((1, 9), (6, 3)), ((16, 5), (7, 12))):
        ctx = StepContext.build(torch.zeros(na + nb, dtype=torch.long), [na, nb], [pa, pb],
                                [2, 0], [[2, 3], [0, 1]])
        x = torch.cat([xa[pa:pa + na], xb[pb:pb + nb]])
        plan, pooled = comp.pool(x, ctx, state)
        got_a.append(pooled[plan.request == 0])
        got_b.append(pooled[plan.request == 1])
        assert entry_plan(ctx, 4).counts_host == [(pa + na) // 4 - pa // 4, (pb + nb) // 4 - pb // 4]
    assert torch.equal(torch.cat(got_a), ref_a)
    assert torch.equal(torch.cat(got_b), ref_b)


def test_finish_normalizes_and_rotates_at_group_start() -> None:
    from dsv4.model.layers import rope_cos_sin
    from dsv4.ops.torch_attn import apply_rope, rms_norm

    comp, _, _ = _compressor(LAYER_HCA)
    pooled = torch.randn(3, comp.spec.dim)
    pos = torch.tensor([0, 128, 256])
    got = comp.finish(pooled, pos)
    cos, sin = rope_cos_sin(comp.cfg, LAYER_HCA, pos)
    want = apply_rope(rms_norm(pooled, comp.norm.weight, comp.cfg.norm_eps), cos, sin)
    assert torch.equal(got, want)


def test_entry_blocking_does_not_change_entries(monkeypatch) -> None:
    import dsv4.model.compressor as compressor_module

    comp, cache, state = _compressor(LAYER_CSA)
    x = _int_tensor((150, comp.cfg.dim), 13)
    whole = _pool_steps(comp, cache, state, x, [150])
    monkeypatch.setattr(compressor_module, "_BLOCK_ELEMS", 3 * 8 * comp.spec.state_width)
    assert torch.equal(_pool_steps(comp, cache, state, x, [150]), whole)
