"""Fused norm / RoPE ops (``dsv4/ops/torch_norm.py`` twins, ``dsv4/ops/triton_norm.py`` kernels).

Three groups:

* twins against the unfused code the attention ran before the fusion (bit for bit), argument
  checks and the op-table wiring — plain CPU;
* ``test_interp_*``: the Triton kernels against the twins in the Triton interpreter.  They need
  ``TRITON_INTERPRET=1`` before triton is imported, so :func:`test_kernels_in_interpreter`
  re-runs this file in a child process with it set (and only those tests);
* ``test_gpu_*``: the kernels at V4-Flash shapes (T 1 / 64 / 8192, 64 heads × 512, rope 64)
  against the twins on the GPU — skipped without CUDA.

Tolerances: fp32 kernels differ from the twins only by the order of the fp32 sum of squares
(relative ~1e-7; bound 2e-6).  bf16: the kernels round where the twins round, so outputs are
bit-equal except where that sum order (or, on the GPU, torch's approximate CUDA rsqrt) moves one
bf16 rounding: such elements are rare and one bf16 step of the row's scale apart at most (the
RoPE of a value that moved one ulp can cancel, so the bound is on the row's scale, not on the
element).  Torch's *CPU* bf16 rsqrt rounds twice (sqrt, then 1/x, each to bf16) on the scalar
remainder of its vector loop, so the bf16 renorm cases use T·H a multiple of 64 rows.
Unrotated channels stay within one ulp, except under the bf16 renorm, which (as the reference)
rounds its rsqrt factor to bf16 before the product: a factor one ulp apart moves the product by
up to two ulps (seen once on the H200 in 235M elements at T 8192).
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.formats import fake_quant_fp8
from dsv4.ops import get_ops, torch_attn, torch_norm
from tests.kernels.interp_child import run_in_interpreter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(
    not INTERP, reason="interpreter test: run by test_kernels_in_interpreter in a child process")


def _rope_tables(T: int, half: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, half] of random angles (positions × frequencies, as rope_cos_sin builds)."""
    ang = torch.rand(T, 1, generator=gen) * 5000 * torch.logspace(0, -4, half)[None, :]
    return torch.cos(ang), torch.sin(ang)


def _unfused_q(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
               renorm: bool) -> torch.Tensor:
    """The attention's q path before the fusion (verbatim)."""
    if renorm:
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)
    return torch_attn.apply_rope(q, cos, sin)


def _unfused_kv(kv: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                eps: float, official: bool) -> torch.Tensor:
    """The attention's kv path before the fusion (verbatim, V4 tensor ring)."""
    rd = 2 * cos.shape[-1]
    kv = torch_attn.apply_rope(torch_attn.rms_norm(kv, w, eps), cos, sin)
    if official:
        kv = torch.cat((fake_quant_fp8(kv[:, :-rd], 64), kv[:, -rd:]), dim=-1)
    return kv


# ------------------------------------------------------------------------ twins (plain CPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renorm", [True, False])
def test_head_norm_rope_twin_is_the_unfused_code(dtype: torch.dtype, renorm: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    T, H, d = 5, 3, 192
    q = (torch.randn(T, H, d, generator=gen) * 3).to(dtype)
    cos, sin = _rope_tables(T, 32, gen)
    want = _unfused_q(q, cos, sin, 1e-6, renorm)
    got = torch_norm.head_norm_rope(q, cos, sin, 1e-6, renorm)
    assert got.dtype == dtype and torch.equal(got, want)
    assert not torch.equal(got, q)
    # In place: the same values, written into q.
    q2 = q.clone()
    assert torch_norm.head_norm_rope(q2, cos, sin, 1e-6, renorm, inplace=True) is q2
    assert torch.equal(q2, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("official", [False, True])
def test_norm_rope_twin_is_the_unfused_code(dtype: torch.dtype, official: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    T, d = 7, 512
    kv = (torch.randn(T, d, generator=gen) * 2).to(dtype)
    w = torch.rand(d, generator=gen) + 0.5
    cos, sin = _rope_tables(T, 32, gen)
    got = torch_norm.norm_rope(kv, w, cos, sin, 1e-6, fp8_block=64 if official else 0)
    assert torch.equal(got, _unfused_kv(kv, w, cos, sin, 1e-6, official))
    if official:  # the nope channels really are on the e4m3 grid times a power of two
        plain = torch_norm.norm_rope(kv, w, cos, sin, 1e-6)
        assert not torch.equal(got[:, :448], plain[:, :448])
        assert torch.equal(got[:, 448:], plain[:, 448:])


def test_twins_reject_bad_input() -> None:
    cos = sin = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="head_norm_rope"):
        torch_norm.head_norm_rope(torch.zeros(4, 32), cos, sin, 1e-6, True)      # not [T, H, d]
    with pytest.raises(ValueError, match="head_norm_rope"):
        torch_norm.head_norm_rope(torch.zeros(3, 2, 32), cos, sin, 1e-6, True)   # T mismatch
    with pytest.raises(ValueError, match="norm_rope"):
        torch_norm.norm_rope(torch.zeros(4, 12), None, cos, sin, 1e-6)          # d < rd
    with pytest.raises(ValueError, match="weight"):
        torch_norm.norm_rope(torch.zeros(4, 32), torch.ones(31), cos, sin, 1e-6)
    with pytest.raises(ValueError, match="fp8_block"):
        torch_norm.norm_rope(torch.zeros(4, 40), None, cos, sin, 1e-6, fp8_block=16)


def test_op_table_has_the_fused_ops() -> None:
    pytest.importorskip("triton")
    from dsv4.ops import triton_norm

    t, k = get_ops("torch"), get_ops("triton")
    assert t.head_norm_rope is torch_norm.head_norm_rope and t.norm_rope is torch_norm.norm_rope
    assert t.rms_norm is torch_attn.rms_norm and t.apply_rope is torch_attn.apply_rope
    assert k.head_norm_rope is triton_norm.head_norm_rope and k.norm_rope is triton_norm.norm_rope
    assert k.rms_norm is triton_norm.rms_norm and k.apply_rope is triton_norm.apply_rope


def test_triton_ops_run_the_twins_off_gpu() -> None:
    if INTERP:
        pytest.skip("the interpreter runs the kernels themselves on CPU")
    pytest.importorskip("triton")
    from dsv4.ops import triton_norm as tri

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 64, generator=gen)
    cos, sin = _rope_tables(3, 16, gen)
    w = torch.rand(64, generator=gen)
    assert torch.equal(tri.head_norm_rope(q, cos, sin, 1e-6, True),
                       torch_norm.head_norm_rope(q, cos, sin, 1e-6, True))
    assert torch.equal(tri.norm_rope(q[:, 0], w, cos, sin, 1e-6, 32),
                       torch_norm.norm_rope(q[:, 0], w, cos, sin, 1e-6, 32))
    assert torch.equal(tri.rms_norm(q, w, 1e-6), torch_attn.rms_norm(q, w, 1e-6))
    assert torch.equal(tri.apply_rope(q, cos, sin, inverse=True),
                       torch_attn.apply_rope(q, cos, sin, inverse=True))


# ---------------------------------------------------------------- interpreter (child process)
def test_kernels_in_interpreter() -> None:
    """Run this file's interpreter tests with ``TRITON_INTERPRET=1`` in a child."""
    if INTERP:
        pytest.skip("TRITON_INTERPRET is set: the interp tests run directly")
    run_in_interpreter(__file__, "interp_")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_matches(got: torch.Tensor, want: torch.Tensor, rd: int = 0,
                   min_exact: float = 0.995, max_ulps: int = 1) -> None:
    """Kernel output against the twin's (see the module docstring for the bounds)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got.float()).all()
    if want.dtype == torch.float32:
        assert _rel(got, want) < 2e-6
        return
    equal = got == want
    assert equal.float().mean().item() >= min_exact, equal.float().mean().item()
    # At most one bf16 step (2^-7 relative) of the row's largest value.
    scale = want.float().abs().amax(-1, keepdim=True)
    assert ((got.float() - want.float()).abs() <= scale * 2.0 ** -7).all()
    # Unrotated channels: max_ulps at most.
    nope = got.shape[-1] - rd
    ulps = (got[..., :nope].view(torch.int16).int() - want[..., :nope].view(torch.int16).int())
    assert ulps.abs().max().item() <= max_ulps


def assert_fp8_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """``norm_rope`` with FP8 nope channels: a 1e-7 change of the norm (fp32), or a norm output
    one bf16 ulp apart (bf16), can move an e4m3 rounding by one e4m3 step (2^-3 relative; 2^-9
    of the block scale, below 2^-16 of the row's largest value, among the subnormals) or, via
    the block's amax, the block's scale: such elements are rare.  The rest follow the fp32
    bound (fp32) or are equal (bf16); a rotated channel from a moved bf16 input can cancel, so
    bf16 also allows one bf16 step of the row's scale."""
    assert got.shape == want.shape and torch.isfinite(got.float()).all()
    fp32 = want.dtype == torch.float32
    got, want = got.float(), want.float()
    row_max = want.abs().amax(-1, keepdim=True)
    diff = (got - want).abs()
    moved = diff > 1e-5 * row_max if fp32 else diff > 0
    assert moved.float().mean().item() < 0.01
    step = torch.maximum(got.abs(), want.abs()) * 2.0 ** -3 * 1.01 + \
        row_max * (2.0 ** -16 if fp32 else 2.0 ** -7)
    assert (diff[moved] <= step[moved]).all()
    if fp32:
        assert _rel(torch.where(moved, want, got), want) < 2e-6


DTYPES = [torch.float32, torch.bfloat16]


@interp_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 96), (37, 192), (2, 5, 576), (4, 1536)])
@pytest.mark.parametrize("weighted", [True, False])
def test_interp_rms_norm(dtype: torch.dtype, shape: tuple[int, ...], weighted: bool) -> None:
    from dsv4.ops import triton_norm as tri

    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 4).to(dtype)
    w = torch.rand(shape[-1], generator=gen) + 0.5 if weighted else None
    assert_matches(tri.rms_norm(x, w, 1e-6), torch_attn.rms_norm(x, w, 1e-6))


@interp_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,half", [((1, 64), 32), ((5, 3, 192), 32), ((9, 4, 2, 96), 8),
                                        ((6, 576), 32), ((3, 2, 24), 12)])
@pytest.mark.parametrize("inverse", [False, True])
def test_interp_apply_rope_is_exact(dtype: torch.dtype, shape: tuple[int, ...], half: int,
                                    inverse: bool) -> None:
    """No reduction, products rounded as in the twin: bit-equal (bf16 and fp32)."""
    from dsv4.ops import triton_norm as tri

    gen = torch.Generator().manual_seed(len(shape) * 10 + half)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    cos, sin = _rope_tables(shape[0], half, gen)
    got = tri.apply_rope(x, cos, sin, inverse=inverse)
    assert torch.equal(got, torch_attn.apply_rope(x, cos, sin, inverse=inverse))
    # A strided input (heads of a [H, T, d] buffer) gives the same result.
    if x.dim() == 3:
        xs = x.transpose(0, 1).contiguous().transpose(0, 1)
        assert torch.equal(tri.apply_rope(xs, cos, sin, inverse=inverse), got)
    # In place: the same values in x itself (its tail only written), for the kernel and the
    # twin; a strided x that no [T, M, d] view covers goes through a copy and back.
    for impl in (tri.apply_rope, torch_attn.apply_rope):
        for xi in (x.clone(), x.transpose(0, 1).contiguous().transpose(0, 1)
                   if x.dim() == 3 else x.clone()):
            ptr = xi.data_ptr()
            out = impl(xi, cos, sin, inverse=inverse, inplace=True)
            assert out is xi and xi.data_ptr() == ptr
            assert torch.equal(xi, got)


@interp_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,d,half", [(1, 64, 128, 32), (8, 8, 192, 32), (2, 32, 512, 32),
                                        (16, 4, 96, 16)])
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("inplace", [False, True])
def test_interp_head_norm_rope(dtype: torch.dtype, T: int, H: int, d: int, half: int,
                               renorm: bool, inplace: bool) -> None:
    from dsv4.ops import triton_norm as tri

    gen = torch.Generator().manual_seed(T * H + d)
    q = (torch.randn(T, H, d, generator=gen) * 3).to(dtype)
    cos, sin = _rope_tables(T, half, gen)
    want = torch_norm.head_norm_rope(q, cos, sin, 1e-6, renorm)
    src = q.clone()
    got = tri.head_norm_rope(src, cos, sin, 1e-6, renorm, inplace=inplace)
    assert (got is src) == inplace
    assert torch.equal(src, got if inplace else q)       # out of place leaves q alone
    if not renorm:
        assert torch.equal(got, want)                     # a pure rotation: exact
    else:
        assert_matches(got, want, rd=2 * half)


@interp_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,d,half,fp8_block", [(1, 512, 32, 64), (5, 512, 32, 0),
                                                (13, 192, 32, 32), (4, 576, 32, 64),
                                                (6, 96, 16, 16)])
@pytest.mark.parametrize("weighted", [True, False])
def test_interp_norm_rope(dtype: torch.dtype, T: int, d: int, half: int, fp8_block: int,
                          weighted: bool) -> None:
    from dsv4.ops import triton_norm as tri

    gen = torch.Generator().manual_seed(T + d + fp8_block)
    kv = (torch.randn(T, d, generator=gen) * 2).to(dtype)
    kv[0, :64] *= 1e-5            # a block whose amax sits at the 1e-4 floor after the norm
    w = torch.rand(d, generator=gen) + 0.5 if weighted else None
    cos, sin = _rope_tables(T, half, gen)
    got = tri.norm_rope(kv, w, cos, sin, 1e-6, fp8_block)
    want = torch_norm.norm_rope(kv, w, cos, sin, 1e-6, fp8_block)
    if fp8_block and dtype == torch.float32:
        assert_fp8_matches(got, want)
    else:
        assert_matches(got, want, rd=2 * half)


@interp_only
def test_interp_bad_input() -> None:
    from dsv4.ops import triton_norm as tri

    cos = sin = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="apply_rope"):
        tri.apply_rope(torch.zeros(3, 32), cos, sin)
    with pytest.raises(ValueError, match="rms_norm"):
        tri.rms_norm(torch.zeros(4, 32), torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match="fp8_block"):
        tri.norm_rope(torch.zeros(4, 48), None, cos, sin, 1e-6, fp8_block=64)


# ------------------------------------------------------- offline sm_90 compile (no GPU needed)
# (dtype, NORM, HAS_W, ROPE, INVERSE, COPY_NOPE, FP8_BLOCK, d, half, rows): the model's launches.
_SM90_LAUNCHES = [
    ("bf16", 2, False, True, False, False, 0, 512, 32, 64),    # V4 q: renorm + RoPE, in place
    ("bf16", 0, False, True, False, False, 0, 512, 32, 64),    # V4.1 q: RoPE, in place
    ("bf16", 0, False, True, True, True, 0, 512, 32, 64),      # inverse RoPE of o
    ("bf16", 0, False, True, False, True, 0, 128, 32, 64),     # indexer q / keys
    ("bf16", 1, True, True, False, True, 64, 512, 32, 1),      # kv: norm + RoPE + fp8 nope
    ("bf16", 1, True, True, False, True, 0, 512, 32, 1),       # kv: norm + RoPE
    ("bf16", 1, True, False, False, True, 0, 4096, 0, 8192),   # attn_norm / ffn_norm
    ("bf16", 1, True, False, False, True, 0, 7168, 0, 1),      # V4-Pro dim
    ("fp32", 1, True, True, False, True, 0, 512, 32, 64),      # compressor entries (fp32)
    ("fp32", 2, False, True, False, False, 0, 512, 32, 64),
]


@pytest.mark.skipif(INTERP, reason="compiles for the GPU target, not the interpreter")
@pytest.mark.parametrize("launch", _SM90_LAUNCHES, ids=lambda c: "-".join(map(str, c)))
def test_sm90_compiles_without_fma(launch: tuple) -> None:
    """Every launch shape of the model compiles for sm_90 (no GPU needed), and the PTX has no
    fused multiply-add: the rotation's products round as the twin's do."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from dsv4.ops import triton_norm as tri

    dt, norm, has_w, rope, inverse, copy_nope, fp8_block, d, half, rows = launch
    tile = tri._tile(rows, d, half)
    num_warps = tile.pop("num_warps")
    ptr = f"*{dt}"
    sig = {"x_ptr": ptr, "w_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "y_ptr": ptr,
           "n_rows": "i32", "M": "i32", "d": "i32", "nope": "i32", "half": "i32",
           "stride_xt": "i64", "stride_xm": "i64", "stride_yt": "i64", "stride_ym": "i64",
           "stride_c": "i64", "eps": "fp32"}
    constexprs = dict(NORM=norm, HAS_W=has_w, ROPE=rope, INVERSE=inverse, COPY_NOPE=copy_nope,
                      FP8_BLOCK=fp8_block, **tile)
    sig.update({k: "constexpr" for k in constexprs})
    src = triton.compiler.ASTSource(fn=tri._norm_rope_kernel, signature=sig,
                                    constexprs=constexprs)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": num_warps, "enable_fp_fusion": False})
    except RuntimeError as exc:  # pragma: no cover - a machine without Triton's CUDA toolchain
        if "ptxas" in str(exc).lower() and "not found" in str(exc).lower():
            pytest.skip(f"no ptxas: {exc}")
        raise
    assert "fma.rn.f32" not in kernel.asm["ptx"]


# ------------------------------------------------------------------ GPU at V4-Flash shapes
gpu_only = pytest.mark.skipif(not torch.cuda.is_available() or INTERP,
                              reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")


@gpu_only
@pytest.mark.parametrize("T", [1, 64, 8192])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_v4_flash_shapes(T: int, dtype: torch.dtype) -> None:
    from dsv4.ops import triton_norm as tri

    dev, H, d, half = "cuda", 64, 512, 32
    gen = torch.Generator(device=dev).manual_seed(T)
    ang = torch.rand(T, 1, generator=gen, device=dev) * 60000 * \
        torch.logspace(0, -4, half, device=dev)[None, :]
    cos, sin = torch.cos(ang), torch.sin(ang)
    q = (torch.randn(T, H, d, generator=gen, device=dev) * 3).to(dtype)
    for renorm in (True, False):
        want = torch_norm.head_norm_rope(q, cos, sin, 1e-6, renorm)
        got = tri.head_norm_rope(q.clone(), cos, sin, 1e-6, renorm, inplace=True)
        assert_matches(got, want, rd=2 * half, min_exact=0.99,
                       max_ulps=2 if renorm and dtype == torch.bfloat16 else 1)
    o = (torch.randn(T, H, d, generator=gen, device=dev)).to(dtype)
    want = torch_attn.apply_rope(o, cos, sin, inverse=True)
    assert torch.equal(tri.apply_rope(o, cos, sin, inverse=True), want)
    assert torch.equal(tri.apply_rope(o, cos, sin, inverse=True, inplace=True), want)
    kv = (torch.randn(T, d, generator=gen, device=dev) * 2).to(dtype)
    w = torch.rand(d, generator=gen, device=dev) + 0.5
    for fp8_block in (0, 64):
        got = tri.norm_rope(kv, w, cos, sin, 1e-6, fp8_block)
        want = torch_norm.norm_rope(kv, w, cos, sin, 1e-6, fp8_block)
        if fp8_block:
            assert_fp8_matches(got, want)
        else:
            assert_matches(got, want, rd=2 * half, min_exact=0.99)
    for D in (1024, 4096, 7168):
        x = torch.randn(T, D, generator=gen, device=dev).to(dtype)
        wx = torch.rand(D, generator=gen, device=dev) + 0.5
        assert_matches(tri.rms_norm(x, wx, 1e-6), torch_attn.rms_norm(x, wx, 1e-6),
                       min_exact=0.99)


def test_hw_bf16_round_is_opt_in_and_never_in_the_interpreter() -> None:
    """triton_dense.HW_BF16_ROUND (the GPU's cast for round_to_bf16): off by default, on with
    DSV4_HW_BF16_ROUND=1, and off in the interpreter whatever the variable (its cast
    truncates)."""
    import subprocess
    import sys

    def flag(**env: str) -> str:
        code = "from dsv4.ops import triton_dense as t; print(bool(t.HW_BF16_ROUND))"
        full = {k: v for k, v in os.environ.items()
                if k not in ("DSV4_HW_BF16_ROUND", "TRITON_INTERPRET")}
        return subprocess.run([sys.executable, "-c", code], env={**full, **env},
                              capture_output=True, text=True, check=True).stdout.strip()

    assert flag() == "False"
    assert flag(DSV4_HW_BF16_ROUND="1") == "True"
    assert flag(DSV4_HW_BF16_ROUND="1", TRITON_INTERPRET="1") == "False"
