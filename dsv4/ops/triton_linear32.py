"""Triton kernel of the fp32 skinny GEMM ``linear_fp32`` (decode-sized T against an fp32 weight).

The compressors' ``wkv`` / ``wgate`` projections ([T, 4096] x [W, 4096]^T, W = 1024 / 512 / 256
at V4-Flash widths) and the MoE gate ([T, 4096] x [256, 4096]^T) are computed in fp32 as the
reference does: exact fp32 products, fp32 sums, no TF32 and no bf16.  At decode cuBLAS serves
them with 32x32 SIMT tiles over too few blocks to stream the weight at full bandwidth; this
kernel splits K so that ~2 programs per SM read the weight, and reduces the splits inside the
launch (fixed order, bit-reproducible), as the FP8 GEMM of ``triton_dense`` does.

Same signature as the twin in ``dsv4/ops/torch_dense.py``.  The kernel runs for
:data:`MIN_KERNEL_ROWS` .. :data:`MAX_KERNEL_ROWS` rows, where it measured faster than cuBLAS on
the H200 (docs/PERFORMANCE.md, fifth session: 16 rows 14–25 µs against 18–41 µs); one row
(cuBLAS's GEMV: 4.5–6.8 µs against 5.5–9.3) and 64 rows (2× faster in cuBLAS) go to the twin.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4.ops import torch_dense
from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.triton_dense import (_dot_bf16x3, mma, sm_count, split_bf16x3, splitk_reduce,
                                   splitk_workspace, torch_twin_off_gpu)

__all__ = ["linear_fp32", "linear_fp32_with_config", "Linear32Config", "pick_linear32_config",
           "pick_prefill_config", "pick_bf16w_config", "split_k_grid", "MIN_KERNEL_ROWS",
           "MAX_KERNEL_ROWS", "PREFILL_BF16X3", "PREFILL_MIN_ROWS"]

# Rows for which the kernel runs; others go to the twin (cuBLAS on the GPU).  Measured bounds:
# see the module docstring.
MIN_KERNEL_ROWS = 2
MAX_KERNEL_ROWS = 16
# Prefill (more rows) with a bf16 x: the kernel's "bf16x3" tensor-core path instead of cuBLAS's
# fp32 SIMT GEMM (x is exact in bf16 and w is split exactly into three bf16 parts, so every
# product is exact and only the tensor core's fp32 sums round).  H200, 8,192 rows (bench/kernels.py
# --only linear_fp32, docs/PERFORMANCE.md fifth session): 3.0–3.4× faster than cuBLAS fp32
# (stacked r4 wkv + wgate 895 µs against 2,807), 1.4e-5 relative to it (the tensor core's
# accumulation order; bf16's resolution is 3.9e-3).
PREFILL_BF16X3 = True
# Rows from which the bf16x3 path runs: its 128-row tiles need prefill-sized T to fill the GPU
# (at 64 decode rows it ran 94 µs per call on the H200 — one row of tiles — against cuBLAS's
# 13–25 µs; the full-size two-GPU run of the fifth session at concurrency 64 showed it).
PREFILL_MIN_ROWS = 1024
# Most K splits of one tile: the last split re-reads every partial, unrolled.
MAX_SPLITS = 32
# One-row plans for a bf16 weight from the wider sweep (H200, 2026-12-04, bench/kernels.py
# --only linear_bf16w --sweep --wide, docs/PERFORMANCE.md eighteenth session: the MoE gate 4.1
# -> 3.6 µs, the compressors' wkv + wgate 10.3 / 7.2 / 5.7 -> 9.8 / 6.5 / 4.9 alone): 16-row
# tiles, 512-wide K chunks, splits to ~256 programs.  Off until an in-step A/B
# (bench/flash_bench.py --launch-ab, "pdl, wide one-row bf16w plans"); DSV4_LINEAR32_WIDE=1.
BF16W_WIDE_ONE_ROW = os.environ.get("DSV4_LINEAR32_WIDE", "0") == "1"


@triton.jit
def _dot_split_a(acc, a, b):
    """acc += a @ b for an fp32 tile ``a`` split by ``split_bf16x3`` and a bf16 tile ``b``:
    each bf16 product is exact and only fp32 sums round."""
    a1, a2, a3 = split_bf16x3(a)
    acc += mma(a3, b, "ieee")
    acc += mma(a2, b, "ieee")
    acc += mma(a1, b, "ieee")
    return acc


@triton.jit
def linear32_tile(x_ptr, w_ptr, pid, split, M, N, K, stride_xm, stride_wn, k_per_split,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                  BF16X3: tl.constexpr, W_BF16: tl.constexpr):
    """Split ``split``'s fp32 partial of output tile ``pid`` (see :func:`_linear32_kernel`):
    (acc [BM, BN], rows, columns, row mask, column mask)."""
    num_pid_n = tl.cdiv(N, BN)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_mask = rm < M
    n_mask = rn < N
    k0 = split * k_per_split
    k1 = tl.minimum(k0 + k_per_split, K)
    if DOT:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BM, BN, BK), dtype=tl.float32)
    for k in range(k0, k1, BK):
        rk = k + tl.arange(0, BK)
        k_mask = rk < k1
        a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if not BF16X3 and not (W_BF16 and DOT):
            a = a.to(tl.float32)
        # The weight is read once per launch: stream it past L1.
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        if W_BF16 and DOT:
            # bf16-valued weights: bf16 MMAs give exact products (a bf16 x in one dot, an
            # fp32 x split exactly into three bf16 parts).
            if a.dtype == tl.bfloat16:
                acc += mma(a, tl.trans(w), "ieee")
            else:
                acc = _dot_split_a(acc, a.to(tl.float32), tl.trans(w))
        elif BF16X3:
            acc = _dot_bf16x3(acc, a, tl.trans(w))
        elif DOT:
            acc += tl.dot(a, tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc3 += a[:, None, :] * w.to(tl.float32)[None, :, :]
    if not DOT:
        acc = tl.sum(acc3, axis=2)
    return acc, rm, rn, m_mask, n_mask


@triton.jit
def _linear32_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, stride_xm, stride_wn,
                     stride_ws, k_per_split,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     SPLITS: tl.constexpr, DOT: tl.constexpr, BF16X3: tl.constexpr = False,
                     W_BF16: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[M, N] (fp32) = x[M, K] @ w[N, K]^T with fp32 products and sums.

    Grid: (M tiles × N tiles, SPLITS); split s covers K ``[s·k_per_split, (s+1)·k_per_split)``
    clipped to K (``k_per_split`` is a multiple of BK; every split has >= 1 chunk inside K).

    BF16X3 (bf16 x, dot path): x stays bf16 and each fp32 weight tile is split into three bf16
    parts summing to it exactly; three bf16 tensor-core dots then give exact products.

    W_BF16 (a bf16 weight, the checkpoint's values held compactly): the broadcast path upcasts
    the tile (exact); the dot path multiplies on bf16 MMAs — one dot for a bf16 x, three for an
    fp32 x split exactly into bf16 parts — so products stay exact with half the weight bytes.

    DOT: the tile product is ``tl.dot(..., input_precision="ieee")`` (FMA, BM >= 16); else it
    is a broadcast multiply accumulated per (row, column, k lane) in a [BM, BN, BK] register
    tile, summed over the lanes once at the end (for BM < 16, where a dot would waste most of
    its rows).

    With SPLITS > 1 the reduction happens here, deterministically (as ``_fp8_gemm_kernel``):
    each split stores its fp32 partial into ``ws[s]``, bumps the tile's arrival counter
    (acq_rel, gpu scope), and the last to arrive sums ``ws[0] + ws[1] + … + ws[SPLITS−1]`` in
    that order, stores the tile and resets the counter to 0 (for the next launch and for
    CUDA-graph replays).
    """
    grid_dependency_sync(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    acc, rm, rn, m_mask, n_mask = linear32_tile(
        x_ptr, w_ptr, pid, split, M, N, K, stride_xm, stride_wn, k_per_split, BM, BN, BK,
        DOT, BF16X3, W_BF16)
    mask = m_mask[:, None] & n_mask[None, :]
    out = out_ptr + rm[:, None] * N + rn[None, :]
    if SPLITS > 1:
        part = ws_ptr + rm[:, None] * N + rn[None, :]
        last, total = splitk_reduce(acc, part, mask, split, stride_ws, count_ptr + pid, SPLITS)
        if last:
            tl.store(out, total, mask=mask)
    else:
        tl.store(out, acc, mask=mask)


@dataclass(frozen=True)
class Linear32Config:
    """Tile plan of one ``linear_fp32`` launch: BM < 16 multiplies by broadcast, BM >= 16 by
    ``tl.dot`` (ieee, or three bf16 dots with ``bf16x3`` for a bf16 x); ``split_k`` is a
    request, clipped so every split gets >= 1 BK chunk."""

    BM: int
    BN: int
    BK: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    bf16x3: bool = False

    def __post_init__(self) -> None:
        if self.bf16x3 and self.BM < 16:
            raise ValueError(f"Linear32Config: bf16x3 needs the dot path (BM >= 16); found "
                             f"BM={self.BM}")
        for name in ("BM", "BN", "BK"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Linear32Config: {name} must be a power of two; found {v}")
        if self.BM >= 16 and self.BK < 16:
            raise ValueError(f"Linear32Config: the dot path (BM >= 16) needs BK >= 16; "
                             f"found BK={self.BK}")
        if self.BM >= 16 and self.BN < 16:
            raise ValueError(f"Linear32Config: the dot path (BM >= 16) needs BN >= 16; "
                             f"found BN={self.BN}")
        if self.split_k < 1:
            raise ValueError(f"Linear32Config: split_k must be >= 1; found {self.split_k}")


def pick_linear32_config(M: int, N: int, K: int, device: torch.device) -> Linear32Config:
    """Tile plan by shape (a first guess, not yet tuned on the H200: bench/kernels.py --sweep).

    BM covers all M rows in one tile (M <= 64).  Up to 4 rows: broadcast products, BN·BM·BK =
    4096 accumulators per program (32 per thread); from 5 rows: an fp32 dot on BM = 16/32/64.
    The weight stream is what costs, so the plan aims at ~2 programs per SM: the widest N tile
    that gets there with at most MAX_SPLITS K splits, and the fewest splits that do.
    """
    bm = triton.next_power_of_2(max(1, M))
    dot = bm > 4
    if dot:
        bm = max(16, bm)
    target = 2 * sm_count(device)
    m_tiles = triton.cdiv(M, bm)

    def bk_for(bn: int) -> int:
        return 32 if dot else max(8, min(128, 4096 // (bm * bn)))

    widths = (128, 64, 32)
    bn = widths[-1]
    for b in widths:
        if m_tiles * triton.cdiv(N, b) * min(MAX_SPLITS, triton.cdiv(K, bk_for(b))) >= target:
            bn = b
            break
    bk = bk_for(bn)
    tiles = m_tiles * triton.cdiv(N, bn)
    split = max(1, min(MAX_SPLITS, triton.cdiv(K, bk), triton.cdiv(target, tiles)))
    return Linear32Config(BM=bm, BN=bn, BK=bk, split_k=split, num_warps=4,
                          num_stages=3 if dot else 2)


def pick_prefill_config(M: int, N: int, K: int) -> Linear32Config:
    """Plan of the prefill path (bf16x3, M > MAX_KERNEL_ROWS): 128×64 output tiles, 4 warps,
    no split — the H200 sweep's best at every V4-Flash width (N 256..2048, K 4096, 8,192 rows;
    128×128 at 8 warps 5–15% slower)."""
    bn = 64 if N >= 64 else max(16, triton.next_power_of_2(N))
    return Linear32Config(BM=128 if M >= 128 else 64, BN=bn, BK=32, split_k=1, num_warps=4,
                          num_stages=3, bf16x3=True)


def split_k_grid(M: int, N: int, K: int, cfg: Linear32Config) -> tuple[int, int, int]:
    """(K per split, splits, output tiles) of a launch of ``cfg``: ``split_k`` clipped so every
    split gets >= 1 BK chunk (the last may be short).  Shared by ``moe_gate``, whose logits
    must be this kernel's."""
    chunks = triton.cdiv(K, cfg.BK)
    k_per_split = triton.cdiv(chunks, max(1, min(cfg.split_k, chunks))) * cfg.BK
    return k_per_split, triton.cdiv(K, k_per_split), triton.cdiv(M, cfg.BM) * triton.cdiv(N, cfg.BN)


def linear_fp32_with_config(x: torch.Tensor, w: torch.Tensor,
                            cfg: Linear32Config | None) -> torch.Tensor:
    """:func:`linear_fp32` through the kernel whatever M, with an explicit tile plan
    (``None``: :func:`pick_linear32_config`)."""
    torch_dense.check_linear_fp32_args(x, w)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()  # other float dtypes: the same rounding to fp32 as the twin's x.float()
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    if cfg is None:
        cfg = pick_linear32_config(M, N, K, x.device)
    k_per_split, split, tiles = split_k_grid(M, N, K, cfg)
    ws, counters = splitk_workspace(out, split, tiles, "linear_fp32")
    _linear32_kernel[(tiles, split)](
        x, w, out, ws, counters, M, N, K, x.stride(0), w.stride(0), M * N, k_per_split,
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, SPLITS=split, DOT=cfg.BM >= 16,
        BF16X3=cfg.bf16x3 and x.dtype == torch.bfloat16, W_BF16=w.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x))
    return out


def pick_bf16w_config(M: int, N: int, K: int, device: torch.device) -> Linear32Config:
    """Plan for a bf16 weight below the prefill rows, from the H200 sweep (bench/kernels.py
    --only linear_bf16w --sweep, docs/PERFORMANCE.md seventh session; the four V4-Flash widths
    N 256..2048, K 4096):

    * 1-2 rows: broadcast products on 32-row N tiles, 256-wide K chunks, split until ~2
      programs per SM (1 row: 4.6-10.0 µs against 6.8-13.8 for x.float() + cuBLAS on the
      fp32 weight);
    * 3-16 rows: the bf16 dot on 16×32 tiles, 64-wide K chunks, split until ~4 programs per SM
      (16 rows: 4.2-8.7 µs; the broadcast path took 7-22 µs at 4 rows);
    * more rows: 64×64 tiles, split until ~2 programs per SM (64 rows: 12.5-16.2 µs against
      15.8-43.1)."""
    sms = sm_count(device)
    if M == 1 and BF16W_WIDE_ONE_ROW and N >= 16 and K >= 512:
        tiles = triton.cdiv(N, 16)
        split = max(1, min(8, K // 512, 1 << max(0, (256 // tiles).bit_length() - 1)))
        return Linear32Config(BM=1, BN=16, BK=512, split_k=split, num_warps=4, num_stages=2)
    bn = 32 if N >= 32 else max(16, triton.next_power_of_2(N))
    if M <= 2:
        tiles = triton.cdiv(N, bn)
        split = max(1, min(16, triton.cdiv(K, 256), triton.cdiv(2 * sms, tiles)))
        return Linear32Config(BM=triton.next_power_of_2(M), BN=bn, BK=256, split_k=split,
                              num_warps=4, num_stages=2)
    if M <= MAX_KERNEL_ROWS:
        tiles = triton.cdiv(M, 16) * triton.cdiv(N, bn)
        split = max(1, min(16, triton.cdiv(K, 64), triton.cdiv(4 * sms, tiles)))
        return Linear32Config(BM=16, BN=bn, BK=64, split_k=split, num_warps=4, num_stages=3)
    bn = 64 if N >= 64 else max(16, triton.next_power_of_2(N))
    tiles = triton.cdiv(M, 64) * triton.cdiv(N, bn)
    split = max(1, min(MAX_SPLITS, triton.cdiv(K, 64), triton.cdiv(2 * sms, tiles)))
    return Linear32Config(BM=64, BN=bn, BK=64, split_k=split, num_warps=4, num_stages=3)


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 GEMM ``x.float() @ w.float().T``: x [T, K] any float dtype, w [N, K] float32 or
    bfloat16 (bf16 checkpoint values held compactly; the math is the same) -> [T, N] fp32.

    Exact products and fp32 sums (no TF32).  An fp32 w: :data:`MIN_KERNEL_ROWS` <= T <=
    :data:`MAX_KERNEL_ROWS`: the split-K kernel; T >= :data:`PREFILL_MIN_ROWS` with a bf16 x:
    the bf16x3 tensor-core path (exact products); other T: the twin (cuBLAS).  A bf16 w: the
    kernel at every T (half the weight bytes; its twin would widen w on every call).
    """
    torch_dense.check_linear_fp32_args(x, w)
    M = x.shape[0]
    if w.dtype == torch.bfloat16:
        if M < PREFILL_MIN_ROWS:
            return linear_fp32_with_config(x, w, pick_bf16w_config(M, w.shape[0], x.shape[1],
                                                                   x.device))
        return linear_fp32_with_config(x, w, pick_prefill_config(M, w.shape[0], x.shape[1]))
    if M >= PREFILL_MIN_ROWS and PREFILL_BF16X3 and x.dtype == torch.bfloat16:
        return linear_fp32_with_config(x, w, pick_prefill_config(M, w.shape[0], x.shape[1]))
    if not MIN_KERNEL_ROWS <= M <= MAX_KERNEL_ROWS:
        return torch_dense.linear_fp32(x, w)
    return linear_fp32_with_config(x, w, None)
