"""Routed experts at one or two tokens as independent K-step units (dsv4 issue #5; written without
a GPU, off by default until a session measures it: :data:`MOE_UNITS`).

Why: at one token the split-K grid of :mod:`dsv4.ops.triton_moe` streams its 75 MB of MXFP4
weights at ~1.4 TB/s (docs/PERFORMANCE.md, twelfth session): 768 short programs (8 K steps) in
1.45 waves, each with its own index loads, pipeline ramp and split-K epilogue (partials,
arrival atomic, sums) — while the MXFP4 decode itself costs only ~7% (run A there).  A stream-K
grid with the tile epilogue inside its K loop is not software-pipelined by Triton 3.6, and one
that re-ramps the pipeline per tile was slower.

Here every (used row block, N tile, K step) is a *unit* with no state across units: its two
(up) or one (down) MMA start from zero and its fp32 product rows are stored, masked to the real
pairs, into a per-call workspace ``[K steps, pairs, N]``.  A fixed grid of G programs (a few per
SM) walks contiguous, equal ranges of units in one loop without branches, which the compiler
pipelines across tile boundaries.  The K-step sums move into the launches that follow anyway:

* ``_moe_up_reduce_kernel`` (in place of ``_moe_prep_kernel`` between the GEMMs): per (plan row,
  act block) the gate / up sums over the K steps in the fixed order 0..S-1, rounded to the
  compute dtype, the clamped SwiGLU times the routing weight, rounded, then the down GEMM's
  operand prep (FP8 fake quantization per act block, the MXFP4 [even | odd] split);
* ``_moe_down_reduce_kernel`` (in place of ``_moe_combine_kernel``): per token, the pick rows'
  sums over the K steps (fixed order), each rounded to the compute dtype as the twin's GEMM
  output, then summed over the picks in pick order in fp32.

Launches: plan + x prep, up units, reduce + act prep, down units, reduce + combine: as many as
the split-K path.  The workspace traffic (two fp32 values per weight row per K step per pair)
is ~6% of the weight bytes at one token and grows with the pairs, so this path is for a few
tokens only (:data:`UNITS_MAX_PAIRS`).  Same products as the grouped kernels, summed in another
fixed fp32 order: equal to fp32 rounding, bit-reproducible.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.triton_dense import round_to_bf16, sm_count
# The MMA expert kernels' tile helpers (triton_moe imports this module lazily: no cycle).
from dsv4.ops.triton_moe import (_dot_tile, _load_prepped_tile, _load_weight_tile,
                                 store_prepped, weighted_swiglu)

__all__ = ["MOE_UNITS", "UNITS_MAX_PAIRS", "UNITS_PER_SM", "moe_units_applies",
           "moe_down_units", "moe_up_units"]

# Off until a GPU session times it against the split-K plans (bench/moe_decode.py --units).
MOE_UNITS = os.environ.get("DSV4_MOE_UNITS", "0") == "1"
# Pairs (tokens × top-k) up to which moe_experts may take this path (one or two tokens).
UNITS_MAX_PAIRS = 16
# Programs per SM of the unit loops.
UNITS_PER_SM = int(os.environ.get("DSV4_MOE_UNITS_PER_SM", "4"))


# ------------------------------------------------------------------------------ jit helpers
@triton.jit
def _unit_range(bexp_ptr, NB, E, N, K, NBP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """This program's units [u0, u1) of U = used blocks × N tiles × K steps (the plan's used
    blocks, those with an expert id < E, come first), the N tiles and the K steps."""
    rb = tl.arange(0, NBP)
    be = tl.load(bexp_ptr + rb, mask=rb < NB, other=E)
    used = tl.sum((be < E).to(tl.int32))
    n_tiles = tl.cdiv(N, BN)
    ks = K // BK
    U = used * n_tiles * ks
    p = tl.program_id(0)
    G = tl.num_programs(0)
    return p * U // G, (p + 1) * U // G, n_tiles, ks


@triton.jit
def _unit(u, KS, n_tiles, bexp_ptr, pair_ptr, P, N, ri, rj, BM: tl.constexpr,
          BN: tl.constexpr):
    """Unit u (order: block, N tile, K step; K step fastest): its expert, plan rows [BM], their
    pair ids and real-row mask, output columns [BN] and their mask, and its K step."""
    t = u // KS
    blk = t // n_tiles
    rm = blk * BM + ri
    pair = tl.load(pair_ptr + rm)
    rn = (t - blk * n_tiles) * BN + rj
    return tl.load(bexp_ptr + blk), rm, pair, pair < P, rn, rn < N, u - t * KS


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _moe_up_units_kernel(xs_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, pair_ptr, bexp_ptr, ws1_ptr,
                         ws3_ptr, P, N, K, E, NB, stride_xm, stride_wsk, stride_wsp,
                         stride_we, stride_wn, stride_se, stride_sn,
                         FMT: tl.constexpr, SB: tl.constexpr, SW_E8M0: tl.constexpr,
                         FAST_FP4: tl.constexpr, SCALE_LE_128: tl.constexpr,
                         KCHUNK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, NBP: tl.constexpr, PDL: tl.constexpr = False):
    """ws1 / ws3 [K steps, P, N] = the gate / up products of each unit's K step (fp32, the
    real pairs' rows only); units in the order (block, N tile, K step), K step fastest."""
    grid_dependency_sync(PDL)
    u0, u1, n_tiles, KS = _unit_range(bexp_ptr, NB, E, N, K, NBP, BN, BK)
    OUT: tl.constexpr = xs_ptr.dtype.element_ty
    ri = tl.arange(0, BM)
    rj = tl.arange(0, BN)
    for u in range(u0, u1):
        e, rm, pair, m_mask, rn, n_mask, ks = _unit(u, KS, n_tiles, bexp_ptr, pair_ptr, P, N,
                                                    ri, rj, BM, BN)
        k0 = ks * BK
        x_ev, x_od = _load_prepped_tile(xs_ptr, rm, m_mask, k0, stride_xm, FMT, BK)
        g_ev, g_od = _load_weight_tile(w1_ptr, s1_ptr, e, rn, n_mask, k0, stride_we, stride_wn,
                                       stride_se, stride_sn, FMT, SB, BN, BK, OUT, SW_E8M0,
                                       FAST_FP4, SCALE_LE_128, KCHUNK, N)
        acc1 = _dot_tile(tl.zeros((BM, BN), dtype=tl.float32), x_ev, x_od, g_ev, g_od, FMT)
        u_ev, u_od = _load_weight_tile(w3_ptr, s3_ptr, e, rn, n_mask, k0, stride_we, stride_wn,
                                       stride_se, stride_sn, FMT, SB, BN, BK, OUT, SW_E8M0,
                                       FAST_FP4, SCALE_LE_128, KCHUNK, N)
        acc3 = _dot_tile(tl.zeros((BM, BN), dtype=tl.float32), x_ev, x_od, u_ev, u_od, FMT)
        offs = ks * stride_wsk + pair[:, None] * stride_wsp + rn[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        tl.store(ws1_ptr + offs, acc1, mask=mask)
        tl.store(ws3_ptr + offs, acc3, mask=mask)


@triton.jit
def _moe_down_units_kernel(act_ptr, w2_ptr, s2_ptr, pair_ptr, bexp_ptr, ws_ptr, P, N, K, E, NB,
                           stride_am, stride_wsk, stride_wsp, stride_we, stride_wn, stride_se,
                           stride_sn, FMT: tl.constexpr, SB: tl.constexpr,
                           SW_E8M0: tl.constexpr, FAST_FP4: tl.constexpr,
                           SCALE_LE_128: tl.constexpr, KCHUNK: tl.constexpr, BM: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, NBP: tl.constexpr,
                           PDL: tl.constexpr = False):
    """ws [K steps, P, N] = each unit's w2 product of its K step (fp32, real pairs' rows)."""
    grid_dependency_sync(PDL)
    u0, u1, n_tiles, KS = _unit_range(bexp_ptr, NB, E, N, K, NBP, BN, BK)
    OUT: tl.constexpr = act_ptr.dtype.element_ty
    ri = tl.arange(0, BM)
    rj = tl.arange(0, BN)
    for u in range(u0, u1):
        e, rm, pair, m_mask, rn, n_mask, ks = _unit(u, KS, n_tiles, bexp_ptr, pair_ptr, P, N,
                                                    ri, rj, BM, BN)
        k0 = ks * BK
        a_ev, a_od = _load_prepped_tile(act_ptr, rm, m_mask, k0, stride_am, FMT, BK)
        w_ev, w_od = _load_weight_tile(w2_ptr, s2_ptr, e, rn, n_mask, k0, stride_we, stride_wn,
                                       stride_se, stride_sn, FMT, SB, BN, BK, OUT, SW_E8M0,
                                       FAST_FP4, SCALE_LE_128, KCHUNK, N)
        acc = _dot_tile(tl.zeros((BM, BN), dtype=tl.float32), a_ev, a_od, w_ev, w_od, FMT)
        offs = ks * stride_wsk + pair[:, None] * stride_wsp + rn[None, :]
        tl.store(ws_ptr + offs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_up_reduce_kernel(ws1_ptr, ws3_ptr, pair_ptr, bexp_ptr, wt_ptr, dst_ptr, P, E, KS,
                          stride_wsk, stride_wsp, stride_dst, limit, HAS_LIMIT: tl.constexpr,
                          FMT: tl.constexpr, QUANT: tl.constexpr, BM: tl.constexpr,
                          BK: tl.constexpr, PDL: tl.constexpr = False):
    """Per (row block, act block j of I): act = w · swiglu(Σ_s ws1[s], Σ_s ws3[s]) of the block's
    real pairs (sums in the order s = 0..KS-1, rounded to the compute dtype before the SwiGLU
    and after, as the grouped kernels' epilogue), made ready for the down GEMM as
    ``_moe_prep_kernel`` does (FP8 fake quant per act block, MXFP4 [even | odd] split)."""
    grid_dependency_sync(PDL)
    blk = tl.program_id(0)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        rm = blk * BM + tl.arange(0, BM)
        pair = tl.load(pair_ptr + rm)
        m_mask = pair < P
        OUT: tl.constexpr = dst_ptr.dtype.element_ty
        k0 = tl.program_id(1) * BK
        offs = pair[:, None] * stride_wsp + k0 + tl.arange(0, BK)[None, :]
        g = tl.zeros((BM, BK), dtype=tl.float32)
        u = tl.zeros((BM, BK), dtype=tl.float32)
        for s in range(0, KS):
            g += tl.load(ws1_ptr + s * stride_wsk + offs, mask=m_mask[:, None], other=0.0)
            u += tl.load(ws3_ptr + s * stride_wsk + offs, mask=m_mask[:, None], other=0.0)
        wt = tl.load(wt_ptr + pair, mask=m_mask, other=0.0)
        a = weighted_swiglu(g, u, wt, limit, OUT, HAS_LIMIT)
        if OUT == tl.bfloat16:
            a = round_to_bf16(a)        # the activation the split-K path stores
        store_prepped(dst_ptr + rm.to(tl.int64)[:, None] * stride_dst + k0, a, m_mask, FMT,
                      QUANT, BK)


@triton.jit
def _moe_down_reduce_kernel(ws_ptr, ids_ptr, out_ptr, D, E, KS, stride_wsk, stride_wsp,
                            TOPK: tl.constexpr, BD: tl.constexpr, ROUND_BF16: tl.constexpr,
                            PDL: tl.constexpr = False):
    """out[t] = Σ_j (Σ_s ws[s, t·k + j]) over the picks j whose expert id is in 0..E-1, each
    pick's K-step sum (order s = 0..KS-1) rounded to the compute dtype (ROUND_BF16) as the
    twin's w2 output, the picks summed in fp32 in pick order."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    d_mask = rd < D
    acc = tl.zeros((BD,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(ids_ptr + t * TOPK + j)
        ok = (e >= 0) & (e < E)
        y = tl.zeros((BD,), dtype=tl.float32)
        for s in range(0, KS):
            y += tl.load(ws_ptr + s * stride_wsk + (t * TOPK + j) * stride_wsp + rd,
                         mask=d_mask & ok, other=0.0)
        if ROUND_BF16:
            y = round_to_bf16(y)
        acc += y
    tl.store(out_ptr + t.to(tl.int64) * D + rd, acc, mask=d_mask)


# ------------------------------------------------------------------------------ host side
def moe_units_applies(num_pairs: int) -> bool:
    """Whether ``triton_moe.moe_experts_with_config`` takes the unit path for a call."""
    return MOE_UNITS and 0 < num_pairs <= UNITS_MAX_PAIRS


def _programs(device: torch.device, per_sm: int | None) -> int:
    return max(1, (per_sm or UNITS_PER_SM) * sm_count(device))


def moe_up_units(xs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor,
                 s3: torch.Tensor, pairs: torch.Tensor, block_expert: torch.Tensor,
                 wts: torch.Tensor, act_in: torch.Tensor, P: int, E: int, limit: float,
                 consts: dict, quant: bool, BM: int, BN: int, BK: int, num_warps: int,
                 num_stages: int, per_sm: int | None = None) -> None:
    """The up GEMM as units, then its reduction + SwiGLU + down-operand prep into ``act_in``
    [rows, I] (the layout ``_moe_prep_kernel`` writes); ``consts``: FMT, SB, SW_E8M0, FAST_FP4,
    SCALE_LE_128, KCHUNK of the expert kernels."""
    N, K = act_in.shape[1], xs.shape[1]
    nb = block_expert.shape[0]
    ks = K // BK
    ws = torch.empty(2, ks, P, N, dtype=torch.float32, device=xs.device)
    _moe_up_units_kernel[(_programs(xs.device, per_sm),)](
        xs, w1, w3, s1, s3, pairs, block_expert, ws[0], ws[1], P, N, K, E, nb, xs.stride(0),
        ws.stride(1), ws.stride(2), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
        BM=BM, BN=BN, BK=BK, NBP=triton.next_power_of_2(nb), num_warps=num_warps,
        num_stages=num_stages, **consts, **pdl_args(xs))
    _moe_up_reduce_kernel[(nb, N // BK)](
        ws[0], ws[1], pairs, block_expert, wts, act_in, P, E, ks, ws.stride(1), ws.stride(2),
        act_in.stride(0), float(limit), HAS_LIMIT=limit > 0, FMT=consts["FMT"], QUANT=quant,
        BM=BM, BK=BK, num_warps=4, **pdl_args(ws))


def moe_down_units(act_in: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                   pairs: torch.Tensor, block_expert: torch.Tensor, ids: torch.Tensor,
                   out: torch.Tensor, P: int, E: int, consts: dict, BM: int, BN: int, BK: int,
                   num_warps: int, num_stages: int, per_sm: int | None = None) -> None:
    """The down GEMM as units, then its reduction + the weighted combine into ``out`` [T, D]
    fp32 (rounded per pick to act_in's dtype)."""
    T, D = out.shape
    K = act_in.shape[1]
    nb = block_expert.shape[0]
    ks = K // BK
    ws = torch.empty(ks, P, D, dtype=torch.float32, device=act_in.device)
    _moe_down_units_kernel[(_programs(act_in.device, per_sm),)](
        act_in, w2, s2, pairs, block_expert, ws, P, D, K, E, nb, act_in.stride(0),
        ws.stride(0), ws.stride(1), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        BM=BM, BN=BN, BK=BK, NBP=triton.next_power_of_2(nb), num_warps=num_warps,
        num_stages=num_stages, **consts, **pdl_args(act_in))
    BD = min(1024, triton.next_power_of_2(D))
    _moe_down_reduce_kernel[(T, triton.cdiv(D, BD))](
        ws, ids, out, D, E, ks, ws.stride(0), ws.stride(1), TOPK=ids.shape[1], BD=BD,
        ROUND_BF16=act_in.dtype == torch.bfloat16, num_warps=4, **pdl_args(ws))
