"""Stream-K schedule of the routed-expert GEMMs at decode (dsv4 issue #5).

At one token the grouped kernels of :mod:`dsv4.ops.triton_moe` run ~6 row blocks × 32 N tiles
× 4 K splits = 768 short programs (8 K steps, 64 KB of weights each) on 528 resident slots: each
program pays its launch, its index loads and its pipeline ramp for little streaming, and the
last 240 run as a 0.45-wave tail (Nsight Compute, docs/PERFORMANCE.md eleventh session: 1.5 TB/s,
the MXFP4 decode itself only ~5% of the time).  Here a fixed grid of G programs (a few per SM)
splits the work evenly instead: the units (used row block, N tile, K step) are numbered tile
by tile, and program p takes units [p·U/G, (p+1)·U/G) in one continuous K loop, so the weight
pipeline runs on across tile boundaries and every program streams the same number of bytes.

A tile whose K steps one program covers alone is finished in place (the grouped kernels'
epilogue).  A tile shared by programs p_first..p_last: each stores its fp32 partial into its own
slot of a per-call workspace [G, CT, BM, BN] (CT: the most tiles one program can touch), counts
itself in at the tile's arrival counter (:func:`dsv4.ops.triton_dense.splitk_counters`), and the
last to arrive sums the partials in program order p_first..p_last — bit-reproducible whatever
the arrival order — runs the epilogue and resets the counter.  The result equals the grouped
kernels' to fp32 rounding (another summation order of the K steps), not bit for bit.

The number of used row blocks depends on the routing (experts shared by tokens), so U is computed
on the device from the plan (no host sync: CUDA graphs capture it); programs with an empty range
exit.  The per-tile expert ids and row masks of a program's (at most CT) tiles are loaded once
before its loop, so the loop itself loads only activations and weights, as the grouped kernels'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.triton_dense import sm_count, splitk_counters, store_rne
# The MMA expert kernels' tile helpers (triton_moe imports this module lazily: no cycle).
from dsv4.ops.triton_moe import (_dot_tile, _load_prepped_tile, _load_weight_tile,
                                 _up_epilogue)

__all__ = ["StreamKPlan", "streamk_plan", "moe_up_streamk", "moe_down_streamk"]


# ------------------------------------------------------------------------------ jit helpers
@triton.jit
def _streamk_range(bexp_ptr, NB, E, N, K, NBP: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    """This program's unit range [u0, u1) of the U = used blocks × N tiles × K steps units
    (used blocks: the plan's blocks with an expert id < E, which come first), and U, the N
    tiles and the K steps per tile."""
    rb = tl.arange(0, NBP)
    be = tl.load(bexp_ptr + rb, mask=rb < NB, other=E)
    used = tl.sum((be < E).to(tl.int32))
    n_tiles = tl.cdiv(N, BN)
    ks = K // BK
    U = used * n_tiles * ks
    p = tl.program_id(0)
    G = tl.num_programs(0)
    u0 = p * U // G
    u1 = (p + 1) * U // G
    return u0, u1, U, n_tiles, ks


@triton.jit
def _owner(u, U):
    """The program whose unit range holds unit u (the largest p with p·U/G <= u)."""
    G = tl.num_programs(0)
    return ((u + 1) * G - 1) // U


@triton.jit
def _tile_rows(pair_ptr, bexp_ptr, t0, n_tiles, NB, P, E, BM: tl.constexpr, CT: tl.constexpr):
    """For the CT tiles t0, t0+1, .. (some past the program's last: masked): their experts [CT]
    and the real-row masks of their blocks [CT, BM] (int32 0/1)."""
    lt = tl.arange(0, CT)
    blks = (t0 + lt) // n_tiles
    ok = blks < NB
    es = tl.load(bexp_ptr + blks, mask=ok, other=E)
    pr = tl.load(pair_ptr + blks[:, None] * BM + tl.arange(0, BM)[None, :], mask=ok[:, None],
                 other=P)
    return es, (pr < P).to(tl.int32)


@triton.jit
def _pick(es, rows, lt, i):
    """Tile i's expert (scalar) and real-row mask [BM] out of the program's per-tile vectors."""
    sel = lt == i
    e = tl.sum(tl.where(sel, es, 0))
    m = tl.sum(tl.where(sel[:, None], rows, 0), axis=0) > 0
    return e, m


@triton.jit
def _arrive(arrivals_ptr, tile, count):
    """Count this program in at the tile's counter after its partial stores; True for the last
    of ``count`` contributors, which then owns the reduction."""
    tl.debug_barrier()
    old = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
    return old == count - 1


@triton.jit
def _sum_slots(part_ptr, offs, mask, t, pf, pl, U, KS, stride_p, stride_c):
    """Σ of the partials of tile t of programs pf..pl, in program order; program q's slot for t
    is t minus q's first tile.  ``.cg``: read from L2, never a stale L1 line."""
    G = tl.num_programs(0)
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for q in range(pf, pl + 1):
        c = t - (q * U // G) // KS
        # int32 products: q < G and the workspace of G·CT tiles is far below 2^31 elements.
        ptrs = part_ptr + q * stride_p + c * stride_c + offs
        acc += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _moe_up_streamk_kernel(xs_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, pair_ptr, bexp_ptr, wt_ptr,
                           act_ptr, part1_ptr, part3_ptr, arrivals_ptr,
                           P, N, K, E, NB, stride_xm, stride_actm, stride_part_p,
                           stride_part_c, stride_we, stride_wn, stride_se, stride_sn, limit,
                           FMT: tl.constexpr, SB: tl.constexpr, SW_E8M0: tl.constexpr,
                           HAS_LIMIT: tl.constexpr, FAST_FP4: tl.constexpr,
                           SCALE_LE_128: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, NBP: tl.constexpr, CT: tl.constexpr,
                           KCHUNK: tl.constexpr = False, PDL: tl.constexpr = False):
    """``_moe_up_kernel`` (act = w · swiglu(w1 x, w3 x) per plan row) under the stream-K
    schedule of the module docstring."""
    grid_dependency_sync(PDL)
    u0, u1, U, n_tiles, KS = _streamk_range(bexp_ptr, NB, E, N, K, NBP, BN, BK)
    if u0 < u1:
        OUT: tl.constexpr = xs_ptr.dtype.element_ty
        p = tl.program_id(0)
        t0 = u0 // KS
        lt = tl.arange(0, CT)
        es, rows = _tile_rows(pair_ptr, bexp_ptr, t0, n_tiles, NB, P, E, BM, CT)
        ri = tl.arange(0, BM)
        rj = tl.arange(0, BN)
        t_last = (u1 - 1) // KS
        for t in range(t0, t_last + 1):
            # This program's K steps of tile t: one inner loop without branches, which the
            # compiler software-pipelines like the grouped kernels' (a flattened loop with the
            # tile epilogue inside is not pipelined by Triton 3.6).
            ks_lo = tl.maximum(u0 - t * KS, 0)
            ks_hi = tl.minimum(u1 - t * KS, KS)
            blk = t // n_tiles
            e, m_mask = _pick(es, rows, lt, t - t0)
            rm = blk * BM + ri
            rn = (t - blk * n_tiles) * BN + rj
            n_mask = rn < N
            acc1 = tl.zeros((BM, BN), dtype=tl.float32)
            acc3 = tl.zeros((BM, BN), dtype=tl.float32)
            for ks in range(ks_lo, ks_hi):
                k0 = ks * BK
                x_ev, x_od = _load_prepped_tile(xs_ptr, rm, m_mask, k0, stride_xm, FMT, BK)
                g_ev, g_od = _load_weight_tile(w1_ptr, s1_ptr, e, rn, n_mask, k0, stride_we,
                                               stride_wn, stride_se, stride_sn, FMT, SB, BN, BK,
                                               OUT, SW_E8M0, FAST_FP4, SCALE_LE_128,
                                               KCHUNK, N)
                acc1 = _dot_tile(acc1, x_ev, x_od, g_ev, g_od, FMT)
                u_ev, u_od = _load_weight_tile(w3_ptr, s3_ptr, e, rn, n_mask, k0, stride_we,
                                               stride_wn, stride_se, stride_sn, FMT, SB, BN, BK,
                                               OUT, SW_E8M0, FAST_FP4, SCALE_LE_128,
                                               KCHUNK, N)
                acc3 = _dot_tile(acc3, x_ev, x_od, u_ev, u_od, FMT)
            pair = tl.load(pair_ptr + rm)
            pf = _owner(t * KS, U)
            pl = _owner(t * KS + KS - 1, U)
            if pf == pl:
                _up_epilogue(acc1, acc3, act_ptr, wt_ptr, rm, pair, m_mask, rn, n_mask,
                             stride_actm, limit, OUT, HAS_LIMIT)
            else:
                offs = ri[:, None] * BN + rj[None, :]
                mask = m_mask[:, None] & n_mask[None, :]
                slot = p.to(tl.int64) * stride_part_p + (t - t0) * stride_part_c + offs
                tl.store(part1_ptr + slot, acc1, mask=mask)
                tl.store(part3_ptr + slot, acc3, mask=mask)
                if _arrive(arrivals_ptr, t, pl - pf + 1):
                    s1 = _sum_slots(part1_ptr, offs, mask, t, pf, pl, U, KS, stride_part_p,
                                    stride_part_c)
                    s3 = _sum_slots(part3_ptr, offs, mask, t, pf, pl, U, KS, stride_part_p,
                                    stride_part_c)
                    _up_epilogue(s1, s3, act_ptr, wt_ptr, rm, pair, m_mask, rn, n_mask,
                                 stride_actm, limit, OUT, HAS_LIMIT)
                    tl.store(arrivals_ptr + t, 0)


@triton.jit
def _moe_down_streamk_kernel(act_ptr, w2_ptr, s2_ptr, pair_ptr, bexp_ptr, y_ptr, part_ptr,
                             arrivals_ptr, P, N, K, E, NB, stride_actm, stride_ym,
                             stride_part_p, stride_part_c, stride_we, stride_wn, stride_se,
                             stride_sn, FMT: tl.constexpr, SB: tl.constexpr,
                             SW_E8M0: tl.constexpr, FAST_FP4: tl.constexpr,
                             SCALE_LE_128: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, NBP: tl.constexpr, CT: tl.constexpr,
                             KCHUNK: tl.constexpr = False, PDL: tl.constexpr = False):
    """``_moe_down_kernel`` (y[pair] = w2 · act[row]) under the stream-K schedule of the module
    docstring."""
    grid_dependency_sync(PDL)
    u0, u1, U, n_tiles, KS = _streamk_range(bexp_ptr, NB, E, N, K, NBP, BN, BK)
    if u0 < u1:
        OUT: tl.constexpr = act_ptr.dtype.element_ty
        p = tl.program_id(0)
        t0 = u0 // KS
        lt = tl.arange(0, CT)
        es, rows = _tile_rows(pair_ptr, bexp_ptr, t0, n_tiles, NB, P, E, BM, CT)
        ri = tl.arange(0, BM)
        rj = tl.arange(0, BN)
        t_last = (u1 - 1) // KS
        for t in range(t0, t_last + 1):
            ks_lo = tl.maximum(u0 - t * KS, 0)
            ks_hi = tl.minimum(u1 - t * KS, KS)
            blk = t // n_tiles
            e, m_mask = _pick(es, rows, lt, t - t0)
            rm = blk * BM + ri
            rn = (t - blk * n_tiles) * BN + rj
            n_mask = rn < N
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for ks in range(ks_lo, ks_hi):
                k0 = ks * BK
                a_ev, a_od = _load_prepped_tile(act_ptr, rm, m_mask, k0, stride_actm, FMT, BK)
                w_ev, w_od = _load_weight_tile(w2_ptr, s2_ptr, e, rn, n_mask, k0, stride_we,
                                               stride_wn, stride_se, stride_sn, FMT, SB, BN, BK,
                                               OUT, SW_E8M0, FAST_FP4, SCALE_LE_128,
                                               KCHUNK, N)
                acc = _dot_tile(acc, a_ev, a_od, w_ev, w_od, FMT)
            pair = tl.load(pair_ptr + rm)
            mask = m_mask[:, None] & n_mask[None, :]
            y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + rn[None, :]
            pf = _owner(t * KS, U)
            pl = _owner(t * KS + KS - 1, U)
            if pf == pl:
                store_rne(y_ptrs, acc, mask)
            else:
                offs = ri[:, None] * BN + rj[None, :]
                slot = p.to(tl.int64) * stride_part_p + (t - t0) * stride_part_c + offs
                tl.store(part_ptr + slot, acc, mask=mask)
                if _arrive(arrivals_ptr, t, pl - pf + 1):
                    s = _sum_slots(part_ptr, offs, mask, t, pf, pl, U, KS, stride_part_p,
                                   stride_part_c)
                    store_rne(y_ptrs, s, mask)
                    tl.store(arrivals_ptr + t, 0)


# ------------------------------------------------------------------------------ host side
class StreamKPlan:
    """Grid and workspace sizes of one stream-K GEMM: ``programs`` (G), ``tiles_per_program``
    (CT: a power of two >= the most tiles one program's range can touch, for the largest U the
    plan allows), ``nbp`` (the plan's blocks rounded up to a power of two)."""

    def __init__(self, programs: int, nb: int, n_tiles: int, k_steps: int) -> None:
        if programs < 1 or nb < 1 or n_tiles < 1 or k_steps < 1:
            raise ValueError(f"StreamKPlan: expected positive sizes; found programs={programs}, "
                             f"blocks={nb}, N tiles={n_tiles}, K steps={k_steps}")
        self.programs = programs
        # The most units one program gets (all blocks used), and the tiles such a range spans
        # when it starts on a tile's last step.
        most = -(-(nb * n_tiles * k_steps) // programs)
        self.tiles_per_program = triton.next_power_of_2(-(-(most - 1) // k_steps) + 1)
        self.nbp = triton.next_power_of_2(nb)
        self.tiles = nb * n_tiles


def streamk_plan(device: torch.device, per_sm: int, nb: int, n_tiles: int, k_steps: int
                 ) -> StreamKPlan:
    """The plan of ``per_sm`` programs per streaming multiprocessor of ``device``."""
    return StreamKPlan(per_sm * sm_count(device), nb, n_tiles, k_steps)


def moe_up_streamk(xs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor,
                   s3: torch.Tensor, pairs: torch.Tensor, block_expert: torch.Tensor,
                   wts: torch.Tensor, act: torch.Tensor, P: int, E: int, limit: float,
                   consts: dict, BM: int, BN: int, BK: int, per_sm: int, num_warps: int,
                   num_stages: int) -> None:
    """Launch the stream-K up GEMM (+ SwiGLU epilogue) into ``act`` [rows, I]; ``consts``: the
    format constexprs of ``_moe_up_kernel`` (FMT, SB, SW_E8M0, HAS_LIMIT, FAST_FP4,
    SCALE_LE_128)."""
    N, K = act.shape[1], xs.shape[1]
    nb = block_expert.shape[0]
    plan = streamk_plan(xs.device, per_sm, nb, triton.cdiv(N, BN), K // BK)
    G, CT = plan.programs, plan.tiles_per_program
    arrivals = splitk_counters(xs.device, plan.tiles, "moe_experts (stream-K)")
    part = torch.empty(2, G, CT, BM, BN, dtype=torch.float32, device=xs.device)
    _moe_up_streamk_kernel[(G,)](
        xs, w1, w3, s1, s3, pairs, block_expert, wts, act, part[0], part[1], arrivals,
        P, N, K, E, nb, xs.stride(0), act.stride(0), part.stride(1), part.stride(2),
        w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), float(limit),
        BM=BM, BN=BN, BK=BK, NBP=plan.nbp, CT=CT, num_warps=num_warps, num_stages=num_stages,
        **consts, **pdl_args(xs))


def moe_down_streamk(act_in: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                     pairs: torch.Tensor, block_expert: torch.Tensor, y: torch.Tensor, P: int,
                     E: int, consts: dict, BM: int, BN: int, BK: int, per_sm: int,
                     num_warps: int, num_stages: int) -> None:
    """Launch the stream-K down GEMM into ``y`` [P, D] (one row per pair); ``consts``: FMT, SB,
    SW_E8M0, FAST_FP4, SCALE_LE_128."""
    N, K = y.shape[1], act_in.shape[1]
    nb = block_expert.shape[0]
    plan = streamk_plan(y.device, per_sm, nb, triton.cdiv(N, BN), K // BK)
    G, CT = plan.programs, plan.tiles_per_program
    arrivals = splitk_counters(y.device, plan.tiles, "moe_experts (stream-K)")
    part = torch.empty(G, CT, BM, BN, dtype=torch.float32, device=y.device)
    _moe_down_streamk_kernel[(G,)](
        act_in, w2, s2, pairs, block_expert, y, part, arrivals, P, N, K, E, nb,
        act_in.stride(0), y.stride(0), part.stride(0), part.stride(1),
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        BM=BM, BN=BN, BK=BK, NBP=plan.nbp, CT=CT, num_warps=num_warps, num_stages=num_stages,
        **consts, **pdl_args(act_in))
