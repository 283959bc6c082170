"""The Hadamard option of the fused cache write (``write_records(..., hadamard=True)``): the V4
indexer compressor's index keys are rotated and packed in one launch.

* twin (plain CPU): the bytes of ``write_records(hadamard_transform(rows))``; bad widths refused;
* ``test_interp_*`` (child process with ``TRITON_INTERPRET=1``): the kernel writes the twin's
  bytes for fp4 index-key records and plain pools, fp32 and bf16 rows;
* ``test_gpu_*``: real shapes on the GPU (skipped without CUDA).
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.cache import formats as cf
from dsv4.formats import hadamard_transform
from dsv4.ops import torch_records
from tests.kernels.interp_child import run_in_interpreter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(
    not INTERP, reason="interpreter test: run by test_hadamard_kernel_in_interpreter")

INDEX_KEYS = cf.fp4_record(128, cf.V4_INDEX_BLOCK, "e8m0")
SMALL_KEYS = cf.fp4_record(64, cf.V4_INDEX_BLOCK, "e8m0")


def _rows(n: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows with a zero row and a tiny and a huge one (scale floors / large scales)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen) * 2
    x[0] = 0.0
    if n > 2:
        x[1] *= 1e-30
        x[2] *= 1e5
    return x.to(dtype)


def _pool(fmt: cf.RecordFormat | None, n: int, d: int, dtype: torch.dtype,
          seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if fmt is None:
        return torch.randn(n, d, generator=gen).to(dtype)
    return torch.randint(0, 256, (n, fmt.record_bytes), dtype=torch.uint8, generator=gen)


# ------------------------------------------------------------------------ twin (plain CPU)
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16])
def test_twin_hadamard_writes_the_rotated_rows(row_dtype: torch.dtype) -> None:
    rows = _rows(6, 128, row_dtype, 1)
    pool = _pool(INDEX_KEYS, 10, 128, torch.uint8, 2)
    want = pool.clone()
    dst, src = torch.tensor([7, 2, 9]), torch.tensor([5, 0, 3])
    torch_records.write_records(pool, dst, rows, src, INDEX_KEYS, hadamard=True)
    torch_records.write_records(want, dst, hadamard_transform(rows), src, INDEX_KEYS)
    assert torch.equal(pool, want)
    # The rotation matters: the unrotated rows give other bytes.
    plain = _pool(INDEX_KEYS, 10, 128, torch.uint8, 2)
    torch_records.write_records(plain, dst, rows, src, INDEX_KEYS)
    assert not torch.equal(plain[dst], pool[dst])


def test_twin_hadamard_refuses_a_width_that_is_not_a_power_of_two() -> None:
    pool = torch.zeros(4, 96)
    with pytest.raises(ValueError, match="power-of-two"):
        torch_records.write_records(pool, torch.tensor([0, 1]), torch.zeros(2, 96), None, None,
                                    hadamard=True)


def test_triton_op_refuses_bad_width_and_runs_the_twin_off_gpu() -> None:
    from dsv4.ops import triton_records as tri

    with pytest.raises(ValueError, match="power-of-two"):
        tri.write_records(torch.zeros(4, 96), torch.tensor([0]), torch.zeros(1, 96), None, None,
                          hadamard=True)
    if INTERP:
        return
    rows = _rows(3, 128, torch.bfloat16, 5)
    a = _pool(INDEX_KEYS, 5, 128, torch.uint8, 6)
    b = a.clone()
    tri.write_records(a, torch.tensor([4, 0, 2]), rows, None, INDEX_KEYS, hadamard=True)
    torch_records.write_records(b, torch.tensor([4, 0, 2]), rows, None, INDEX_KEYS,
                                hadamard=True)
    assert torch.equal(a, b)


# ---------------------------------------------------------------- interpreter (child process)
def test_hadamard_kernel_in_interpreter() -> None:
    """Run this file's interpreter tests with ``TRITON_INTERPRET=1`` in a child."""
    if INTERP:
        pytest.skip("TRITON_INTERPRET is set: the interp tests run directly")
    run_in_interpreter(__file__, "interp_")


def _check(fmt: cf.RecordFormat | None, d: int, row_dtype: torch.dtype,
           pool_dtype: torch.dtype, n_rows: int, dst: torch.Tensor, src: torch.Tensor | None,
           seed: int, device: str = "cpu") -> None:
    """The kernel writes the twin's bytes into exactly the rows ``dst`` (others untouched)."""
    from dsv4.ops import triton_records as tri

    rows = _rows(n_rows, d, row_dtype, seed).to(device)
    pool = _pool(fmt, int(dst.max()) + 3, d, pool_dtype, seed + 1).to(device)
    want = pool.clone()
    dst, src = dst.to(device), None if src is None else src.to(device)
    torch_records.write_records(want, dst, rows, src, fmt, hadamard=True)
    tri.write_records(pool, dst, rows, src, fmt, hadamard=True)
    assert torch.equal(pool, want)


@interp_only
@pytest.mark.parametrize("fmt", [INDEX_KEYS, SMALL_KEYS], ids=["d128", "d64"])
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16])
def test_interp_hadamard_records_are_identical(fmt: cf.RecordFormat,
                                               row_dtype: torch.dtype) -> None:
    _check(fmt, fmt.dim, row_dtype, torch.uint8, 6, torch.tensor([11, 0, 5, 2]),
           torch.tensor([5, 3, 2, 0]), 1)
    _check(fmt, fmt.dim, row_dtype, torch.uint8, 9, torch.arange(9).flip(0) * 2, None, 2)


@interp_only
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16])
def test_interp_hadamard_plain_pool(row_dtype: torch.dtype) -> None:
    _check(None, 32, row_dtype, torch.float32, 5, torch.tensor([4, 1, 6]),
           torch.tensor([0, 4, 2], dtype=torch.int32), 3)


# ------------------------------------------------------------------ GPU at real shapes
gpu_only = pytest.mark.skipif(not torch.cuda.is_available() or INTERP,
                              reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")


@gpu_only
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16])
def test_gpu_hadamard_real_shapes(row_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    _check(INDEX_KEYS, 128, row_dtype, torch.uint8, 64,
           torch.randperm(64 * 64, generator=gen)[:64], None, 1, "cuda")
    _check(INDEX_KEYS, 128, row_dtype, torch.uint8, 1024,
           torch.randperm(4096, generator=gen)[:1024], None, 2, "cuda")
