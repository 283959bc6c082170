"""``fused_linears``: projections sharing an input run as one FP8 GEMM (the GPU path, enabled
here on CPU tensors by patching its device predicate; the Triton op falls back to its twin)."""

from __future__ import annotations

import pytest
import torch

from dsv4 import formats
from dsv4.model import layers
from dsv4.model.layers import Linear, fused_linears


def _fp8_linear(n: int, k: int, seed: int, block: int = 128) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    w8, scale = formats.quant_fp8_block(torch.randn(n, k, generator=gen) * 0.05, block, "e8m0")
    lin = Linear(k, n, fmt="fp8", block=block, dtype=torch.bfloat16, keep_quantized=True)
    lin.load_weight(formats.QuantWeight(w8, scale, "fp8", block, (n, k)))
    return lin


def test_fused_equals_separate_and_shares_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _fp8_linear(256, 384, 1), _fp8_linear(128, 384, 2)
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = [a(x), b(x)]
    # Off the GPU predicate: each Linear on its own, nothing re-stored.
    qa = a.qweight
    assert [torch.equal(u, v) for u, v in zip(fused_linears(x, (a, b)), want)] == [True, True]
    assert a.qweight is qa
    monkeypatch.setattr(layers, "_fuses_on", lambda x: True)
    got = fused_linears(x, (a, b))
    assert [g.shape for g in got] == [(5, 256), (5, 128)]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # The weights are now row slices of one tensor: no second copy; the Linears still work.
    wa, wb = a.qweight.weight, b.qweight.weight
    assert wa.untyped_storage().data_ptr() == wb.untyped_storage().data_ptr()
    assert wb.data_ptr() == wa.data_ptr() + 256 * 384 * wa.element_size()
    assert torch.equal(a(x), want[0]) and torch.equal(b(x), want[1])
    group = a.__dict__["_fused_group"]
    assert fused_linears(x, (a, b))[1].shape == (5, 128)
    assert a.__dict__["_fused_group"] is group  # reused, not rebuilt
    # A reload of one Linear is picked up: the group is rebuilt with the new weight.
    c = _fp8_linear(128, 384, 4)
    b.load_weight(c.qweight)
    got = fused_linears(x, (a, b))
    assert a.__dict__["_fused_group"] is not group
    assert torch.equal(got[1], c(x)) and torch.equal(got[0], want[0])


def test_unfusable_groups_run_separately(monkeypatch: pytest.MonkeyPatch) -> None:
    """Different input widths, or an output count that cuts a scale block, keep separate GEMMs."""
    monkeypatch.setattr(layers, "_fuses_on", lambda x: True)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    a, odd = _fp8_linear(256, 256, 6), _fp8_linear(64, 256, 7)
    out = fused_linears(x, (a, odd))
    assert torch.equal(out[0], a(x)) and torch.equal(out[1], odd(x))
    assert "_fused_group" not in a.__dict__
    dense = Linear(256, 128, fmt="bf16", dtype=torch.bfloat16)
    dense.load_weight(torch.randn(128, 256).to(torch.bfloat16))
    out = fused_linears(x, (a, dense))
    assert torch.equal(out[1], dense(x)) and "_fused_group" not in a.__dict__


def test_stacked_weight_for_the_compressor_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compressor's fp32 wkv + wgate as one GEMM over stacked weights (GPU path, enabled
    here on CPU): the same rows to fp32 rounding, the Linears' weights become row slices of the
    stack, a reload stacks again, and quantized storage never stacks."""
    from dsv4.model.compressor import kv_score_rows
    from dsv4.ops import get_ops

    ops = get_ops("torch")
    gen = torch.Generator().manual_seed(9)
    wkv, wgate = (Linear(64, n, fmt="bf16", dtype=torch.float32) for n in (32, 32))
    wkv.load_weight(torch.randn(32, 64, generator=gen))
    wgate.load_weight(torch.randn(32, 64, generator=gen))
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    want = kv_score_rows(ops, x, wkv, wgate)
    assert layers.stacked_weight(x, (wkv, wgate)) is None          # CPU: separate GEMMs
    monkeypatch.setattr(layers, "_fuses_on", lambda x: True)
    kv, score = kv_score_rows(ops, x, wkv, wgate)
    torch.testing.assert_close(kv, want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(score, want[1], rtol=1e-6, atol=1e-6)
    w = layers.stacked_weight(x, (wkv, wgate))
    assert w.shape == (64, 64) and wgate.weight.data_ptr() == w[32:].data_ptr()
    assert layers.stacked_weight(x, (wkv, wgate)) is w                # memoized
    new = torch.randn(32, 64, generator=gen)
    wgate.load_weight(new)
    w2 = layers.stacked_weight(x, (wkv, wgate))
    assert w2 is not w and torch.equal(w2[32:], new)
    assert layers.stacked_weight(x, (_fp8_linear(128, 128, 1), _fp8_linear(128, 128, 2))) is None
