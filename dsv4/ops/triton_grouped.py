"""Grouped GEMM of the attention output (``attn.wo_a``) on an FP8 block-quantized weight that
stays FP8 on the GPU, dequantized tile by tile in registers (spec §2.4 item 1, §3 step 7).

Same signature as the torch twin ``dsv4.ops.torch_grouped.grouped_dequant_linear``:
``out[t, g] = x[t, g] @ W[g]^T`` with x [T, G, K] bf16, W = the bf16 dequantization of
w8 [G·N, K] e4m3 × its block scales (e8m0 or fp32), fp32 sums, bf16 out.

Numerics: the kernel multiplies the bf16 activations by exactly the bf16 weight values of the
loader's ``dequant_fp8_block`` on bf16 MMAs with fp32 accumulation; only the summation order
differs from the twin's bmm.

* fp32 scales: each weight element is ``bf16(fp32(e4m3 · s))`` (the fp32 product rounded to
  nearest-even, as the loader's fp32 multiply then ``.to(bfloat16)``), made in registers before
  the dot.
* e8m0 scales: ``e4m3 · 2^e`` is exact in bf16, and a power of two commutes with every fp32
  rounding of the dot, so with ``SCALE_AFTER`` (K step = block) the dot runs on the raw e4m3
  values (converted to bf16, exact) and its fp32 result is multiplied by the scale of each
  output column: the same products summed the same way, a BM×BN multiply per step instead of a
  BN×BK one.  Without ``SCALE_AFTER`` (K steps spanning several scale blocks, V4.1's block 32)
  the scale is applied in registers like the fp32 one (exact, no rounding needed).

Plans (:func:`pick_grouped_plan`, by the token count T): decode sizes split K so that a few
programs per SM stream the weight (V4-Flash: G·N/BN = 64 tiles of 128 columns for 132 SMs),
with the deterministic in-kernel reduction of ``triton_dense.splitk_reduce``; from
:data:`DEQUANT_MIN_T` tokens the weight is dequantized to a bf16 temporary and the GEMM runs in
cuBLAS (the twin's math, bit for bit), where a compute-bound GEMM is faster than the kernel's
in-register decode.  The GPU timings are not measured yet (``bench/grouped_bench.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4.ops.torch_grouped import check_grouped_args
from dsv4.ops.triton_dense import (
    INTERPRET,
    _pow2_at_least,
    _pow2_at_most,
    e8m0_to_f32,
    mma,
    round_to_bf16,
    sm_count,
    splitk_reduce,
    splitk_workspace,
    store_rne,
    torch_twin_off_gpu,
)

__all__ = ["grouped_dequant_linear", "grouped_dequant_linear_with_plan", "GroupedPlan",
           "pick_grouped_plan", "DEQUANT_MIN_T", "DECODE_MAX_T"]

# From this many tokens: dequantize the weight to a bf16 temporary and run the torch bmm
# (cuBLAS).  A guess, to be measured on the H200 with bench/grouped_bench.py: at V4-Flash's
# wo_a the GEMM is 67 MFLOP per token (compute-bound from a few hundred tokens), the temporary
# costs ~100 MB of traffic (~25-80 µs), and cuBLAS beats an in-register-dequant kernel by more
# than that at a few thousand tokens.
DEQUANT_MIN_T = 4096
# Up to this many tokens the decode plans (K split to fill the SMs); beyond, unsplit big tiles.
DECODE_MAX_T = 512


@dataclass(frozen=True)
class GroupedPlan:
    """Tile plan of one grouped launch: BM tokens × BN weight rows of one group per program,
    K in steps of BK, ``split_k`` programs per output tile; ``scale_after``: e8m0 scales
    applied to each step's dot result (needs BK == block)."""

    BM: int
    BN: int
    BK: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    scale_after: bool = True


@triton.jit
def _grouped_dequant_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, count_ptr,
                            T, N, K, stride_xt, stride_xg, stride_ot, stride_ws, stride_wt,
                            n_sk, k_steps_per_split, num_n, num_m,
                            SW_E8M0: tl.constexpr, SCALE_AFTER: tl.constexpr, B: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            SPLITS: tl.constexpr):
    """out[t, g·N + n] = Σ_k x[t, g, k] · bf16(W8[g·N + n, k] · s[(g·N + n)/B, k/B]).

    Grid (num_m · num_n · G, SPLITS): program pid is token tile ``pid % num_m`` (fastest, so
    programs sharing a weight tile run together), column tile ``(pid / num_m) % num_n`` of group
    ``pid / (num_m · num_n)``; split s sums K steps ``[s·k_steps_per_split, …)`` and the last
    split of a tile to arrive sums the fp32 partials in split order (``splitk_reduce``).
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = pid % num_m
    rest = pid // num_m
    pid_n = rest % num_n
    g = rest // num_n

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_mask = rm < T
    n_mask = rn < N
    wrow = (g * N + rn).to(tl.int64)          # weight rows of this group's columns
    w_rows = w_ptr + wrow[:, None] * K
    s_row = s_ptr + (wrow // B) * n_sk
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xt + g * stride_xg

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    n_steps = K // BK
    k0 = split * k_steps_per_split
    k1 = tl.minimum(k0 + k_steps_per_split, n_steps)
    for step in range(k0, k1):
        ks = step * BK + rk
        x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None], other=0.0)
        w8 = tl.load(w_rows + ks[None, :], mask=n_mask[:, None], other=0.0)
        if SCALE_AFTER:
            # e8m0, BK == B: one power-of-two scale per column and step, applied to the exact
            # fp32 dot of the raw e4m3 values (the products and their sums scale exactly).
            sw = e8m0_to_f32(tl.load(s_row + step, mask=n_mask, other=127))
            acc += mma(x, tl.trans(w8.to(tl.bfloat16)), "ieee") * sw[None, :]
        else:
            if BK == B:
                sb = tl.load(s_row + step, mask=n_mask, other=0)[:, None]
            else:
                # Several scale blocks per step (block 32): one scale per element (L1 hits).
                sb = tl.load(s_row[:, None] + ks[None, :] // B, mask=n_mask[:, None], other=0)
            if SW_E8M0:
                wf = w8.to(tl.float32) * e8m0_to_f32(sb)      # exact: a power of two
            else:
                wf = w8.to(tl.float32) * sb                   # rounded to fp32, as the loader
                if INTERPRET:
                    # The interpreter's fp32 -> bf16 cast truncates; the GPU's rounds to
                    # nearest-even like torch's: round by hand here.
                    wf = round_to_bf16(wf)
            acc += mma(x, tl.trans(wf.to(tl.bfloat16)), "ieee")
    mask = m_mask[:, None] & n_mask[None, :]
    cols = g * N + rn
    out = out_ptr + rm[:, None].to(tl.int64) * stride_ot + cols[None, :]
    if SPLITS > 1:
        part = ws_ptr + rm[:, None].to(tl.int64) * stride_wt + cols[None, :]
        last, total = splitk_reduce(acc, part, mask, split, stride_ws, count_ptr + pid, SPLITS)
        if last:
            store_rne(out, total, mask)
    else:
        store_rne(out, acc, mask)


def _pick_bk(block: int, K: int) -> int:
    """K step: the scale block when it is wide enough for full-width loads, else 128 (or 64)
    columns spanning several blocks; always a divisor of K."""
    if block >= 64:
        return block
    for bk in (128, 64):
        if K % bk == 0:
            return bk
    return block


def pick_grouped_plan(T: int, G: int, N: int, K: int, block: int, scale_e8m0: bool,
                      device: torch.device) -> GroupedPlan | None:
    """The tile plan for ``T`` tokens, or None for the dequantize + bmm path (T >=
    :data:`DEQUANT_MIN_T`).  Not yet tuned on the GPU (``bench/grouped_bench.py``):

    * T <= 64 (decode): BM = 16/32/64 rows (one token tile), 128-wide column tiles, 8 warps,
      the K split reaching ~2 programs per SM with >= 2 K steps per split (V4-Flash: 64 tiles
      × 8 splits of 4 steps of 128);
    * 64 < T <= :data:`DECODE_MAX_T`: 64×128 tiles, split while fewer than ~2 programs per SM
      and each split keeps >= 8 steps;
    * larger T: 128×128 tiles, 8 warps, no split.
    """
    if T >= DEQUANT_MIN_T:
        return None
    bk = _pick_bk(block, K)
    steps = K // bk
    after = scale_e8m0 and bk == block
    sms = sm_count(device)
    if T <= 64:
        bm = max(16, triton.next_power_of_2(T))
        tiles = G * triton.cdiv(N, 128)
        split = min(max(1, min(8, steps // 2)), _pow2_at_least(2 * sms / tiles))
        return GroupedPlan(BM=bm, BN=128, BK=bk, split_k=split, num_warps=8, num_stages=3,
                           scale_after=after)
    if T <= DECODE_MAX_T:
        tiles = triton.cdiv(T, 64) * G * triton.cdiv(N, 128)
        split = max(1, min(_pow2_at_most(2 * sms / tiles), steps // 8))
        return GroupedPlan(BM=64, BN=128, BK=bk, split_k=split, num_warps=8, num_stages=3,
                           scale_after=after)
    return GroupedPlan(BM=128, BN=128, BK=bk, split_k=1, num_warps=8, num_stages=3,
                       scale_after=after)


def dequant_weight(w8: torch.Tensor, w_scale: torch.Tensor, block: int) -> torch.Tensor:
    """The bf16 weight [rows, K] of the loader's ``dequant_fp8_block`` (same fp32 products,
    same rounding), by broadcasting the scales instead of repeating them when the rows are
    whole blocks (the prefill path's temporary)."""
    from dsv4.formats import dequant_fp8_block, e8m0_to_float
    rows, K = w8.shape
    if rows % block:
        return dequant_fp8_block(w8, w_scale, block, torch.bfloat16)
    s = w_scale if w_scale.dtype == torch.float32 else e8m0_to_float(w_scale)
    w = w8.view(rows // block, block, K // block, block).to(torch.float32)
    return (w * s[:, None, :, None]).to(torch.bfloat16).view(rows, K)


def grouped_dequant_linear_with_plan(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                                     block: int, groups: int, plan: GroupedPlan | str | None
                                     ) -> torch.Tensor:
    """:func:`grouped_dequant_linear` with an explicit plan: a :class:`GroupedPlan`, "dequant"
    (bf16 temporary + torch bmm) or None (:func:`pick_grouped_plan`)."""
    T, G, N, K = check_grouped_args(x, w8, w_scale, block, groups)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"grouped_dequant_linear: the Triton kernel takes bf16 x; found "
                         f"{x.dtype}")
    e8m0 = w_scale.dtype != torch.float32
    if plan is None:
        plan = pick_grouped_plan(T, G, N, K, block, e8m0, x.device)
        if plan is None:
            plan = "dequant"
    if plan == "dequant":
        w = dequant_weight(w8, w_scale, block).view(G, N, K)
        return torch.einsum("tgd,grd->tgr", x, w)
    assert isinstance(plan, GroupedPlan)
    if K % plan.BK or plan.BK % block and block % plan.BK:
        raise ValueError(f"grouped_dequant_linear: K step {plan.BK} does not fit K={K} and "
                         f"block {block}")
    if plan.scale_after and not (e8m0 and plan.BK == block):
        raise ValueError("grouped_dequant_linear: scale_after needs e8m0 scales and BK == block")
    out = torch.empty(T, G, N, dtype=torch.bfloat16, device=x.device)
    if T == 0 or N == 0:
        return out
    if x.stride(2) != 1:
        x = x.contiguous()
    w8 = w8 if w8.is_contiguous() else w8.contiguous()
    sw = w_scale.contiguous()
    if e8m0:
        sw = sw.view(torch.uint8)
    steps = K // plan.BK
    split = max(1, min(plan.split_k, steps))
    per = triton.cdiv(steps, split)
    split = triton.cdiv(steps, per)          # every split gets >= 1 step
    num_m, num_n = triton.cdiv(T, plan.BM), triton.cdiv(N, plan.BN)
    tiles = num_m * num_n * G
    out2 = out.view(T, G * N)
    ws, counters = splitk_workspace(out2, split, tiles, "grouped_dequant_linear")
    _grouped_dequant_kernel[(tiles, split)](
        x, w8, sw, out2, ws, counters, T, N, K, x.stride(0), x.stride(1), out2.stride(0),
        ws.stride(0) if split > 1 else 0, ws.stride(-2), sw.shape[1], per, num_n, num_m,
        SW_E8M0=e8m0, SCALE_AFTER=plan.scale_after, B=block, BM=plan.BM, BN=plan.BN,
        BK=plan.BK, SPLITS=split, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return out


@torch_twin_off_gpu("dsv4.ops.torch_grouped")
def grouped_dequant_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int,
                           groups: int) -> torch.Tensor:
    """Grouped GEMM on an FP8 block weight kept FP8: ``out[t, g] = x[t, g] @ W[g]^T``.

    x [T, G, K] bf16; w8 [G·N, K] float8_e4m3fn (group g = rows g·N .. (g+1)·N−1); w_scale
    [ceil(G·N/block), K/block] float8_e8m0fnu or float32; ``groups`` = G.  W is dequantized in
    registers to the bf16 values of ``dequant_fp8_block``; fp32 sums; returns [T, G, N] bf16.
    A non-bf16 x runs the torch twin (the kernel is bf16 only).
    """
    if x.dtype != torch.bfloat16:
        from dsv4.ops import torch_grouped
        return torch_grouped.grouped_dequant_linear(x, w8, w_scale, block, groups)
    return grouped_dequant_linear_with_plan(x, w8, w_scale, block, groups, None)
