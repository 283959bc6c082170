"""The n = 4 mHC collapse kernel (``_hc_collapse4_kernel``: scalar Sinkhorn, optional fused
RMSNorm of the sublayer input) in the Triton interpreter (run by
tests/kernels/test_interpreter.py in a child with TRITON_INTERPRET=1).

* against the general kernel it replaces at n = 4 (``_hc_collapse_kernel``, still used for other
  n), launched on the same split-K partials: y / post / comb bit for bit (the interpreter sums
  in the same order both ways; on the GPU the orders differ by fp32 rounding);
* the fused norm: the bits of ``rms_norm(collapse)`` (the same kernel without the norm, then the
  norm kernel), and post / comb unchanged by it; against the twins (collapse, then
  ``torch_attn.rms_norm``) by the tolerances of the unfused tests (bf16: one rounding, 4e-3);
* hc_post_pre and hc_head with the norm, n = 2 (general kernel + norm launch), bad shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

import triton  # noqa: E402

from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_mhc, triton_norm  # noqa: E402
from interp_helpers import rel_err  # noqa: E402

EPS = (1e-6, 1e-6)


def _inputs(T: int, n: int, D: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = (2 + n) * n
    x = torch.randn(T, n, D, generator=gen).to(dtype)
    fn = torch.randn(rows, n * D, generator=gen) * 0.1
    scale = torch.rand(3, generator=gen) + 0.5
    base = torch.randn(rows, generator=gen) * 0.5
    w = torch.rand(D, generator=gen) + 0.5
    return x, fn, scale, base, w


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 4e-3


@pytest.mark.parametrize("T,D,iters", [(1, 96, 20), (19, 80, 20), (3, 64, 1), (2, 48, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collapse4_equals_the_general_kernel(T: int, D: int, iters: int,
                                             dtype: torch.dtype) -> None:
    """Same partials into the old tile-Sinkhorn kernel and the new scalar one: same bits."""
    x, fn, scale, base, _ = _inputs(T, 4, D, dtype, seed=T + D)
    xc, part, sq, splits, njp = triton_mhc._hc_mix(x, fn, 24, "hc_pre", None)
    assert splits > 1  # the interpreter's 4 "SMs" split K: the split sums are exercised
    y, post, comb = triton_mhc.hc_pre(x, fn, scale, base, *EPS, iters)
    y_o = torch.empty_like(y)
    post_o, comb_o = torch.empty_like(post), torch.empty_like(comb)
    BD = min(1024, triton.next_power_of_2(D))
    triton_mhc._hc_collapse_kernel[(T, triton.cdiv(D, BD))](
        xc, part, sq, scale, base, y_o, post_o, comb_o, T, D, splits, *EPS, ITERS=iters, N=4,
        NJP=njp, SP=triton.next_power_of_2(splits), BD=BD, HEAD=False)
    assert torch.equal(y, y_o) and torch.equal(post, post_o) and torch.equal(comb, comb_o)
    y_r, post_r, comb_r = ref.hc_pre(x, fn, scale, base, *EPS, iters)
    assert rel_err(y.float(), y_r.float()) < _tol(dtype)
    assert rel_err(post, post_r) < 1e-5 and rel_err(comb, comb_r) < 1e-5
    # Doubly stochastic after enough rounds (rows and columns sum to ~1).
    if iters == 20:
        assert torch.allclose(comb.sum(-1), torch.ones(T, 4), atol=1e-3)
        assert torch.allclose(comb.sum(-2), torch.ones(T, 4), atol=1e-3)


@pytest.mark.parametrize("T,D", [(1, 96), (19, 80), (5, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_fused_norm_is_collapse_then_norm(T: int, D: int, dtype: torch.dtype) -> None:
    x, fn, scale, base, w = _inputs(T, 4, D, dtype, seed=3 * T + D)
    y0, post0, comb0 = triton_mhc.hc_pre(x, fn, scale, base, *EPS, 20)
    want = triton_norm.rms_norm(y0, w, 1e-5)
    fused = triton_mhc.hc_pre_with_plan(x, fn, scale, base, *EPS, 20, None, w, 1e-5, True)
    split = triton_mhc.hc_pre_with_plan(x, fn, scale, base, *EPS, 20, None, w, 1e-5, False)
    auto = triton_mhc.hc_pre(x, fn, scale, base, *EPS, 20, w, 1e-5)
    for got in (fused, split, auto):
        assert got[0].dtype == dtype and got[0].shape == (T, D)
        assert torch.equal(got[0], want)
        assert torch.equal(got[1], post0) and torch.equal(got[2], comb0)
    y_r, post_r, comb_r = ref.hc_pre(x, fn, scale, base, *EPS, 20, w, 1e-5)
    assert torch.equal(y_r, ref.torch_attn.rms_norm(ref.hc_pre(x, fn, scale, base, *EPS, 20)[0],
                                                    w, 1e-5))
    assert rel_err(fused[0].float(), y_r.float()) < _tol(dtype)
    # rms_eps defaults to norm_eps.
    assert torch.equal(triton_mhc.hc_pre(x, fn, scale, base, *EPS, 20, w)[0],
                       triton_norm.rms_norm(y0, w, EPS[0]))


@pytest.mark.parametrize("T,D", [(1, 96), (19, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_pre_fused_norm(T: int, D: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(T)
    out = torch.randn(T, D, generator=gen).to(dtype)
    post = torch.rand(T, 4, generator=gen) * 2
    comb = torch.rand(T, 4, 4, generator=gen)
    x, fn, scale, base, w = _inputs(T, 4, D, dtype, seed=T + 1)
    args = (out, x, post, comb, fn, scale, base, *EPS, 20)
    x0, y0, p0, c0 = triton_mhc.hc_post_pre(*args)
    want = triton_norm.rms_norm(y0, w, 1e-6)
    for fuse in (True, False):
        x1, y1, p1, c1 = triton_mhc.hc_post_pre_with_plan(*args, None, w, None, fuse)
        assert torch.equal(x1, x0) and torch.equal(p1, p0) and torch.equal(c1, c0)
        assert torch.equal(y1, want)
    _, y_r, _, _ = ref.hc_post_pre(*args, w)
    assert rel_err(want.float(), y_r.float()) < _tol(dtype)


@pytest.mark.parametrize("T,D", [(1, 96), (6, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_head_fused_norm(T: int, D: int, dtype: torch.dtype) -> None:
    x, fn, scale, base, w = _inputs(T, 4, D, dtype, seed=7 * T)
    fh, sh, bh = fn[:4], scale[:1], base[:4]
    h = triton_mhc.hc_head(x, fh, sh, bh, *EPS)
    assert rel_err(h.float(), ref.hc_head(x, fh, sh, bh, *EPS).float()) < _tol(dtype)
    want = triton_norm.rms_norm(h, w, 1e-6)
    for fuse in (True, False):
        got = triton_mhc.hc_head_with_plan(x, fh, sh, bh, *EPS, None, w, 1e-6, fuse)
        assert torch.equal(got, want)
    assert rel_err(want.float(), ref.hc_head(x, fh, sh, bh, *EPS, w, 1e-6).float()) < _tol(dtype)


def test_other_stream_counts_norm_separately() -> None:
    """n = 2: the general collapse kernel, then the norm kernel."""
    x, fn, scale, base, w = _inputs(3, 2, 40, torch.bfloat16, seed=11)
    y0, post0, comb0 = triton_mhc.hc_pre(x, fn, scale, base, *EPS, 20)
    y, post, comb = triton_mhc.hc_pre(x, fn, scale, base, *EPS, 20, w)
    assert torch.equal(y, triton_norm.rms_norm(y0, w, 1e-6))
    assert torch.equal(post, post0) and torch.equal(comb, comb0)
    y_r = ref.hc_pre(x, fn, scale, base, *EPS, 20, w)[0]
    assert rel_err(y.float(), y_r.float()) < 4e-3


def test_bad_norm_weight_is_rejected() -> None:
    x, fn, scale, base, w = _inputs(2, 4, 32, torch.float32, seed=0)
    with pytest.raises(ValueError, match="norm_weight"):
        triton_mhc.hc_pre(x, fn, scale, base, *EPS, 20, w[:16])
    with pytest.raises(ValueError, match="norm_weight"):
        triton_mhc.hc_head(x, fn[:4], scale[:1], base[:4], *EPS, w[:16])
    with pytest.raises(ValueError, match="norm_weight"):
        ref.hc_pre(x, fn, scale, base, *EPS, 20, w[:16])


@pytest.mark.parametrize("T,D,norm", [(1, 96, True), (5, 64, False), (3, 80, True)])
def test_collapse4_modes_split_the_work_bit_for_bit(T: int, D: int, norm: bool) -> None:
    """The comb lane's split of the collapse kernel (``MODE`` 1: y, post and the summed mixes
    on the main stream; 2: comb alone from those sums, one warp) writes exactly what the whole
    kernel (``MODE`` 0) writes, and each mode leaves the other's outputs untouched."""
    x, fn, scale, base, w = _inputs(T, 4, D, torch.bfloat16, seed=7 * T + D)
    xc, part, sq, splits, njp = triton_mhc._hc_mix(x, fn, 24, "hc_pre", None)
    BD = triton.next_power_of_2(D)
    outs = {}
    mix = torch.full((T, 32), float("nan"))
    for mode in (0, 1, 2):
        y = torch.full((T, D), float("nan")).to(x.dtype)
        post = torch.full((T, 4), float("nan"))
        comb = torch.full((T, 4, 4), float("nan"))
        grid = (T, 1) if mode == 2 or norm else (T, triton.cdiv(D, BD))
        triton_mhc._hc_collapse4_kernel[grid](
            xc, part, sq, scale, base, y, post, comb, w if norm else y, mix, T, D, splits,
            *EPS, 1e-5, ITERS=20, NJ=24, NJP=njp, SP=triton.next_power_of_2(splits), BD=BD,
            HEAD=False, NORM=norm, MODE=mode, num_warps=1 if mode == 2 else 4)
        outs[mode] = (y, post, comb)
    y0, post0, comb0 = outs[0]
    assert torch.equal(outs[1][0], y0) and torch.equal(outs[1][1], post0)
    assert torch.isnan(outs[1][2]).all()
    assert torch.equal(outs[2][2], comb0)
    assert torch.isnan(outs[2][0].float()).all() and torch.isnan(outs[2][1]).all()
