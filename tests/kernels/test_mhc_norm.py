"""The sublayer input norm fused into the mHC collapse (``hc_pre`` / ``hc_post_pre`` /
``hc_head`` with ``norm_weight``) and the n = 4 collapse kernel with its scalar Sinkhorn.

CPU: the twins are the composition (collapse, then ``torch_attn.rms_norm``) and the V4 model
runs no separate attn_norm / ffn_norm / final norm any more.  CUDA (skipped without): the
kernels at V4-Flash widths (n 4, D 4096; T = 1, 16, 64, 8192) — the normed y is the bits of
the unfused collapse followed by the norm kernel, fused or split, and close to the twins;
every output written (allocator poisoned with NaN first).  The interpreter checks at tiny shapes
are in interp/test_mhc_norm.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.ops import torch_attn
from dsv4.ops import torch_dense as ref
from tests.kernels.gpu_helpers import poison_allocator as _poison

EPS = (1e-6, 1e-6)
N, D_FLASH = 4, 4096


def _inputs(T: int, n: int, D: int, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = (2 + n) * n

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, device=device)

    x = r(T, n, D).to(dtype)
    fn = r(rows, n * D) * (0.5 / D ** 0.5)
    scale = torch.rand(3, generator=gen, device=device) + 0.5
    base = r(rows) * 0.5
    w = torch.rand(D, generator=gen, device=device) + 0.5
    out = r(T, D).to(dtype)
    post = torch.rand(T, n, generator=gen, device=device) * 2
    comb = torch.rand(T, n, n, generator=gen, device=device)
    return x, fn, scale, base, w, out, post, comb


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twins_are_collapse_then_norm(dtype: torch.dtype) -> None:
    x, fn, scale, base, w, out, post, comb = _inputs(5, N, 48, dtype, "cpu", seed=1)
    y, p, c = ref.hc_pre(x, fn, scale, base, *EPS, 20)
    yn, pn, cn = ref.hc_pre(x, fn, scale, base, *EPS, 20, w, 1e-5)
    assert torch.equal(yn, torch_attn.rms_norm(y, w, 1e-5))
    assert torch.equal(pn, p) and torch.equal(cn, c)
    # rms_eps defaults to norm_eps
    assert torch.equal(ref.hc_pre(x, fn, scale, base, *EPS, 20, w)[0],
                       torch_attn.rms_norm(y, w, EPS[0]))
    fused = ref.hc_post_pre(out, x, post, comb, fn, scale, base, *EPS, 20, w)
    x_new = ref.hc_post(out, x, post, comb)
    assert torch.equal(fused[0], x_new)
    assert torch.equal(fused[1], torch_attn.rms_norm(ref.hc_pre(x_new, fn, scale, base, *EPS,
                                                                20)[0], w, EPS[0]))
    h = ref.hc_head(x, fn[:N], scale[:1], base[:N], *EPS)
    assert torch.equal(ref.hc_head(x, fn[:N], scale[:1], base[:N], *EPS, w, 1e-5),
                       torch_attn.rms_norm(h, w, 1e-5))
    with pytest.raises(ValueError, match="norm_weight"):
        ref.hc_head(x, fn[:N], scale[:1], base[:N], *EPS, w[:8])


def test_v4_model_runs_no_separate_input_norms(tmp_path) -> None:
    """The V4 forward passes the attn_norm / ffn_norm / final norm weights to the hc ops: the
    RMSNorm modules are not called, and the logits equal a forward that calls them (an op
    table whose hc ops drop the weight and norm the result themselves)."""
    from types import SimpleNamespace

    from dsv4.model.layers import RMSNorm
    from dsv4.model.transformer import load_model
    from dsv4.tiny import make_tiny_checkpoint

    model = load_model(make_tiny_checkpoint(tmp_path / "v4", variant="v4", seed=5))
    ids = torch.arange(3, 20)
    calls = []
    orig = RMSNorm.forward

    sublayer_norms = {id(model.norm)} | {id(m) for b in model.layers
                                         for m in (b.attn_norm, b.ffn_norm)}

    def counted(self, x):
        if id(self) in sublayer_norms:
            calls.append(1)
        return orig(self, x)

    RMSNorm.forward = counted
    try:
        fused = model.forward_full(ids)
    finally:
        RMSNorm.forward = orig
    assert not calls
    ops = model.ops

    def split_pre(x, fn, scale, base, ne, he, it, w=None, e=None):
        y, p, c = ops.hc_pre(x, fn, scale, base, ne, he, it)
        return (y if w is None else ops.rms_norm(y, w, e)), p, c

    def split_post_pre(out, xr, p, c, fn, scale, base, ne, he, it, w=None, e=None):
        x_new, y, p2, c2 = ops.hc_post_pre(out, xr, p, c, fn, scale, base, ne, he, it)
        return x_new, (y if w is None else ops.rms_norm(y, w, e)), p2, c2

    def split_head(x, fn, scale, base, ne, he, w=None, e=None):
        y = ops.hc_head(x, fn, scale, base, ne, he)
        return y if w is None else ops.rms_norm(y, w, e)

    table = dict(vars(ops), hc_pre=split_pre, hc_post_pre=split_post_pre, hc_head=split_head)
    for m in model.modules():
        if hasattr(m, "ops") and m.ops is ops:
            m.ops = SimpleNamespace(**table)
    try:
        plain = model.forward_full(ids)
    finally:
        for m in model.modules():
            if hasattr(m, "ops") and isinstance(m.ops, SimpleNamespace) and \
                    getattr(m.ops, "hc_pre", None) is split_pre:
                m.ops = ops
    assert torch.equal(fused, plain)


# ------------------------------------------------------------------------------------- GPU
_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")



def _finite(*ts: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t.float()).all()) for t in ts)


def _diff(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int16) != b.view(torch.int16)).sum()) if a.dtype == torch.bfloat16 \
        else int((a != b).sum())


@_gpu
@pytest.mark.parametrize("T", [1, 16, 64, 8192])
def test_hc_pre_norm_gpu(T: int) -> None:
    from dsv4.ops import triton_mhc, triton_norm
    x, fn, scale, base, w, *_ = _inputs(T, N, D_FLASH, torch.bfloat16, "cuda", seed=T)
    _poison()
    y0, p0, c0 = triton_mhc.hc_pre(x, fn, scale, base, *EPS, 20)
    want = triton_norm.rms_norm(y0, w, 1e-6)
    _poison()
    fused = triton_mhc.hc_pre_with_plan(x, fn, scale, base, *EPS, 20, None, w, 1e-6, True)
    _poison()
    split = triton_mhc.hc_pre_with_plan(x, fn, scale, base, *EPS, 20, None, w, 1e-6, False)
    auto = triton_mhc.hc_pre(x, fn, scale, base, *EPS, 20, w, 1e-6)
    assert _finite(y0, p0, c0, *fused, *split)
    for got in (fused, split, auto):
        assert _diff(got[0], want) == 0, "normed y differs from collapse + norm kernel"
        assert torch.equal(got[1], p0) and torch.equal(got[2], c0)
    y_r, p_r, c_r = ref.hc_pre(x, fn, scale, base, *EPS, 20, w, 1e-6)
    assert _rel(fused[0], y_r) < 4e-3 and _rel(p0, p_r) < 1e-4 and _rel(c0, c_r) < 1e-4
    assert _rel(y0, ref.hc_pre(x, fn, scale, base, *EPS, 20)[0]) < 4e-3


@_gpu
@pytest.mark.parametrize("T", [1, 16, 64, 8192])
def test_hc_post_pre_norm_gpu(T: int) -> None:
    from dsv4.ops import triton_mhc, triton_norm
    x, fn, scale, base, w, out, post, comb = _inputs(T, N, D_FLASH, torch.bfloat16, "cuda",
                                                     seed=T + 1)
    args = (out, x, post, comb, fn, scale, base, *EPS, 20)
    _poison()
    x0, y0, p0, c0 = triton_mhc.hc_post_pre(*args)
    want = triton_norm.rms_norm(y0, w, 1e-6)
    for fuse in (True, False):
        _poison()
        x1, y1, p1, c1 = triton_mhc.hc_post_pre_with_plan(*args, None, w, 1e-6, fuse)
        assert _finite(x1, y1, p1, c1)
        assert torch.equal(x1, x0) and torch.equal(p1, p0) and torch.equal(c1, c0)
        assert _diff(y1, want) == 0
    x_r, y_r, p_r, c_r = ref.hc_post_pre(*args, w, 1e-6)
    assert _rel(x0, x_r) < 4e-3 and _rel(want, y_r) < 4e-3
    assert _rel(p0, p_r) < 1e-4 and _rel(c0, c_r) < 1e-4


@_gpu
@pytest.mark.parametrize("T", [1, 64, 8192])
def test_hc_head_norm_gpu(T: int) -> None:
    from dsv4.ops import triton_mhc, triton_norm
    x, fn, scale, base, w, *_ = _inputs(T, N, D_FLASH, torch.bfloat16, "cuda", seed=T + 2)
    fh, sh, bh = fn[:N], scale[:1], base[:N]
    _poison()
    h = triton_mhc.hc_head(x, fh, sh, bh, *EPS)
    want = triton_norm.rms_norm(h, w, 1e-6)
    for fuse in (True, False):
        _poison()
        got = triton_mhc.hc_head_with_plan(x, fh, sh, bh, *EPS, None, w, 1e-6, fuse)
        assert _finite(got) and _diff(got, want) == 0
    assert _rel(want, ref.hc_head(x, fh, sh, bh, *EPS, w, 1e-6)) < 4e-3


@_gpu
def test_sinkhorn_fp32_streams_gpu() -> None:
    """fp32 streams (the fused norm without a bf16 rounding) and iters 1."""
    from dsv4.ops import triton_mhc, triton_norm
    x, fn, scale, base, w, *_ = _inputs(7, N, D_FLASH, torch.float32, "cuda", seed=9)
    for iters in (1, 20):
        _poison()
        y, p, c = triton_mhc.hc_pre(x, fn, scale, base, *EPS, iters)
        yn = triton_mhc.hc_pre_with_plan(x, fn, scale, base, *EPS, iters, None, w, None, True)[0]
        y_r, p_r, c_r = ref.hc_pre(x, fn, scale, base, *EPS, iters)
        assert _finite(y, p, c, yn)
        assert _rel(y, y_r) < 1e-5 and _rel(p, p_r) < 1e-4 and _rel(c, c_r) < 1e-4
        assert torch.equal(yn, triton_norm.rms_norm(y, w, EPS[0]))


@_gpu
@pytest.mark.parametrize("T", [1, 16, 64])
def test_comb_lane_same_bits_gpu(T: int) -> None:
    """Inside a model step (``streams.deferred_comb``) hc_pre / hc_post_pre leave the Sinkhorn
    to the comb lane: after the consumer's join (hc_post) y, post and comb are the bits of the
    in-order launches, eagerly and as CUDA-graph replays (the fork / join captured as edges)."""
    from dsv4.ops import streams, triton_mhc
    x, fn, scale, base, w, out, *_ = _inputs(T, N, D_FLASH, torch.bfloat16, "cuda", seed=T + 5)
    dev = x.device

    def chain() -> tuple[torch.Tensor, ...]:
        y, p, c = triton_mhc.hc_pre(x, fn, scale, base, *EPS, 20, w, 1e-6)
        x_new, y2, p2, c2 = triton_mhc.hc_post_pre(out, x, p, c, fn, scale, base, *EPS, 20,
                                                   w, 1e-6)
        final = triton_mhc.hc_post(out, x_new, p2, c2)
        return y, p, c, x_new, y2, p2, c2, final

    _poison()
    want = chain()
    with streams.deferred_comb(dev, T):
        assert streams.comb_lane_active(dev)
        _poison()
        got = chain()
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), streams.deferred_comb(dev, T):
        chain()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), streams.deferred_comb(dev, T):
        outs = chain()
    for _ in range(3):
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for a, b in zip(outs, want):
            assert torch.equal(a, b)
