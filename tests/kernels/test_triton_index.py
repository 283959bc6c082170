"""The indexer's fused query path (``dsv4/ops/torch_index.py`` twin, ``dsv4/ops/triton_index.py``
kernel).

* twin against the unfused code the indexers ran before (bit for bit), argument checks, op-table
  wiring — plain CPU;
* ``test_interp_*``: the kernel against the twin in the Triton interpreter, re-run in a child
  process with ``TRITON_INTERPRET=1`` by :func:`test_kernels_in_interpreter`.  The kernel rounds
  where the twin rounds and its Hadamard butterflies add the same operands, so the interpreter
  gives identical bits (asserted);
* ``test_gpu_*``: V4-Flash / V4.1 shapes on the GPU (skipped without CUDA): fp32 queries within
  1e-6 relative, FP4 values identical except where an fp32 rounding difference moves a value
  across a rounding boundary — :func:`assert_queries_match` counts those and bounds them.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.formats import fake_quant_fp4, hadamard_transform
from dsv4.ops import get_ops, torch_attn, torch_index
from tests.kernels.interp_child import run_in_interpreter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(
    not INTERP, reason="interpreter test: run by test_kernels_in_interpreter in a child process")

# (hadamard, fp4_block) of the model's sites: V4 official, V4 bf16 with fp4 record keys,
# V4.1 official, bf16 numerics with plain keys.
SITES = [(True, 32), (True, 0), (False, 32), (False, 0)]
V4_SCALE = 128 ** -0.5 * 64 ** -0.5


def _rope_tables(T: int, half: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(T, 1, generator=gen) * 5000 * torch.logspace(0, -4, half)[None, :]
    return torch.cos(ang), torch.sin(ang)


def _inputs(T: int, H: int, D: int, half: int, dtype: torch.dtype, seed: int
            ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, D, generator=gen) * 3).to(dtype)
    q[0, 0, :32] *= 1e-3                 # a block far below the others
    q[-1, -1, 32:64] = 0.0               # an all-zero block (the amax floor)
    w = (torch.randn(T, H, generator=gen) * 4).to(dtype)
    cos, sin = _rope_tables(T, half, gen)
    return q, w, cos, sin


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Identical bits (unlike ``torch.equal``, −0.0 differs from +0.0)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return a.dtype == b.dtype and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


def _unfused(q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             scale: float, hadamard: bool, fp4_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexers' query code before the fusion (V4 Indexer / V4.1 index_queries, verbatim)."""
    q = torch_attn.apply_rope(q, cos, sin)
    if hadamard and fp4_block:
        q = fake_quant_fp4(hadamard_transform(q), fp4_block)
    elif hadamard:
        q = hadamard_transform(q)
    elif fp4_block:
        q = fake_quant_fp4(q, fp4_block, scale_dtype="e8m0")
    return q, (w * scale).float()


# ------------------------------------------------------------------------ twin (plain CPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hadamard,fp4_block", SITES)
def test_twin_is_the_unfused_code(dtype: torch.dtype, hadamard: bool, fp4_block: int) -> None:
    q, w, cos, sin = _inputs(5, 4, 128, 32, dtype, 1)
    got_q, got_w = torch_index.indexer_queries(q, w, cos, sin, V4_SCALE, hadamard, fp4_block)
    want_q, want_w = _unfused(q, w, cos, sin, V4_SCALE, hadamard, fp4_block)
    assert got_q.dtype == dtype and got_w.dtype == torch.float32
    assert bits_equal(got_q, want_q) and bits_equal(got_w, want_w)
    plain = torch_attn.apply_rope(q, cos, sin)
    assert torch.equal(got_q, plain) == (not hadamard and not fp4_block)
    if fp4_block:   # on the e2m1 grid times a power of two per block
        blocks = got_q.float().unflatten(-1, (-1, fp4_block))
        scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 6
        assert torch.equal(fake_quant_fp4(got_q, fp4_block), got_q)
        assert (blocks / scale).abs().max() <= 6.0 * (1 + 1e-6)


def test_twin_rejects_bad_input() -> None:
    q = torch.zeros(3, 2, 64)
    w = torch.zeros(3, 2)
    cos = sin = torch.zeros(3, 16)
    with pytest.raises(ValueError, match="indexer_queries.*q must be"):
        torch_index.indexer_queries(q[:, 0], w, cos, sin, 1.0, False, 0)
    with pytest.raises(ValueError, match="weights"):
        torch_index.indexer_queries(q, w[:, :1], cos, sin, 1.0, False, 0)
    with pytest.raises(ValueError, match="power-of-two"):
        torch_index.indexer_queries(torch.zeros(3, 2, 48), w, cos, sin, 1.0, True, 0)
    with pytest.raises(ValueError, match="fp4_block"):
        torch_index.indexer_queries(q, w, cos, sin, 1.0, False, 24)
    with pytest.raises(ValueError, match="indexer_queries"):
        torch_index.indexer_queries(q, w, cos[:2], sin[:2], 1.0, False, 0)


def test_op_table_has_indexer_queries() -> None:
    pytest.importorskip("triton")
    from dsv4.ops import triton_index

    assert get_ops("torch").indexer_queries is torch_index.indexer_queries
    assert get_ops("triton").indexer_queries is triton_index.indexer_queries


def test_triton_op_runs_the_twin_off_gpu() -> None:
    if INTERP:
        pytest.skip("the interpreter runs the kernel itself on CPU")
    pytest.importorskip("triton")
    from dsv4.ops import triton_index

    q, w, cos, sin = _inputs(3, 4, 64, 16, torch.float32, 2)
    got = triton_index.indexer_queries(q, w, cos, sin, 0.1, True, 32)
    want = torch_index.indexer_queries(q, w, cos, sin, 0.1, True, 32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------- interpreter (child process)
def test_kernels_in_interpreter() -> None:
    """Run this file's interpreter tests with ``TRITON_INTERPRET=1`` in a child."""
    if INTERP:
        pytest.skip("TRITON_INTERPRET is set: the interp tests run directly")
    run_in_interpreter(__file__, "interp_")


def assert_queries_match(got: tuple[torch.Tensor, torch.Tensor],
                         want: tuple[torch.Tensor, torch.Tensor], fp4_block: int,
                         max_moved: float = 1e-3) -> int:
    """Kernel (q, w) against the twin's.  Without FP4: fp32 within 1e-6 relative, bf16 within one
    ulp.  With FP4: values identical except elements an fp32 rounding difference moved across an
    e2m1 rounding boundary — at most one e2m1 step apart (<= 2·s, s = the block's power-of-two
    scale < 2·amax/6), and at most ``max_moved`` of them.  Returns how many moved."""
    (gq, gw), (wq, ww) = got, want
    assert gq.shape == wq.shape and gq.dtype == wq.dtype and gw.dtype == torch.float32
    assert torch.isfinite(gq.float()).all()
    assert torch.equal(gw, ww)
    a, b = gq.double(), wq.double()
    if not fp4_block:
        if wq.dtype == torch.float32:
            assert ((a - b).norm() / b.norm().clamp_min(1e-30)).item() <= 1e-6
        else:
            ulps = (gq.view(torch.int16).int() - wq.view(torch.int16).int()).abs()
            assert ulps.max().item() <= 1
        return 0
    moved = a != b
    n_moved = int(moved.sum())
    assert n_moved <= max_moved * moved.numel(), n_moved
    if n_moved:
        step = b.unflatten(-1, (-1, fp4_block)).abs().amax(-1, keepdim=True) / 6 * 4
        step = step.expand(*step.shape[:-1], fp4_block).flatten(-2)
        assert ((a - b).abs()[moved] <= step[moved] * 1.0001).all()
    return n_moved


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hadamard,fp4_block", SITES)
@pytest.mark.parametrize("T,H,D,half", [(1, 64, 128, 32), (3, 5, 128, 32), (2, 8, 64, 16),
                                        (4, 3, 32, 8)])
def test_interp_kernel_is_the_twin(dtype: torch.dtype, hadamard: bool, fp4_block: int, T: int,
                                   H: int, D: int, half: int) -> None:
    from dsv4.ops import triton_index as tri

    q, w, cos, sin = _inputs(T, H, D, half, dtype, T * H + D)
    got = tri.indexer_queries(q, w, cos, sin, V4_SCALE, hadamard, fp4_block)
    want = torch_index.indexer_queries(q, w, cos, sin, V4_SCALE, hadamard, fp4_block)
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
    assert assert_queries_match(got, want, fp4_block) == 0


@interp_only
def test_interp_strided_q_and_fp4_ties() -> None:
    """q as a strided view (heads of a transposed buffer), and blocks whose values sit exactly
    on e2m1 rounding midpoints (ties to the even code) and at ±0."""
    from dsv4.ops import triton_index as tri

    T, H, D, half = 2, 4, 64, 16
    q, w, cos, sin = _inputs(T, H, D, half, torch.float32, 7)
    # Head 0 of token 0: no rotation effect on channels 0..31 (the nope part): midpoints × 2^-2.
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -2.5, -5.0,
                         0.0, -0.0, 0.1, -0.3] * 2) * 0.25
    q[0, 0, :32] = mids
    qs = q.transpose(0, 1).contiguous().transpose(0, 1)
    for hadamard in (False, True):
        got = tri.indexer_queries(qs, w, cos, sin, 0.5, hadamard, 32)
        want = torch_index.indexer_queries(q, w, cos, sin, 0.5, hadamard, 32)
        assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
        if not hadamard:                         # the −0.0 inputs stay −0.0
            assert ((got[0] == 0) & torch.signbit(got[0])).any()


# ------------------------------------------------------------------ GPU at real shapes
gpu_only = pytest.mark.skipif(not torch.cuda.is_available() or INTERP,
                              reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")


@gpu_only
@pytest.mark.parametrize("T", [1, 64, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model", ["v4_flash", "v41_flash"])
def test_gpu_real_shapes(T: int, dtype: torch.dtype, model: str) -> None:
    from dsv4.ops import triton_index as tri

    H = 64 if model == "v4_flash" else 32
    scale = 128 ** -0.5 * H ** -0.5
    q, w, cos, sin = (t.cuda() for t in _inputs(T, H, 128, 32, dtype, T))
    sites = [(True, 32), (True, 0), (False, 0)] if model == "v4_flash" else [(False, 32),
                                                                             (False, 0)]
    for hadamard, fp4_block in sites:
        got = tri.indexer_queries(q, w, cos, sin, scale, hadamard, fp4_block)
        want = torch_index.indexer_queries(q, w, cos, sin, scale, hadamard, fp4_block)
        n = assert_queries_match(got, want, fp4_block)
        print(f"{model} T={T} {dtype} hadamard={hadamard} fp4={fp4_block}: {n} of "
              f"{want[0].numel()} values moved across a rounding boundary")
