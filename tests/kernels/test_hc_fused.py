"""``hc_post_pre`` (an mHC post fused with the next sublayer's pre): the torch twin is the exact
composition, the model chain gives the same bits through it, and (CUDA only) the Triton kernel
at V4-Flash shapes matches the twin.  The interpreter checks of the kernel at tiny shapes are in
interp/test_hc_fused.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from dsv4.ops import get_ops
from dsv4.ops import torch_dense as ref

EPS = dict(norm_eps=1e-6, hc_eps=1e-6, iters=20)


def _inputs(T: int, n: int, D: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows = (2 + n) * n
    out = torch.randn(T, D, generator=gen).to(dtype)
    x_res = torch.randn(T, n, D, generator=gen).to(dtype)
    post = torch.rand(T, n, generator=gen) * 2
    comb = torch.rand(T, n, n, generator=gen)
    fn = torch.randn(rows, n * D, generator=gen) * (0.5 / D ** 0.5)
    scale = torch.rand(3, generator=gen) + 0.5
    base = torch.randn(rows, generator=gen) * 0.5
    return tuple(t.to(device) for t in (out, x_res, post, comb, fn, scale, base))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_is_the_exact_composition(dtype: torch.dtype) -> None:
    args = _inputs(6, 4, 48, dtype, seed=1)
    fused = ref.hc_post_pre(*args, **EPS)
    x_new = ref.hc_post(*args[:4])
    unfused = (x_new, *ref.hc_pre(x_new, *args[4:], **EPS))
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused))
    with pytest.raises(ValueError, match="hc_post"):
        ref.hc_post_pre(args[0][:, :8], *args[1:], **EPS)


def test_op_tables_have_it() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernel itself on CPU")
    pytest.importorskip("triton")
    assert get_ops("torch").hc_post_pre is ref.hc_post_pre
    args = _inputs(3, 4, 32, torch.bfloat16, seed=2)
    # Off the GPU the Triton table's op runs the twin: same bits.
    got = get_ops("triton").hc_post_pre(*args, **EPS)
    want = ref.hc_post_pre(*args, **EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_v4_model_chain_matches_the_unfused_ops(tmp_path) -> None:
    """The V4 forward chains post+pre across sublayers and blocks; with an op table lacking
    hc_post_pre (mhc.py falls back to post then pre) the logits are bit-identical."""
    from dsv4.model.mhc import HyperConnection
    from dsv4.model.transformer import load_model
    from dsv4.tiny import make_tiny_checkpoint

    model = load_model(make_tiny_checkpoint(tmp_path / "v4", variant="v4", seed=3))
    ids = torch.arange(5, 30)
    fused = model.forward_full(ids)
    calls = []
    ops = model.ops

    def counted_post(*a, **k):
        calls.append(1)
        return ops.hc_post(*a, **k)

    table = {k: v for k, v in vars(ops).items() if k != "hc_post_pre"}
    table["hc_post"] = counted_post
    plain_ops = SimpleNamespace(**table)
    hcs = [m for m in model.modules() if isinstance(m, HyperConnection)]
    for m in hcs:
        m.ops = plain_ops
    try:
        unfused = model.forward_full(ids)
    finally:
        for m in hcs:
            m.ops = ops
    # Every post ran through the fallback (2 per block), and the results agree bit for bit.
    assert len(calls) == 2 * model.cfg.n_layers
    assert torch.equal(fused, unfused)


# ------------------------------------------------------------------------------- GPU (H200)
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")


@needs_cuda
@pytest.mark.parametrize("T", [1, 64, 8192])
def test_kernel_matches_twin_at_v4_flash_shapes(T: int) -> None:
    """n 4, D 4096, bf16 streams.  Tolerances as the interpreter tests (see there): x_new 4e-3
    (one bf16 ulp on a few elements), post/comb 1e-5 vs the twin's pre of the kernel's x_new
    (tf32x3 split-K ≈ fp32), y 4e-3 (bf16 output)."""
    from dsv4.ops import triton_mhc

    torch.backends.cuda.matmul.allow_tf32 = False
    args = _inputs(T, 4, 4096, torch.bfloat16, device="cuda", seed=T)
    x_new, y, post, comb = triton_mhc.hc_post_pre(*args, **EPS)
    torch.cuda.synchronize()
    assert _rel(x_new.float(), ref.hc_post(*args[:4]).float()) < 4e-3
    y_r, post_r, comb_r = ref.hc_pre(x_new, *args[4:], **EPS)
    assert _rel(y.float(), y_r.float()) < 4e-3
    assert _rel(post, post_r) < 1e-5 and _rel(comb, comb_r) < 1e-5
    assert torch.isfinite(y.float()).all() and torch.isfinite(x_new.float()).all()


@needs_cuda
@pytest.mark.parametrize("T", [64, 8192])
def test_plans_agree_at_v4_flash_shapes(T: int) -> None:
    """The default plan (bf16x3 mixes at prefill) and the fp32-mix plan of before give x_new
    bit for bit (the same fused multiply-add chain per element), mixes to fp32 rounding, y to
    one bf16 rounding; and the prefill default's mixes match the twin's pre of x_new."""
    from dsv4.ops import triton_mhc

    torch.backends.cuda.matmul.allow_tf32 = False
    args = _inputs(T, 4, 4096, torch.bfloat16, device="cuda", seed=T + 1)
    x0, y0, p0, c0 = triton_mhc.hc_post_pre_with_plan(*args, **EPS)
    x1, y1, p1, c1 = triton_mhc.hc_post_pre_with_plan(*args, **EPS, plan=triton_mhc.HcPlan(64, 32, 4, 3))
    torch.cuda.synchronize()
    assert torch.equal(x0.view(torch.int16), x1.view(torch.int16))
    assert _rel(p0, p1) < 1e-5 and _rel(c0, c1) < 1e-5 and _rel(y0.float(), y1.float()) < 4e-3
    y_r, p_r, c_r = ref.hc_pre(x0, *args[4:], **EPS)
    assert _rel(p0, p_r) < 1e-5 and _rel(c0, c_r) < 1e-5 and _rel(y0.float(), y_r.float()) < 4e-3


@needs_cuda
def test_gates_once_gives_the_same_bits_at_v4_flash_shapes() -> None:
    """The prefill plan with its gates loaded once before the D loop: x_new, y and the mixes bit
    for bit against the same tiles loading them each chunk (8,192 tokens, n 4, D 4096)."""
    from dataclasses import replace

    from dsv4.ops import triton_mhc

    args = _inputs(8192, 4, 4096, torch.bfloat16, device="cuda", seed=5)
    plan = triton_mhc.pick_hc_plan("post_pre", 8192, 4, 4096, torch.bfloat16)
    a = triton_mhc.hc_post_pre_with_plan(*args, **EPS, plan=replace(plan, gates_once=False))
    b = triton_mhc.hc_post_pre_with_plan(*args, **EPS, plan=replace(plan, gates_once=True))
    torch.cuda.synchronize()
    for u, v in zip(a, b):
        assert torch.equal(u, v) and torch.isfinite(u.float()).all()

