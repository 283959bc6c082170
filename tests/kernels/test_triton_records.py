"""Fused cache writes (``dsv4/ops/torch_records.py`` twins, ``dsv4/ops/triton_records.py``).

* twins: the code the ring / pools ran before (``index_copy_`` of ``encode_rows``), records that
  decode to the official fake quant, argument checks, op-table wiring — plain CPU;
* ``test_interp_*``: the kernel against the twin in the Triton interpreter (child process with
  ``TRITON_INTERPRET=1``, :func:`test_kernels_in_interpreter`): record bytes identical, for every
  record format (V4 584-byte window / compressed, V4.1 fp8 window and fp4 compressed, fp4 index
  keys) and plain pools, with rows at rounding ties, at the amax floors and ±0;
* ``test_gpu_*``: real shapes on the GPU (skipped without CUDA), bytes identical.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.cache import formats as cf
from dsv4.formats import fake_quant_fp4, fake_quant_fp8
from dsv4.ops import get_ops, torch_records
from tests.kernels.interp_child import run_in_interpreter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(
    not INTERP, reason="interpreter test: run by test_kernels_in_interpreter in a child process")

FORMATS = {
    "v4_kv": cf.v4_kv_record(512, 64),
    "v41_window": cf.fp8_record(512, cf.V41_WINDOW_BLOCK),
    "v41_latent": cf.fp4_record(512, cf.V41_LATENT_BLOCK, "e4m3"),
    "index_keys": cf.fp4_record(128, cf.V4_INDEX_BLOCK, "e8m0"),
    "small_v4_kv": cf.v4_kv_record(192, 64),       # the tiny model's V4 record (2 scales + pad)
}


def _rows(n: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows with the hard cases planted: a block at the fp8 amax floor, an all-zero block,
    ±0, e4m3 / e2m1 rounding ties, a large block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen) * 3
    x[0, :64] *= 1e-6
    x[1, :32] = 0.0
    x[1, 40] = -0.0
    if n > 2:
        # amax 448 (fp8 scale 1; fp4 e8m0 scale 2^7) with e4m3 ties 1.0625, 17, 3·2^-10 and
        # e2m1 ties at midpoints × 2^7
        x[2, :16] = torch.tensor([448.0, 1.0625, 17.0, 3 * 2.0 ** -10, -1.0625, -17.0, 0.25 * 128,
                                  0.75 * 128, 1.25 * 128, 1.75 * 128, 2.5 * 128, 3.5 * 128,
                                  5.0 * 128, -2.5 * 128, 6.0 * 64, 0.0])
    if n > 3:
        x[3] *= 1e4
    return x.to(dtype)


def _pool(fmt: cf.RecordFormat | None, n: int, d: int, dtype: torch.dtype,
          seed: int) -> torch.Tensor:
    """A pool full of junk, so that a write that misses a byte shows."""
    gen = torch.Generator().manual_seed(seed)
    if fmt is None:
        return torch.randn(n, d, generator=gen).to(dtype)
    return torch.randint(0, 256, (n, fmt.record_bytes), dtype=torch.uint8, generator=gen)


# ------------------------------------------------------------------------ twins (plain CPU)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_twin_writes_the_records_of_encode_rows(name: str) -> None:
    fmt = FORMATS[name]
    rows = _rows(6, fmt.dim, torch.float32, 1)
    pool = _pool(fmt, 10, fmt.dim, torch.uint8, 2)
    before = pool.clone()
    dst, src = torch.tensor([7, 2, 9]), torch.tensor([5, 0, 2])
    torch_records.write_records(pool, dst, rows, src, fmt)
    want = before.clone()
    want.index_copy_(0, dst, cf.encode_rows(rows, fmt, torch.uint8)[src])
    assert torch.equal(pool, want)
    assert torch.equal(torch_records.encode_records(rows, fmt, torch.uint8), fmt.pack(rows))
    # The records decode to the official fake quant of the rows (bf16 tail for V4).
    got = fmt.unpack(pool[dst])
    x = rows[src]
    nq = fmt.quant_dims
    if fmt.quant == "fp8":
        want_q = fake_quant_fp8(x[:, :nq], fmt.block)
    else:
        want_q = fake_quant_fp4(x[:, :nq], fmt.block, fmt.scale)
    assert torch.equal(got[:, :nq], want_q)
    assert torch.equal(got[:, nq:], x[:, nq:].bfloat16().float())


def test_twin_plain_pool_and_identity_src() -> None:
    rows = _rows(4, 64, torch.float32, 3)
    pool = _pool(None, 8, 64, torch.bfloat16, 4)
    want = pool.clone()
    torch_records.write_records(pool, torch.tensor([1, 3, 5, 7]), rows, None, None)
    want[1::2] = rows.bfloat16()
    assert torch.equal(pool, want)
    assert torch.equal(torch_records.encode_records(rows, None, torch.bfloat16), rows.bfloat16())


def test_twins_reject_bad_input() -> None:
    fmt = FORMATS["index_keys"]
    rows = torch.zeros(3, 128)
    pool = torch.zeros(5, fmt.record_bytes, dtype=torch.uint8)
    dst = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="rows must be"):
        torch_records.write_records(pool, dst, rows[0], None, fmt)
    with pytest.raises(ValueError, match="channels"):
        torch_records.write_records(pool, dst, torch.zeros(3, 64), None, fmt)
    with pytest.raises(ValueError, match="pool must be"):
        torch_records.write_records(pool[:, :10], dst, rows, None, fmt)
    with pytest.raises(ValueError, match="uint8"):
        torch_records.write_records(pool.float(), dst, rows, None, fmt)
    with pytest.raises(ValueError, match="dst"):
        torch_records.write_records(pool, dst[:2], rows, None, fmt)
    with pytest.raises(ValueError, match="src"):
        torch_records.write_records(pool, dst, rows, torch.zeros(3), fmt)
    with pytest.raises(ValueError, match="floating"):
        torch_records.encode_records(rows.long(), fmt, torch.uint8)


def test_op_table_has_the_record_ops() -> None:
    pytest.importorskip("triton")
    from dsv4.ops import triton_records

    t, k = get_ops("torch"), get_ops("triton")
    assert t.write_records is torch_records.write_records
    assert t.encode_records is torch_records.encode_records
    assert k.write_records is triton_records.write_records
    assert k.encode_records is triton_records.encode_records


def test_triton_ops_run_the_twins_off_gpu() -> None:
    if INTERP:
        pytest.skip("the interpreter runs the kernel itself on CPU")
    pytest.importorskip("triton")
    from dsv4.ops import triton_records

    fmt = FORMATS["v4_kv"]
    rows = _rows(3, 512, torch.float32, 5)
    a, b = _pool(fmt, 4, 512, torch.uint8, 6), _pool(fmt, 4, 512, torch.uint8, 6)
    triton_records.write_records(a, torch.tensor([3, 0, 1]), rows, None, fmt)
    torch_records.write_records(b, torch.tensor([3, 0, 1]), rows, None, fmt)
    assert torch.equal(a, b)


def test_twin_read_records_is_unpack_of_the_rows() -> None:
    fmt = FORMATS["v4_kv"]
    pool = fmt.pack(torch.randn(9, 512, generator=torch.Generator().manual_seed(4)))
    rows = torch.tensor([7, 0, 7, 3])
    got = torch_records.read_records(pool, rows, fmt, torch.bfloat16)
    assert torch.equal(got, fmt.unpack(pool[rows], torch.bfloat16))
    assert torch.equal(torch_records.read_records(pool, None, fmt, torch.float32),
                       fmt.unpack(pool, torch.float32))
    for bad in ((pool.float(), rows), (pool[:, :-1], rows), (pool, rows.float()),
                (pool, rows[:, None])):
        with pytest.raises(ValueError, match="read_records"):
            torch_records.read_records(*bad, fmt, torch.float32)
    assert get_ops("torch").read_records is torch_records.read_records


# ---------------------------------------------------------------- interpreter (child process)
def test_kernels_in_interpreter() -> None:
    """Run this file's interpreter tests with ``TRITON_INTERPRET=1`` in a child."""
    if INTERP:
        pytest.skip("TRITON_INTERPRET is set: the interp tests run directly")
    run_in_interpreter(__file__, "interp_")


def _check_kernel(fmt: cf.RecordFormat | None, d: int, row_dtype: torch.dtype,
                  pool_dtype: torch.dtype, n_rows: int, dst: torch.Tensor,
                  src: torch.Tensor | None, seed: int, device: str = "cpu") -> None:
    """The kernel writes the twin's bytes into exactly the rows ``dst`` (others untouched)."""
    from dsv4.ops import triton_records as tri

    rows = _rows(n_rows, d, row_dtype, seed).to(device)
    pool = _pool(fmt, int(dst.max()) + 3, d, pool_dtype, seed + 1).to(device)
    want = pool.clone()
    dst, src = dst.to(device), None if src is None else src.to(device)
    torch_records.write_records(want, dst, rows, src, fmt)
    tri.write_records(pool, dst, rows, src, fmt)
    assert torch.equal(pool, want)
    assert torch.equal(tri.encode_records(rows, fmt, pool_dtype),
                       torch_records.encode_records(rows, fmt, pool_dtype))


@interp_only
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16])
def test_interp_records_are_identical(name: str, row_dtype: torch.dtype) -> None:
    fmt = FORMATS[name]
    # A decode-like scatter with a gather (src), and a prefill-like one over many rows.
    _check_kernel(fmt, fmt.dim, row_dtype, torch.uint8, 6, torch.tensor([11, 0, 5, 2]),
                  torch.tensor([5, 3, 2, 0]), 1)
    _check_kernel(fmt, fmt.dim, row_dtype, torch.uint8, 37, torch.arange(37).flip(0) * 2, None,
                  2)


@interp_only
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16])
def test_interp_plain_pools(pool_dtype: torch.dtype, row_dtype: torch.dtype) -> None:
    _check_kernel(None, 192, row_dtype, pool_dtype, 5, torch.tensor([4, 1, 6]),
                  torch.tensor([0, 4, 2], dtype=torch.int32), 3)


@interp_only
def test_interp_strided_rows_and_random_bits() -> None:
    """Rows read through a strided view; rows of random finite fp32 bit patterns (every exponent
    from subnormal to huge, so scales clamp and e4m3 subnormals appear)."""
    from dsv4.ops import triton_records as tri

    gen = torch.Generator().manual_seed(9)
    bits = torch.randint(0, 2 ** 31 - 1, (16, 512), generator=gen, dtype=torch.int64)
    x = (bits & 0x7F7FFFFF).to(torch.int32).view(torch.float32) * 2.0 ** -100
    x = torch.where(torch.rand(16, 512, generator=gen) < 0.5, -x, x)
    wide = torch.zeros(16, 1024)
    wide[:, ::2] = x
    for fmt in (FORMATS["v4_kv"], FORMATS["v41_window"], FORMATS["v41_latent"]):
        got = tri.encode_records(wide[:, ::2], fmt, torch.uint8)
        assert torch.equal(got, fmt.pack(x))


def _check_read(fmt: cf.RecordFormat, n_pool: int, rows: torch.Tensor | None, seed: int,
                device: str = "cpu") -> None:
    """The kernel's dense copy equals the twin's (``RecordFormat.unpack``) bit for bit, in
    bf16 and fp32, every element written."""
    from dsv4.ops import triton_records as tri

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_pool, fmt.dim, generator=gen) * torch.logspace(-3, 2, n_pool)[:, None]
    pool = fmt.pack(x).to(device)          # valid records over a spread of magnitudes
    rows = None if rows is None else rows.to(device)
    for dtype in (torch.bfloat16, torch.float32):
        want = torch_records.read_records(pool, rows, fmt, dtype)
        torch.full(want.shape, float("nan"), dtype=dtype, device=device)  # poison the block
        got = tri.read_records(pool, rows, fmt, dtype)
        assert torch.equal(got, want), (fmt.name, dtype)


@interp_only
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_interp_read_records(name: str) -> None:
    fmt = FORMATS[name]
    _check_read(fmt, 11, torch.tensor([10, 0, 3, 3, 7]), 7)
    _check_read(fmt, 37, None, 8)
    _check_read(fmt, 5, torch.tensor([], dtype=torch.int64), 9)


# ------------------------------------------------------------------ GPU at real shapes
gpu_only = pytest.mark.skipif(not torch.cuda.is_available() or INTERP,
                              reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")


@gpu_only
@pytest.mark.parametrize("name", ["v4_kv", "v41_window", "v41_latent", "index_keys"])
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16])
def test_gpu_real_shapes(name: str, row_dtype: torch.dtype) -> None:
    fmt = FORMATS[name]
    # Decode: 64 requests into a 64-slot × 128-row ring; prefill: 2048 rows into pool pages.
    gen = torch.Generator().manual_seed(0)
    ring_rows = torch.randperm(64 * 128, generator=gen)[:64]
    _check_kernel(fmt, fmt.dim, row_dtype, torch.uint8, 64, ring_rows, torch.arange(64), 1,
                  "cuda")
    _check_kernel(fmt, fmt.dim, row_dtype, torch.uint8, 2048,
                  torch.randperm(4096, generator=gen)[:2048], None, 2, "cuda")
    _check_kernel(None, fmt.dim, row_dtype, torch.bfloat16, 64, ring_rows, None, 3, "cuda")


@gpu_only
@pytest.mark.parametrize("name", ["v4_kv", "v41_window", "v41_latent", "index_keys"])
def test_gpu_read_records(name: str) -> None:
    """A prefill's dense copies at real sizes: 8K window rows read whole, 2,048 entries
    gathered from a 16K-row pool."""
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(1)
    _check_read(fmt, 8192, None, 1, "cuda")
    _check_read(fmt, 16384, torch.randint(0, 16384, (2048,), generator=gen), 2, "cuda")
