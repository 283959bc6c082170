"""Torch twins of the cache-write ops: encode rows into what a pool stores (records of
``dsv4.cache.formats``, or the rows cast to the pool's dtype) and scatter them into pool rows.

``write_records(pool, dst, rows, src, fmt)`` is what the window ring and the entry pools ran
before the fusion, ``pool.index_copy_(0, dst, encode_rows(rows[src], fmt, pool.dtype))``; the
Triton kernel (``dsv4/ops/triton_records.py``) writes the same bytes in one launch.  With
``hadamard=True`` the rows are first rotated by ``formats.hadamard_transform`` (in their dtype),
what the V4 indexer's compressor stores as index keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4.cache.formats import RecordFormat, encode_rows
from dsv4.formats import hadamard_transform

__all__ = ["encode_records", "write_records", "check_write_args", "read_records",
           "check_read_args"]


def _check_rows(name: str, rows: Tensor, fmt: RecordFormat | None) -> None:
    if rows.dim() != 2:
        raise ValueError(f"{name}: rows must be [N, d]; found shape {tuple(rows.shape)}")
    if not rows.dtype.is_floating_point:
        raise ValueError(f"{name}: rows must be floating point; found {rows.dtype}")
    if fmt is not None and rows.shape[1] != fmt.dim:
        raise ValueError(f"{name}: {fmt.name} records hold {fmt.dim} channels; rows have "
                         f"{rows.shape[1]}")


def check_write_args(pool: Tensor, dst: Tensor, rows: Tensor, src: Tensor | None,
                     fmt: RecordFormat | None) -> None:
    """ValueError unless pool [P, width], dst [M], rows [N, d] and src [M] (or None: M = N) fit
    together and ``fmt`` (None: a plain pool of width d)."""
    _check_rows("write_records", rows, fmt)
    width = rows.shape[1] if fmt is None else fmt.record_bytes
    if pool.dim() != 2 or pool.shape[1] != width:
        raise ValueError(f"write_records: pool must be [P, {width}]; found shape "
                         f"{tuple(pool.shape)}")
    if fmt is not None and pool.dtype != torch.uint8:
        raise ValueError(f"write_records: a {fmt.name} record pool must be uint8; found "
                         f"{pool.dtype}")
    if fmt is None and not pool.dtype.is_floating_point:
        raise ValueError(f"write_records: a plain pool must be floating point; found {pool.dtype}")
    n = rows.shape[0] if src is None else None
    if src is not None:
        if src.dim() != 1 or src.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"write_records: src must be a 1-D integer tensor; found "
                             f"{src.dtype} {tuple(src.shape)}")
        n = src.shape[0]
    if dst.dim() != 1 or dst.dtype not in (torch.int32, torch.int64) or dst.shape[0] != n:
        raise ValueError(f"write_records: dst must be a 1-D integer tensor of {n} rows; found "
                         f"{dst.dtype} {tuple(dst.shape)}")


def encode_records(rows: Tensor, fmt: RecordFormat | None, dtype: torch.dtype) -> Tensor:
    """What a pool of ``dtype`` stores for ``rows`` [N, d]: records uint8 [N, record_bytes]
    (``fmt``), or the rows cast to ``dtype`` (``fmt`` None).  New tensor."""
    _check_rows("encode_records", rows, fmt)
    return encode_rows(rows, fmt, dtype)


def write_records(pool: Tensor, dst: Tensor, rows: Tensor, src: Tensor | None,
                  fmt: RecordFormat | None, hadamard: bool = False) -> None:
    """``pool[dst[i]] = encode(rows[src[i]])`` for every i (``src`` None: ``rows[i]``), in place.

    pool [P, width] is a flat pool (uint8 records of ``fmt``, or a plain pool when ``fmt`` is
    None); dst [M] int pool rows (distinct); rows [N, d]; src [M] int rows of ``rows``.
    ``hadamard``: encode ``hadamard_transform(rows[src[i]])`` instead (d a power of two).
    """
    check_write_args(pool, dst, rows, src, fmt)
    d = rows.shape[1]
    if hadamard and (d < 1 or d & (d - 1)):
        raise ValueError(f"write_records: hadamard needs a power-of-two row width; found {d}")
    picked = rows if src is None else rows[src]
    if hadamard:
        picked = hadamard_transform(picked)
    pool.index_copy_(0, dst.long(), encode_rows(picked, fmt, pool.dtype))


def check_read_args(pool: Tensor, rows: Tensor | None, fmt: RecordFormat,
                    dtype: torch.dtype) -> None:
    """ValueError unless pool is a uint8 [P, fmt.record_bytes] record pool, rows an integer [M]
    (or None) and dtype a floating dtype."""
    if pool.dim() != 2 or pool.dtype != torch.uint8 or pool.shape[1] != fmt.record_bytes:
        raise ValueError(f"read_records: pool must be uint8 [P, {fmt.record_bytes}] ({fmt.name} "
                         f"records); found {pool.dtype} {tuple(pool.shape)}")
    if rows is not None and (rows.dim() != 1 or rows.dtype.is_floating_point
                             or rows.dtype == torch.bool):
        raise ValueError(f"read_records: rows must be an integer [M] or None; found "
                         f"{rows.dtype} {tuple(rows.shape)}")
    if not dtype.is_floating_point:
        raise ValueError(f"read_records: dtype must be floating point; found {dtype}")


def read_records(pool: Tensor, rows: Tensor | None, fmt: RecordFormat,
                 dtype: torch.dtype) -> Tensor:
    """The records ``pool[rows]`` (every row when ``rows`` is None) dequantized to ``dtype``:
    [M, fmt.dim], exact in bf16 and fp32 (:meth:`RecordFormat.unpack`).  What a prefill's
    dense copy of a record source is (dsv4.model.attention.dense_prefill_pays)."""
    check_read_args(pool, rows, fmt, dtype)
    return fmt.unpack(pool if rows is None else pool.index_select(0, rows), dtype)
