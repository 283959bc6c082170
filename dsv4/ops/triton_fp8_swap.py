"""The FP8 block GEMM for a few rows on the tensor cores with the operands swapped (decode).

At 1-16 tokens the FP8 projections stream their weights and do almost no arithmetic.  The
CUDA-core GEMV (``triton_dense._fp8_gemv_kernel``) spends ~4 instructions per weight byte on
the e4m3 -> fp32 converts and FMAs (offline sm_90 SASS, ``bench/fp8_decode_sweep.py --sass``),
and the 16-row MMA kernel (``_fp8_gemm_kernel``) puts the tokens on the MMA's M side, where a
16-row tile is too small for Hopper's wgmma.  Here the weight is the M side instead:

    out^T [BN, MT] = W [BN, K] · x^T [K, MT]      (MT = 16 token columns, BN = 64 / 128 rows)

so a tile is a wgmma of 64-128 weight rows, the weight bytes go from global memory through the
software pipeline's shared-memory stages straight into the MMA (no per-weight instruction), and
the few tokens fill the MMA's narrow N side (padding columns are zero).

Numerics: those of the QUANT_A path of ``_fp8_gemm_kernel`` — each token's K block quantized to
e4m3 with a ue8m0 scale (:func:`~dsv4.ops.triton_dense.quantize_block_rows`), one fresh dot per
K block (the tensor core's FP8 partial sums stay short), scaled by sx·sw and summed in fp32,
split-K slices reduced in the launch in a fixed order, bf16 out rounded to nearest-even.
``QUANT_X=False`` (``attn.wo_a``: the reference's bf16 GEMM of the dequantized weight) runs a
bf16 dot of the raw activation against the e4m3 codes converted in registers (exact products).
The sums run in another order than the twin's, as in every MMA path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.triton_dense import (INTERPRET, Fp8GemmConfig, e8m0_to_f32, quantize_block_rows,
                                   sm_count, splitk_reduce, splitk_workspace, store_rne)

__all__ = ["SWAP_MAX_M", "TOKENS", "fp8_swap_linear", "pick_swap_config"]

# Token columns of a tile (the MMA's N side); calls of more rows take the other kernels.
TOKENS = 16
# Up to this many rows triton_dense.pick_fp8_config plans this kernel (0: never; at most
# TOKENS).  DSV4_FP8_SWAP_MAX_M overrides it.
SWAP_MAX_M = int(os.environ.get("DSV4_FP8_SWAP_MAX_M", "0"))
# triton_dense.fp8_grouped_linear (attn.wo_a, bf16 products) takes it too (within SWAP_MAX_M).
SWAP_GROUPED = os.environ.get("DSV4_FP8_SWAP_GROUPED", "1") == "1"


@triton.jit
def _fp8_swap_kernel(x_ptr, w_ptr, sw_ptr, out_ptr, ws_ptr, count_ptr,
                     M, N, K, stride_xm, stride_wn, stride_om, stride_ws, stride_wm, n_kb,
                     k_blocks_per_split,
                     SW_E8M0: tl.constexpr, B: tl.constexpr, MT: tl.constexpr,
                     BN: tl.constexpr, SPLITS: tl.constexpr, X_GROUP: tl.constexpr = 0,
                     QUANT_X: tl.constexpr = True, PDL: tl.constexpr = False):
    """out[M, N] for M <= MT rows: tile (BN weight rows) × (MT token columns), one B-wide K
    block per step.  BN divides B, so one weight scale per step serves the tile.  Grouped
    weights (``X_GROUP`` > 0, a multiple of BN): weight rows ``[g·X_GROUP, (g+1)·X_GROUP)``
    read columns ``[g·K, (g+1)·K)`` of x.  Grid (N tiles, SPLITS); split s covers the K blocks
    ``[s·k_blocks_per_split, min((s+1)·k_blocks_per_split, n_kb))``."""
    grid_dependency_sync(PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rt = tl.arange(0, MT)
    rk = tl.arange(0, B)
    n_mask = rn < N
    t_mask = rt < M
    if X_GROUP > 0:
        x_ptr += ((pid_n * BN) // X_GROUP) * K
    sw_row = sw_ptr + ((pid_n * BN) // B) * n_kb
    acc = tl.zeros((BN, MT), dtype=tl.float32)
    kb0 = split * k_blocks_per_split
    kb1 = tl.minimum(kb0 + k_blocks_per_split, n_kb)
    for kb in range(kb0, kb1):
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + kb * B + rk[None, :],
                    mask=n_mask[:, None], other=0.0)
        x = tl.load(x_ptr + rt[:, None] * stride_xm + kb * B + rk[None, :],
                    mask=t_mask[:, None], other=0.0)
        if SW_E8M0:
            sw = e8m0_to_f32(tl.load(sw_row + kb))
        else:
            sw = tl.load(sw_row + kb)
        if QUANT_X:
            q, sx = quantize_block_rows(x.to(tl.float32))
            if INTERPRET:   # the interpreter's fp8 cast mis-rounds; q is on the e4m3 grid
                part = tl.dot(w.to(tl.float32), tl.trans(q), input_precision="ieee")
            else:
                part = tl.dot(w, tl.trans(q.to(tl.float8e4nv)))
            acc += part * (sx[None, :] * sw)
        else:
            if INTERPRET:
                part = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)),
                              input_precision="ieee")
            else:
                part = tl.dot(w.to(tl.bfloat16), tl.trans(x.to(tl.bfloat16)))
            acc += part * sw
    mask = n_mask[:, None] & t_mask[None, :]
    out = out_ptr + rt[None, :] * stride_om + rn[:, None]
    if SPLITS > 1:
        part_ptr = ws_ptr + rt[None, :] * stride_wm + rn[:, None]
        last, total = splitk_reduce(acc, part_ptr, mask, split, stride_ws, count_ptr + pid_n,
                                    SPLITS)
        if last:
            store_rne(out, total, mask)
    else:
        store_rne(out, acc, mask)


def _pow2_at_most(v: float) -> int:
    p = 1
    while p * 2 <= v:
        p *= 2
    return p


def pick_swap_config(M: int, N: int, K: int, block: int, device: torch.device
                     ) -> Fp8GemmConfig:
    """The plan (``Fp8GemmConfig`` with ``swap``; BM is the token tile): 64-row tiles, 4 warps,
    4 stages; K split (a power of two, each split >= 2 K blocks, <= 16) until there are ~4
    programs per SM."""
    bn = min(64, block)
    n_kb = K // block
    tiles = triton.cdiv(N, bn)
    split = max(1, min(16, n_kb // 2, _pow2_at_most(4 * sm_count(device) / tiles)))
    return Fp8GemmConfig(BM=TOKENS, BN=bn, split_k=split, num_warps=4, num_stages=4, swap=True)


def check_swap_plan(plan: Fp8GemmConfig, M: int, block: int) -> None:
    if not 0 < M <= TOKENS:
        raise ValueError(f"fp8_swap_linear: serves 1..{TOKENS} rows; found {M}")
    if plan.BN < 16 or plan.BN & (plan.BN - 1) or block % plan.BN:
        raise ValueError(f"fp8_swap_linear: BN must be a power of two >= 16 dividing the block "
                         f"{block}; found {plan.BN}")
    if plan.split_k < 1 or plan.num_warps < 1 or plan.num_stages < 1:
        raise ValueError(f"fp8_swap_linear: split, warps and stages must be >= 1; found {plan}")


def fp8_swap_linear(x2: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, sw_e8m0: bool,
                    block: int, out_dtype: torch.dtype, plan: Fp8GemmConfig | None = None,
                    groups: int = 0, quant_x: bool = True) -> torch.Tensor:
    """out [M, N] for x2 [M <= 16, K] (contiguous rows), w8 [N, K] e4m3 and its block scales
    ``sw`` as ``triton_dense._scale_operand`` gives them (e8m0 bytes when ``sw_e8m0``, else
    fp32).  ``groups`` > 0: x2 is [M, groups·K'] and weight rows of group g read its g-th K'
    columns; ``quant_x`` False: x is used unquantized (bf16 products).  CUDA or the interpreter
    (the caller checks the arguments: ``triton_dense.fp8_linear_with_config``)."""
    M, K = x2.shape
    N = w8.shape[0]
    if plan is None:
        plan = pick_swap_config(M, N, K // max(groups, 1), block, x2.device)
    x_group = N // groups if groups else 0
    if groups:
        K //= groups
        if x_group % plan.BN:
            raise ValueError(f"fp8_swap_linear: BN {plan.BN} must divide the rows per group "
                             f"{x_group}")
    check_swap_plan(plan, M, block)
    n_kb = K // block
    split = max(1, min(plan.split_k, n_kb))
    kbps = triton.cdiv(n_kb, split)
    split = triton.cdiv(n_kb, kbps)  # every split gets >= 1 K block (the last may get fewer)
    tiles = triton.cdiv(N, plan.BN)
    out = torch.empty(M, N, dtype=out_dtype, device=x2.device)
    ws, counters = splitk_workspace(out, split, tiles, "fp8_linear")
    _fp8_swap_kernel[(tiles, split)](
        x2, w8, sw, out, ws, counters, M, N, K, x2.stride(0), w8.stride(0), out.stride(0),
        ws.stride(0) if split > 1 else 0, ws.stride(-2), n_kb, kbps,
        SW_E8M0=sw_e8m0, B=block, MT=TOKENS, BN=plan.BN, SPLITS=split, X_GROUP=x_group,
        QUANT_X=quant_x, num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_args(x2))
    return out
