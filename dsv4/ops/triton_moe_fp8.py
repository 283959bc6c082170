"""Routed experts (spec §3.9) on FP8 tensor cores: MXFP4 stacks under official numerics, for
prefill (dsv4 issue #5).  Off by default: nothing calls it but the tests and the bench.

Why it is exact.  With ``ExpertWeights.act_block`` set, the torch twin
(``dsv4.ops.torch_dense.moe_experts``) FP8-fake-quantizes the expert inputs per act block with
power-of-two (ue8m0) scales, so every activation value is e4m3 × 2^s(row, block); every MXFP4
weight is e2m1 × 2^s(column, 32-block), and the e2m1 values (0, ±0.5 .. ±6) are e4m3 values too.
An FP8 MMA of the codes over one 32-wide K group, scaled afterwards by the row's and the
column's power of two, gives the products of the bf16 path exactly; the groups are summed in
fp32 (another order than the bf16 kernel of ``triton_moe``, so equal to fp32 rounding).  A
fresh dot per 32-wide group also keeps Hopper's reduced-precision FP8 accumulation short.

Steps (the routing plan, the SwiGLU epilogue and the combine are those of ``triton_moe``):

1. ``moe_plan``: the (token, pick) pairs sorted by expert into row blocks of BM;
2. ``_fp8_prep_kernel`` (GATHER): each pair's token row quantized per act block into e4m3
   codes in the plan's sorted rows, and its fp32 scales [rows, K / block];
3. ``_fp8mma_up_kernel``: gate and up GEMMs per (block, N tile), K in steps of 32: the packed
   weight bytes decoded to e4m3 bytes in registers, ``tl.dot`` of the e4m3 tiles, scaled into
   the fp32 accumulator; then the clamped SwiGLU × routing weight, stored bf16
   (``triton_moe._up_epilogue``);
4. ``_fp8_prep_kernel`` again on that activation (the twin fake-quantizes it before w2);
5. ``_fp8mma_down_kernel``: the w2 GEMM the same way, one bf16 output row per pair;
6. ``triton_moe._moe_combine_kernel``: per token the fp32 sum of its picks.

The weight decode on the GPU (:data:`FP8MMA_DECODE` "asm") turns 4 packed bytes into 8 e4m3
bytes with two ``prmt`` table lookups (magnitude, sign); it leaves the codes of each 8 columns
in an order of its own (:func:`mma_k_position`), so the activation codes are stored in that
order too (a dot does not depend on the order of K, only on both operands sharing it).  The
interpreter takes integer operations (:func:`_e2m1_to_e4m3_bits`) and a permute to the same order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4.ops.torch_dense import ExpertWeights
from dsv4.ops.triton_dense import INTERPRET, _INTERPRET_HOST, quantize_block_rows, store_rne
from dsv4.ops.triton_moe import (
    _check_experts,
    _moe_combine_kernel,
    _up_epilogue,
    _weight_args,
    block_pairs,
    moe_plan,
)

_E8M0 = getattr(torch, "float8_e8m0fnu", None)

__all__ = ["MoeFp8Config", "moe_experts_fp8mma", "pick_fp8mma_config"]

# The MXFP4 scale group and the K step of the FP8 MMAs (host int and kernel constexpr).
GROUP_SIZE = 32
GROUP = tl.constexpr(GROUP_SIZE)


# ------------------------------------------------------------------------------ jit helpers
@triton.jit
def _e2m1_to_e4m3_bits(nib):
    """e2m1 codes (int32 0..15, bit 3 the sign) -> the e4m3fn bytes of the same values (int32).

    Magnitude m: 0 -> 0x00, 1 (0.5) -> 0x30 (2^-1), m >= 2 -> exponent (m >> 1) + 6 (bias 7)
    and mantissa bit (m & 1) as e4m3's top mantissa bit (1.5 = 0x3C, 6 = 0x4C); sign to bit 7."""
    m = nib & 7
    big = (((m >> 1) + 6) << 3) | ((m & 1) << 2)
    mag = tl.where(m >= 2, big, tl.where(m == 1, 0x30, 0))
    return mag | ((nib & 8) << 4)


@triton.jit
def mma_k_position(k):
    """Column of natural K index k in the operand order of the MMAs (a permutation within each
    8 columns, the same for both operands, so the dot is unchanged): the byte order in which
    :data:`_E2M1_TO_E4M3_ASM` leaves 4 packed weight bytes (8 codes) joined with their
    neighbours, natural k = 8g + 4h + r -> 8g + 2r + h (r < 4, h < 2)."""
    return (k & -8) | ((k & 3) << 1) | ((k >> 2) & 1)


# Four packed MXFP4 bytes ($2: 8 e2m1 codes, natural k order in its nibbles) -> their e4m3
# bytes, codes k 0..3 in $0 and k 4..7 in $1.  prmt looks each code's magnitude (nibble & 7)
# up in the 8-byte table {0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C} (e4m3 of 0, 0.5, 1,
# 1.5, 2, 3, 4, 6); a second prmt picks 0x00 or 0x80 by the sign bit (nibble bit 3).
_E2M1_TO_E4M3_ASM = tl.constexpr("""{
.reg .b32 lo, hi, sg, z, sel, s, m;
mov.b32 lo, 0x3C383000;
mov.b32 hi, 0x4C484440;
mov.b32 sg, 0x00008000;
mov.b32 z, 0;
and.b32 sel, $2, 0x7777;
prmt.b32 m, lo, hi, sel;
shr.b32 s, $2, 3; and.b32 s, s, 0x1111;
prmt.b32 s, sg, z, s;
or.b32 $0, m, s;
shr.b32 sel, $2, 16; and.b32 sel, sel, 0x7777;
prmt.b32 m, lo, hi, sel;
shr.b32 s, $2, 19; and.b32 s, s, 0x1111;
prmt.b32 s, sg, z, s;
or.b32 $1, m, s;
}""")


@triton.jit
def _mxfp4_e4m3_tile(w_ptr, s_ptr, e, rn, n_mask, k0, stride_we, stride_wn, stride_se,
                     stride_sn, ASM_DECODE: tl.constexpr, BN: tl.constexpr):
    """One 32-wide K group of expert e's MXFP4 rows rn: (e4m3 codes [BN, 32] in the MMA K order
    of :func:`mma_k_position`, the rows' fp32 group scales [BN]).  ASM_DECODE: the inline-PTX
    byte lookup (GPU only); else integer ALU operations (the interpreter), the same bytes."""
    # 64-bit expert offsets: E × N × K/2 passes 2^31 bytes for V4-Pro stacks.
    e = e.to(tl.int64)
    rj = tl.arange(0, GROUP // 2)
    byte = tl.load(w_ptr + e * stride_we + rn[:, None] * stride_wn + (k0 // 2 + rj)[None, :],
                   mask=n_mask[:, None], other=0)
    if ASM_DECODE and not INTERPRET:
        # out_h[4g + r] holds natural k = 8g + 4h + r: joined, position 2(4g + r) + h.
        first, second = tl.inline_asm_elementwise(
            _E2M1_TO_E4M3_ASM, "=r,=r,r", [byte], dtype=(tl.uint8, tl.uint8), is_pure=True,
            pack=4)
        codes = tl.reshape(tl.join(first, second), (BN, GROUP))
    else:
        b = byte.to(tl.int32)
        lo = _e2m1_to_e4m3_bits(b & 15)          # k = 2j
        hi = _e2m1_to_e4m3_bits((b >> 4) & 15)   # k = 2j + 1
        natural = tl.reshape(tl.join(lo, hi), (BN, GROUP // 8, 2, 4))   # [n, g, h, r]
        codes = tl.reshape(tl.permute(natural, (0, 1, 3, 2)), (BN, GROUP)).to(tl.uint8)
    w8 = codes.to(tl.float8e4nv, bitcast=True)
    # e8m0 byte b -> 2^(b - 127) built from the fp32 exponent bits.
    sb = tl.load(s_ptr + e * stride_se + rn * stride_sn + k0 // GROUP, mask=n_mask, other=127)
    sw = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return w8, sw


@triton.jit
def _act_group(a_ptr, sa_ptr, rm, m_mask, k0, stride_am, stride_sam, AB: tl.constexpr):
    """Rows rm of a prepped activation at the 32-wide K group k0: (e4m3 codes [BM, 32] in the
    MMA K order, the rows' fp32 scales of the act block holding the group [BM]).  Padding rows
    read 0."""
    rows = rm.to(tl.int64)
    a8 = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + tl.arange(0, GROUP))[None, :],
                 mask=m_mask[:, None], other=0.0)
    sa = tl.load(sa_ptr + rows * stride_sam + k0 // AB, mask=m_mask, other=0.0)
    return a8, sa


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _fp8_prep_kernel(src_ptr, pair_ptr, bexp_ptr, q_ptr, s_ptr, P, E, TOPK, stride_src,
                     stride_q, stride_s, GATHER: tl.constexpr, BM: tl.constexpr,
                     AB: tl.constexpr):
    """One row block and act block: q[row] = the e4m3 codes of the source row (GATHER: the
    pair's token row; else the row itself) in the MMA K order, s[row] its fp32 scale, quantized
    as the twin's fake quant (amax floor 1e-4, ue8m0 scale, e4m3 round-to-nearest-even).
    Padding rows and unused blocks are left unwritten (the GEMMs mask them)."""
    blk = tl.program_id(0)
    kb = tl.program_id(1)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        rm, pair, m_mask = block_pairs(pair_ptr, blk, P, BM)
        if GATHER:
            src_rows = (pair // TOPK).to(tl.int64)
        else:
            src_rows = rm.to(tl.int64)
        rk = kb * AB + tl.arange(0, AB)
        v = tl.load(src_ptr + src_rows[:, None] * stride_src + rk[None, :],
                    mask=m_mask[:, None], other=0.0).to(tl.float32)
        q, s = quantize_block_rows(v)
        rows = rm.to(tl.int64)
        # q is on the e4m3 grid already: the cast is exact.  Stored in the MMA K order.
        tl.store(q_ptr + rows[:, None] * stride_q + mma_k_position(rk)[None, :],
                 q.to(tl.float8e4nv), mask=m_mask[:, None])
        tl.store(s_ptr + rows * stride_s + kb, s, mask=m_mask)


@triton.jit
def _fp8mma_up_kernel(xq_ptr, xs_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, pair_ptr, bexp_ptr,
                      wt_ptr, act_ptr, P, N, K, E, stride_xm, stride_xsm, stride_actm,
                      stride_we, stride_wn, stride_se, stride_sn, limit,
                      HAS_LIMIT: tl.constexpr, ASM_DECODE: tl.constexpr, AB: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr):
    """act[row] = w · swiglu(w1 x, w3 x) (bf16) for the pairs of one row block and N tile;
    x given as e4m3 codes ``xq`` with fp32 scales ``xs`` per act block (``_fp8_prep_kernel``)."""
    blk = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        rm, pair, m_mask = block_pairs(pair_ptr, blk, P, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
        acc1 = tl.zeros((BM, BN), dtype=tl.float32)
        acc3 = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, GROUP):
            # A fresh dot per group (exact products, short tensor-core sums), its row and column
            # powers of two applied in fp32: part·sa is exact, the fma rounds once, as an add.
            a8, sa = _act_group(xq_ptr, xs_ptr, rm, m_mask, k0, stride_xm, stride_xsm, AB)
            g8, sg = _mxfp4_e4m3_tile(w1_ptr, s1_ptr, e, rn, n_mask, k0, stride_we, stride_wn,
                                      stride_se, stride_sn, ASM_DECODE, BN)
            acc1 = tl.fma(tl.dot(a8, tl.trans(g8)) * sa[:, None], sg[None, :], acc1)
            u8, su = _mxfp4_e4m3_tile(w3_ptr, s3_ptr, e, rn, n_mask, k0, stride_we, stride_wn,
                                      stride_se, stride_sn, ASM_DECODE, BN)
            acc3 = tl.fma(tl.dot(a8, tl.trans(u8)) * sa[:, None], su[None, :], acc3)
        _up_epilogue(acc1, acc3, act_ptr, wt_ptr, rm, pair, m_mask, rn, n_mask, stride_actm,
                     limit, tl.bfloat16, HAS_LIMIT)


@triton.jit
def _fp8mma_down_kernel(aq_ptr, as_ptr, w2_ptr, s2_ptr, pair_ptr, bexp_ptr, y_ptr, P, N, K, E,
                        stride_am, stride_asm, stride_ym, stride_we, stride_wn, stride_se,
                        stride_sn, ASM_DECODE: tl.constexpr, AB: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr):
    """y[pair] = w2 · act[row] (bf16) for the pairs of one row block and N tile; act given as
    e4m3 codes ``aq`` with fp32 scales ``as`` per act block."""
    blk = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        rm, pair, m_mask = block_pairs(pair_ptr, blk, P, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, GROUP):
            a8, sa = _act_group(aq_ptr, as_ptr, rm, m_mask, k0, stride_am, stride_asm, AB)
            w8, sw = _mxfp4_e4m3_tile(w2_ptr, s2_ptr, e, rn, n_mask, k0, stride_we, stride_wn,
                                      stride_se, stride_sn, ASM_DECODE, BN)
            acc = tl.fma(tl.dot(a8, tl.trans(w8)) * sa[:, None], sw[None, :], acc)
        y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        store_rne(y_ptrs, acc, m_mask[:, None] & n_mask[None, :])


# ------------------------------------------------------------------------------ host side
# How the GEMM kernels decode the MXFP4 codes to e4m3 bytes on the GPU: "asm" (two prmt byte
# lookups per 4 packed bytes, inline PTX) or "alu" (the integer operations the interpreter runs).
# Both give the same bytes in the same order.  DSV4_FP8MMA_DECODE=alu picks the other one.
FP8MMA_DECODE = os.environ.get("DSV4_FP8MMA_DECODE", "asm")
if FP8MMA_DECODE not in ("asm", "alu"):
    raise ValueError(f"DSV4_FP8MMA_DECODE={FP8MMA_DECODE!r}: expected 'asm' or 'alu'")


@dataclass(frozen=True)
class MoeFp8Config:
    """Tile plan of one FP8-MMA expert call: BM rows per block (each block one expert), the N
    tiles and warps of the up (gate + up) and down GEMMs, pipeline stages."""

    BM: int = 64
    BN_up: int = 128
    BN_down: int = 128
    warps_up: int = 8
    warps_down: int = 4
    stages: int = 3

    def __post_init__(self) -> None:
        for name in ("BM", "BN_up", "BN_down"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"MoeFp8Config: {name} must be a power of two >= 16; "
                                 f"found {v!r}")
        for name in ("warps_up", "warps_down"):
            if getattr(self, name) not in (4, 8):
                raise ValueError(f"MoeFp8Config: {name} must be 4 or 8; found "
                                 f"{getattr(self, name)!r}")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"MoeFp8Config: stages must be an int >= 1; found {self.stages!r}")


def pick_fp8mma_config(num_pairs: int, num_experts: int) -> MoeFp8Config:
    """Tile plan by the average rows per active expert: 64-row blocks below 128 rows (2K-token
    prefill of V4-Flash: ~48), 128-row blocks from 128 (8K: ~190).

    Chosen offline from the sm_90 compile (ptxas register counts; not yet timed on the GPU):
    the up kernel holds two fp32 accumulators plus the two fresh dot results, so it takes 8
    warps and at most 64×128 / 128×64 tiles (255 registers and ~1 KB of spills per thread at
    128×128; none at these), the down kernel 64×128 with 4 warps / 128×128 with 8."""
    active = max(1, min(num_experts, num_pairs))
    if num_pairs / active < 128:
        return MoeFp8Config(BM=64, BN_up=128, BN_down=128, warps_up=8, warps_down=4)
    return MoeFp8Config(BM=128, BN_up=64, BN_down=128, warps_up=8, warps_down=8)


def _check_fp8mma(x: torch.Tensor, experts: ExpertWeights) -> int:
    """The act block, after checking that this path applies (MXFP4, official numerics, bf16)."""
    if experts.fmt != "fp4":
        raise ValueError(f"moe_experts_fp8mma: needs MXFP4 expert stacks (fmt 'fp4'); found "
                         f"fmt {experts.fmt!r}")
    ab = experts.act_block
    if not ab:
        raise ValueError("moe_experts_fp8mma: needs official numerics (ExpertWeights.act_block "
                         f"set, FP8 expert inputs); found act_block={ab!r}")
    scales = {n: getattr(experts, n).dtype for n in ("s1", "s3", "s2")}
    if any(dt not in (_E8M0, torch.uint8) for dt in scales.values()):
        raise ValueError(f"moe_experts_fp8mma: needs e8m0 (or uint8) MXFP4 scales; found "
                         f"{scales}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"moe_experts_fp8mma: needs bf16 compute (x bf16); found {x.dtype}")
    if x.dim() == 2:
        D, inter = x.shape[1], experts.inter_dim
        if ab % GROUP_SIZE or D % ab or inter % ab:
            raise ValueError(f"moe_experts_fp8mma: needs act_block a multiple of {GROUP_SIZE} "
                             f"dividing D and I; found act_block={ab}, D={D}, I={inter}")
    return ab


def moe_experts_fp8mma(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       experts: ExpertWeights, swiglu_limit: float,
                       cfg: MoeFp8Config | None = None) -> torch.Tensor:
    """Weighted sum of the routed experts picked per token (spec §3.9), fp32 [T, D], with the
    GEMMs on FP8 tensor cores: the contract of ``triton_moe.moe_experts`` restricted to MXFP4
    stacks under official numerics (``act_block`` set) and bf16 compute (ValueError otherwise).

    x [T, D] bf16; topk_ids [T, k] (ids outside 0..E-1 are skipped); topk_weights [T, k];
    ``cfg``: the tile plan (None: :func:`pick_fp8mma_config`).  Off CUDA without the Triton
    interpreter it runs the torch twin.
    """
    ab = _check_fp8mma(x, experts)
    _check_experts(x, topk_ids, topk_weights, experts)
    if x.device.type != "cuda" and not _INTERPRET_HOST:
        from dsv4.ops import torch_dense
        return torch_dense.moe_experts(x, topk_ids, topk_weights, experts, swiglu_limit)
    T, D = x.shape
    E, inter, k = experts.num_experts, experts.inter_dim, topk_ids.shape[1]
    out = torch.empty(T, D, dtype=torch.float32, device=x.device)
    if T == 0 or k == 0:
        return out.zero_()
    P = T * k
    if cfg is None:
        cfg = pick_fp8mma_config(P, E)
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.contiguous()
    wts = topk_weights.reshape(-1).float().contiguous()
    pairs, block_expert = moe_plan(ids, E, cfg.BM)
    nb = block_expert.shape[0]
    rows = nb * cfg.BM
    w1, s1, _ = _weight_args(experts, "w1")
    w3, s3, _ = _weight_args(experts, "w3")
    w2, s2, _ = _weight_args(experts, "w2")
    if w1.stride() != w3.stride() or s1.stride() != s3.stride():
        raise ValueError("moe_experts_fp8mma: w1/w3 (and s1/s3) must share their strides; "
                         f"found {w1.stride()} / {w3.stride()}, {s1.stride()} / {s3.stride()}")
    e4m3 = torch.float8_e4m3fn
    asm = FP8MMA_DECODE == "asm"

    xq = torch.empty(rows, D, dtype=e4m3, device=x.device)
    xs = torch.empty(rows, D // ab, dtype=torch.float32, device=x.device)
    _fp8_prep_kernel[(nb, D // ab)](x, pairs, block_expert, xq, xs, P, E, k, x.stride(0),
                                    xq.stride(0), xs.stride(0), GATHER=True, BM=cfg.BM, AB=ab,
                                    num_warps=4)
    act = torch.empty(rows, inter, dtype=torch.bfloat16, device=x.device)
    _fp8mma_up_kernel[(nb, triton.cdiv(inter, cfg.BN_up))](
        xq, xs, w1, w3, s1, s3, pairs, block_expert, wts, act, P, inter, D, E, xq.stride(0),
        xs.stride(0), act.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
        float(swiglu_limit), HAS_LIMIT=swiglu_limit > 0,
        ASM_DECODE=asm, AB=ab, BM=cfg.BM, BN=cfg.BN_up,
        num_warps=cfg.warps_up, num_stages=cfg.stages)
    del xq, xs
    aq = torch.empty(rows, inter, dtype=e4m3, device=x.device)
    as_ = torch.empty(rows, inter // ab, dtype=torch.float32, device=x.device)
    _fp8_prep_kernel[(nb, inter // ab)](act, pairs, block_expert, aq, as_, P, E, k,
                                        act.stride(0), aq.stride(0), as_.stride(0),
                                        GATHER=False, BM=cfg.BM, AB=ab, num_warps=4)
    del act
    y = torch.empty(P, D, dtype=torch.bfloat16, device=x.device)
    _fp8mma_down_kernel[(nb, triton.cdiv(D, cfg.BN_down))](
        aq, as_, w2, s2, pairs, block_expert, y, P, D, inter, E, aq.stride(0), as_.stride(0),
        y.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), ASM_DECODE=asm,
        AB=ab, BM=cfg.BM,
        BN=cfg.BN_down, num_warps=cfg.warps_down, num_stages=cfg.stages)
    del aq, as_
    BD = min(1024, triton.next_power_of_2(D))
    _moe_combine_kernel[(T, triton.cdiv(D, BD))](y, ids, out, D, E, TOPK=k, BD=BD, num_warps=4)
    return out
