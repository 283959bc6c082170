"""Prefill expert GEMMs on FP8 codes with the per-step rescale overlapped (Gluon; dsv4 issue #5).

The FP8-MMA prefill path (:mod:`dsv4.ops.triton_moe_fp8`) runs its expert GEMMs on e4m3 codes
with one scale per (row, 128-wide K step) on each operand: every step's product is rescaled in
fp32 before it joins the sum.  Triton 3.6 waits on each step's ``wgmma`` before that rescale
(``warp_group_dot_wait {pendings = 0}`` right after every dot, checked offline with the sm_90
compile), so within a program the tensor cores idle while the previous step is rescaled and the
next tiles are not yet being multiplied.  These kernels are the same GEMMs written in Gluon, the
operand tiles coming in by TMA into a ring of ``STAGES`` shared-memory slots with mbarriers, in
three forms (:class:`GluonGemmPlan`):

* warp-specialized (``ws``, the default plans; :func:`_gemm_ws_kernel`): a one-warp TMA
  producer and two consumer warpgroups, each multiplying and rescaling half of the N tile and
  releasing the slot through an ``empty`` barrier, so one warpgroup's rescale runs beside the
  other's wgmma;
* plain: each step's product waited for and rescaled at once, as in Triton, with ~95-170
  registers, so that two or three programs share an SM;
* lagged (``lag``): step i's product starts asynchronously into a fresh accumulator
  (``use_acc=False``), step i − 1's is waited for (``warpgroup_mma_wait(num_outstanding=n)``)
  and rescaled while step i runs (ptxas still serializes these wgmmas and needs ~2x the
  registers).

Every form adds ``fma(d · sa, sb, acc)`` per step, the Triton kernels' operation; the epilogues
are theirs: up stores act = w · swiglu(g, u) (g, u rounded to bf16, the V4 clamp) rounded to
bf16 per row of the plan; down stores y[pair] rounded to bf16.

Same inputs as ``_fp8mma_up_kernel`` / ``_fp8mma_down_kernel`` with ``PREDECODED`` (the plan's
rows, their codes ``xq`` / ``aq`` and scales in the MMA K order; the weights' codes
[E, N, K] and step factors [E, K / ks, N] of :class:`~dsv4.ops.triton_moe_fp8.Fp8Codes` or of
the call's re-encoding), same products per step and same fp32 operations in the same order:
the results are meant to be bit-equal to the Triton kernels' (the GPU test checks it).

Measured (H100, V4-Flash widths, 256 experts; docs/PERFORMANCE.md, thirty-fifth session): the
warp-specialized form is 2-13% faster than the Triton kernels per GEMM (two runs) and gives
their bits; the plain and lagged forms are slower.  On by default (:data:`GLUON_PREFILL`).

Gluon has no interpreter (triton 3.6): these kernels run on sm_90 GPUs only and are compiled
offline for sm_90 by the CPU tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.triton_dense import round_to_bf16
from dsv4.ops.triton_moe import tile_grid, weighted_swiglu

try:  # Gluon ships with triton >= 3.5; without its NVIDIA parts this path is off.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - older triton
    HAVE_GLUON = False

__all__ = ["GLUON_PREFILL", "HAVE_GLUON", "GluonGemmPlan", "PLAN_UP", "PLAN_DOWN",
           "enabled", "gemm_up", "gemm_down", "qualifies"]

# Where the expert call runs these GEMMs (DSV4_FP8MMA_GLUON; docs/PERFORMANCE.md, thirty-fifth and
# thirty-sixth sessions, H100): "1" (default) everywhere: on kept FP8 codes (Fp8Codes, one
# chunk: the call 5.2% / 4.6% faster at 8K / 32K tokens, the 4-layer prefill ~2% faster) and
# on the per-call re-encoding's chunks (with WS_SKIP: the call +0.4% / -3.3%, the 4-layer
# prefill -0.3% / -0.8%); "kept" on kept codes only; "0" never.
GLUON_PREFILL = os.environ.get("DSV4_FP8MMA_GLUON", "1")
if GLUON_PREFILL not in ("0", "1", "kept"):
    raise ValueError(f"DSV4_FP8MMA_GLUON={GLUON_PREFILL!r}: expected '0', '1' or 'kept'")


# The warp-specialized kernel's row blocks of experts outside the launch's chunk return before
# setting up the ring and the partitions (DSV4_GLUON_WS_SKIP, default on).  Without it a
# skipped block still pays that setup: the re-encoding's chunks ran 1.8% / 5.0% slower in
# Gluon than in Triton at 8K / 32K tokens; with it +0.4% / -3.3% (H100, thirty-sixth session,
# same bits).
WS_SKIP = os.environ.get("DSV4_GLUON_WS_SKIP", "1") == "1"


def enabled(kept_codes: bool) -> bool:
    """Whether :data:`GLUON_PREFILL` (read per call) picks these GEMMs for an expert call on
    kept codes (``kept_codes``) or on the per-call re-encoding."""
    return GLUON_PREFILL == "1" or (GLUON_PREFILL == "kept" and kept_codes)


@dataclass(frozen=True)
class GluonGemmPlan:
    """Tile plan of one Gluon expert GEMM: BM plan rows (the plan's row blocks), BN weight rows
    a tile, ``stages`` shared-memory slots, warps (4: one warpgroup; 8: two, BM split);
    ``lag``: step i − 1 is rescaled while step i's wgmma runs (else each step's product is
    waited for and rescaled at once, as Triton does, and only other programs on the SM
    overlap it); ``ws``: warp-specialized (a TMA warp, two consumer warpgroups of BN / 2
    columns each: :func:`_gemm_ws_kernel`)."""

    BM: int = 64
    BN: int = 64
    stages: int = 4
    warps: int = 4
    lag: bool = False
    ws: bool = False

    def __post_init__(self) -> None:
        if self.BM not in (64, 128) or self.BN not in (32, 64, 128, 256):
            raise ValueError(f"GluonGemmPlan: BM must be 64 or 128 and BN 32..256 (a power of "
                             f"two); found BM={self.BM}, BN={self.BN}")
        if self.warps not in (4, 8) or (self.warps == 8 and self.BM != 128):
            raise ValueError(f"GluonGemmPlan: warps must be 4, or 8 with BM 128; found "
                             f"{self.warps} (BM {self.BM})")
        if self.ws and (self.lag or self.warps != 4 or self.BN < 64):
            raise ValueError("GluonGemmPlan: ws takes 4 warps a consumer, BN >= 64, no lag")
        if not 2 <= self.stages <= 8:
            raise ValueError(f"GluonGemmPlan: stages must be 2..8; found {self.stages}")


# The fastest plans of bench/moe_gluon_prefill.py (H100, 8K / 32K tokens, 256 experts;
# docs/PERFORMANCE.md, thirty-fifth session): warp-specialized, 64-row blocks (the predecoded
# Triton plan's), up 128 columns (64 a consumer) with 3 stages, down 256 (128 a consumer).
PLAN_UP = GluonGemmPlan(BM=64, BN=128, stages=3, warps=4, ws=True)
PLAN_DOWN = GluonGemmPlan(BM=64, BN=256, stages=4, warps=4, ws=True)


if HAVE_GLUON:

    @gluon.jit
    def _block_and_tile(N_FIRST: gl.constexpr):
        """This program's (row block, N tile), in :func:`~dsv4.ops.triton_moe.tile_grid`'s
        order of the grid's axes."""
        if N_FIRST:
            blk = gl.program_id(1)
            pid_n = gl.program_id(0)
        else:
            blk = gl.program_id(0)
            pid_n = gl.program_id(1)
        return blk, pid_n

    @gluon.jit
    def _issue_step(a_desc, b_desc, b3_desc, a_s, b_s, b3_s, bars, step, row0, wrow0, pred,
                    TWO: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
        """TMA loads of K step ``step`` (the activation rows and the weight rows) into slot
        step % STAGES, completing on that slot's barrier; nothing when ``pred`` is false."""
        slot = step % STAGES
        bar = bars.index(slot)
        # b3's box is b's (TWO: both weights' tiles of the step).
        NBYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes * (1 + TWO)
        mbarrier.expect(bar, NBYTES, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [row0, step * BK], bar, a_s.index(slot), pred)
        tma.async_copy_global_to_shared(b_desc, [wrow0, step * BK], bar, b_s.index(slot), pred)
        if TWO:
            tma.async_copy_global_to_shared(b3_desc, [wrow0, step * BK], bar, b3_s.index(slot),
                                            pred)

    @gluon.jit
    def _store_tile(acc, acc3, rm, rn, pair_ptr, wt_ptr, out_ptr, P, N, stride_om, limit,
                    TWO: gl.constexpr, HAS_LIMIT: gl.constexpr):
        """The Triton kernels' epilogues for plan rows rm and columns rn: up (TWO) stores
        act[row] = w · swiglu(acc, acc3) rounded to bf16, down y[pair] = acc rounded to bf16;
        padding rows (pair ids >= P) are not written."""
        pair = gl.load(pair_ptr + rm)
        m_mask = pair < P
        mask = m_mask[:, None] & (rn < N)[None, :]
        if TWO:
            wt = gl.load(wt_ptr + pair, mask=m_mask, other=0.0)
            v = weighted_swiglu(acc, acc3, wt, limit, gl.bfloat16, HAS_LIMIT)
            ptrs = out_ptr + rm.to(gl.int64)[:, None] * stride_om + rn[None, :]
        else:
            v = acc
            ptrs = out_ptr + pair.to(gl.int64)[:, None] * stride_om + rn[None, :]
        gl.store(ptrs, round_to_bf16(v).to(gl.bfloat16), mask=mask)

    @gluon.jit
    def _rescale(prod, prod3, sa, sb, sb3, acc, acc3, TWO: gl.constexpr,
                 PENDING: gl.constexpr):
        """Wait for a step's products (the last PENDING issued may stay in flight) and add them
        rescaled, the Triton kernels' fp32 operation: acc += (prod · sa) · sb, and under TWO
        acc3 += (prod3 · sa) · sb3."""
        if TWO:
            done, done3 = warpgroup_mma_wait(num_outstanding=PENDING, deps=(prod, prod3))
            acc3 = gl.fma(done3 * sa[:, None], sb3[None, :], acc3)
        else:
            done = warpgroup_mma_wait(num_outstanding=PENDING, deps=(prod,))
        acc = gl.fma(done * sa[:, None], sb[None, :], acc)
        return acc, acc3

    @gluon.jit
    def _step(a_desc, b_desc, b3_desc, a_s, b_s, b3_s, bars, i, row0, wrow0, zero, prev, prev3,
              sa_prev, sb_prev, sb3_prev, acc, acc3, sa_base, f_base, f3_base, stride_fk,
              TWO: gl.constexpr, NK: gl.constexpr, AB: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr):
        """K step i (> 0): its w1 (or w2) product starts; step i − 1's products, done, are
        rescaled into the sums while it runs; then (TWO) its w3 product starts and step i − 1's
        slot takes step i + STAGES − 1.  Returns the products in flight, their scales and the
        sums."""
        slot = i % STAGES
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        d = warpgroup_mma(a_s.index(slot), b_s.index(slot).permute((1, 0)), zero,
                          use_acc=False, is_async=True)
        sa = gl.load(sa_base + (i * BK) // AB)
        sb = gl.load(f_base + i * stride_fk)
        sb3 = gl.load(f3_base + i * stride_fk)
        # All but d are done: step i - 1's products.
        acc, acc3 = _rescale(prev, prev3, sa_prev, sb_prev, sb3_prev, acc, acc3, TWO, 1)
        if TWO:
            d3 = warpgroup_mma(a_s.index(slot), b3_s.index(slot).permute((1, 0)), zero,
                               use_acc=False, is_async=True)
        else:
            d3 = d
        nxt = i + STAGES - 1
        _issue_step(a_desc, b_desc, b3_desc, a_s, b_s, b3_s, bars, nxt, row0, wrow0, nxt < NK,
                    TWO, BK, STAGES)
        return d, d3, sa, sb, sb3, acc, acc3

    @gluon.jit
    def _gemm_kernel(a_desc, b_desc, b3_desc, sa_ptr, f_ptr, f3_ptr, pair_ptr, bexp_ptr, wt_ptr,
                     out_ptr, P, N, e0, e1, stride_sam, stride_fe, stride_fk, stride_om,
                     limit, TWO: gl.constexpr, HAS_LIMIT: gl.constexpr, K: gl.constexpr,
                     AB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                     STAGES: gl.constexpr, N_FIRST: gl.constexpr, LAG: gl.constexpr,
                     WARPS: gl.constexpr, PDL: gl.constexpr = False):
        """One (row block, N tile) of the up (TWO: w1 and w3, act = w · swiglu stored per plan
        row) or down (y stored per pair) GEMM; experts e0 <= e < e1 only, weights indexed
        e − e0 (the descriptors view them as [chunk · N, K])."""
        grid_dependency_sync(PDL)
        blk, pid_n = _block_and_tile(N_FIRST)
        e = gl.load(bexp_ptr + blk)
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BN, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        a_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], a_desc.layout)
        b_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], b_desc.layout)
        if TWO:
            b3_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], b3_desc.layout)
        else:
            b3_s = b_s
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        if (e >= e0) & (e < e1):
            NK: gl.constexpr = K // BK
            row0 = blk * BM
            wrow0 = (e - e0) * N + pid_n * BN
            for s in gl.static_range(STAGES - 1):
                _issue_step(a_desc, b_desc, b3_desc, a_s, b_s, b3_s, bars, s, row0, wrow0,
                            s < NK, TWO, BK, STAGES)
            rm = row0 + gl.arange(0, BM, layout=row_l)
            rn = pid_n * BN + gl.arange(0, BN, layout=col_l)
            f_base = f_ptr + (e - e0).to(gl.int64) * stride_fe + rn
            f3_base = f3_ptr + (e - e0).to(gl.int64) * stride_fe + rn
            sa_base = sa_ptr + rm.to(gl.int64) * stride_sam
            zero = gl.zeros([BM, BN], gl.float32, mma)
            acc = zero
            acc3 = zero
            if LAG:
                # Step 0 starts here; each loop turn runs two steps, so that the product in flight
                # and the one being rescaled need no copy between them.  ptxas (CUDA 13, sm_90)
                # still reports these wgmmas serialized (C7514 / C7515) and needs ~2x the
                # registers: measured anyway (bench/moe_gluon_prefill.py).
                mbarrier.wait(bars.index(0), 0)
                prev = warpgroup_mma(a_s.index(0), b_s.index(0).permute((1, 0)), zero,
                                     use_acc=False, is_async=True)
                if TWO:
                    prev3 = warpgroup_mma(a_s.index(0), b3_s.index(0).permute((1, 0)), zero,
                                          use_acc=False, is_async=True)
                else:
                    prev3 = prev
                _issue_step(a_desc, b_desc, b3_desc, a_s, b_s, b3_s, bars, STAGES - 1, row0,
                            wrow0, STAGES - 1 < NK, TWO, BK, STAGES)
                sa_prev = gl.load(sa_base)
                sb_prev = gl.load(f_base)
                sb3_prev = gl.load(f3_base)
                for j in range(0, (NK - 1) // 2):
                    prev, prev3, sa_prev, sb_prev, sb3_prev, acc, acc3 = _step(
                        a_desc, b_desc, b3_desc, a_s, b_s, b3_s, bars, 2 * j + 1, row0, wrow0,
                        zero, prev, prev3, sa_prev, sb_prev, sb3_prev, acc, acc3, sa_base, f_base,
                        f3_base, stride_fk, TWO, NK, AB, BK, STAGES)
                    prev, prev3, sa_prev, sb_prev, sb3_prev, acc, acc3 = _step(
                        a_desc, b_desc, b3_desc, a_s, b_s, b3_s, bars, 2 * j + 2, row0, wrow0,
                        zero, prev, prev3, sa_prev, sb_prev, sb3_prev, acc, acc3, sa_base, f_base,
                        f3_base, stride_fk, TWO, NK, AB, BK, STAGES)
                if NK % 2 == 0:
                    prev, prev3, sa_prev, sb_prev, sb3_prev, acc, acc3 = _step(
                        a_desc, b_desc, b3_desc, a_s, b_s, b3_s, bars, NK - 1, row0, wrow0,
                        zero, prev, prev3, sa_prev, sb_prev, sb3_prev, acc, acc3, sa_base, f_base,
                        f3_base, stride_fk, TWO, NK, AB, BK, STAGES)
                acc, acc3 = _rescale(prev, prev3, sa_prev, sb_prev, sb3_prev, acc, acc3, TWO, 0)
            else:
                for i in range(NK):
                    slot = i % STAGES
                    mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
                    # Step i - 1's slot is free (its product was waited for): step i + STAGES - 1.
                    nxt = i + STAGES - 1
                    _issue_step(a_desc, b_desc, b3_desc, a_s, b_s, b3_s, bars, nxt, row0, wrow0,
                                nxt < NK, TWO, BK, STAGES)
                    d = warpgroup_mma(a_s.index(slot), b_s.index(slot).permute((1, 0)), zero,
                                      use_acc=False, is_async=True)
                    sa = gl.load(sa_base + (i * BK) // AB)
                    sb = gl.load(f_base + i * stride_fk)
                    if TWO:
                        d3 = warpgroup_mma(a_s.index(slot), b3_s.index(slot).permute((1, 0)),
                                           zero, use_acc=False, is_async=True)
                        sb3 = gl.load(f3_base + i * stride_fk)
                    else:
                        d3 = d
                        sb3 = sb
                    acc, acc3 = _rescale(d, d3, sa, sb, sb3, acc, acc3, TWO, 0)
            _store_tile(acc, acc3, rm, rn, pair_ptr, wt_ptr, out_ptr, P, N, stride_om, limit,
                        TWO, HAS_LIMIT)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

    @gluon.jit
    def _ws_producer(a_desc, b_desc, b3_desc, a_s, b_s, b3_s, full, empty, row0, wrow0, nk,
                     TWO: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
        """The TMA warp: step i's tiles into slot i % STAGES once both consumers released the
        slot's previous step (its ``empty`` barrier's phase)."""
        for i in range(nk):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
            _issue_step(a_desc, b_desc, b3_desc, a_s, b_s, b3_s, full, i, row0, wrow0, True,
                        TWO, BK, STAGES)

    @gluon.jit
    def _ws_consumer(a_s, b_s, b3_s, full, empty, sa_ptr, f_ptr, f3_ptr, pair_ptr, wt_ptr,
                     out_ptr, e_local, P, N, row0, n0, nk, stride_sam, stride_fe, stride_fk,
                     stride_om, limit, HALF: gl.constexpr, PART: gl.constexpr,
                     TWO: gl.constexpr, HAS_LIMIT: gl.constexpr, AB: gl.constexpr,
                     BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
        """One consumer warpgroup: columns [PART · HALF, (PART + 1) · HALF) of the tile, each
        step's product waited for and rescaled at once (the other warpgroup's wgmma runs
        meanwhile), the slot released, then the tile's epilogue for its columns."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        rm = row0 + gl.arange(0, BM, layout=row_l)
        rn = n0 + PART * HALF + gl.arange(0, HALF, layout=col_l)
        f_base = f_ptr + e_local.to(gl.int64) * stride_fe + rn
        f3_base = f3_ptr + e_local.to(gl.int64) * stride_fe + rn
        sa_base = sa_ptr + rm.to(gl.int64) * stride_sam
        zero = gl.zeros([BM, HALF], gl.float32, mma)
        acc = zero
        acc3 = zero
        for i in range(nk):
            slot = i % STAGES
            mbarrier.wait(full.index(slot), (i // STAGES) & 1)
            a = a_s.index(slot)
            d = warpgroup_mma(a, b_s.index(slot).slice(PART * HALF, HALF, dim=0).permute((1, 0)),
                              zero, use_acc=False, is_async=True)
            sa = gl.load(sa_base + (i * BK) // AB)
            sb = gl.load(f_base + i * stride_fk)
            if TWO:
                d3 = warpgroup_mma(
                    a, b3_s.index(slot).slice(PART * HALF, HALF, dim=0).permute((1, 0)), zero,
                    use_acc=False, is_async=True)
                sb3 = gl.load(f3_base + i * stride_fk)
                done, done3 = warpgroup_mma_wait(num_outstanding=0, deps=(d, d3))
                mbarrier.arrive(empty.index(slot), count=1)
                acc3 = gl.fma(done3 * sa[:, None], sb3[None, :], acc3)
            else:
                done = warpgroup_mma_wait(num_outstanding=0, deps=(d,))
                mbarrier.arrive(empty.index(slot), count=1)
            acc = gl.fma(done * sa[:, None], sb[None, :], acc)
        if nk > 0:
            _store_tile(acc, acc3, rm, rn, pair_ptr, wt_ptr, out_ptr, P, N, stride_om, limit,
                        TWO, HAS_LIMIT)

    @gluon.jit
    def _ws_tile(a_desc, b_desc, b3_desc, sa_ptr, f_ptr, f3_ptr, pair_ptr, wt_ptr, out_ptr,
                 e_local, P, N, row0, pid_n, wrow0, nk, stride_sam, stride_fe, stride_fk,
                 stride_om, limit, TWO: gl.constexpr, HAS_LIMIT: gl.constexpr,
                 AB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                 STAGES: gl.constexpr):
        """One tile of :func:`_gemm_ws_kernel`: the ring, its barriers and the partitions."""
        a_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], a_desc.layout)
        b_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], b_desc.layout)
        if TWO:
            b3_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], b3_desc.layout)
        else:
            b3_s = b_s
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(full.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)
        HALF: gl.constexpr = BN // 2
        gl.warp_specialize([
            (_ws_consumer, (a_s, b_s, b3_s, full, empty, sa_ptr, f_ptr, f3_ptr, pair_ptr,
                            wt_ptr, out_ptr, e_local, P, N, row0, pid_n * BN, nk, stride_sam,
                            stride_fe, stride_fk, stride_om, limit, HALF, 0, TWO, HAS_LIMIT,
                            AB, BM, BK, STAGES)),
            (_ws_consumer, (a_s, b_s, b3_s, full, empty, sa_ptr, f_ptr, f3_ptr, pair_ptr,
                            wt_ptr, out_ptr, e_local, P, N, row0, pid_n * BN, nk, stride_sam,
                            stride_fe, stride_fk, stride_om, limit, HALF, 1, TWO, HAS_LIMIT,
                            AB, BM, BK, STAGES)),
            (_ws_producer, (a_desc, b_desc, b3_desc, a_s, b_s, b3_s, full, empty, row0, wrow0,
                            nk, TWO, BK, STAGES)),
        ], [4, 1], [232, 40])

    @gluon.jit
    def _gemm_ws_kernel(a_desc, b_desc, b3_desc, sa_ptr, f_ptr, f3_ptr, pair_ptr, bexp_ptr,
                        wt_ptr, out_ptr, P, N, e0, e1, stride_sam, stride_fe, stride_fk,
                        stride_om, limit, TWO: gl.constexpr, HAS_LIMIT: gl.constexpr,
                        K: gl.constexpr, AB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                        BK: gl.constexpr, STAGES: gl.constexpr, N_FIRST: gl.constexpr,
                        SKIP: gl.constexpr = False, PDL: gl.constexpr = False):
        """:func:`_gemm_kernel`'s tile warp-specialized: a TMA warp fills the ring, two
        consumer warpgroups (the default partition and a 4-warp worker) each multiply and
        rescale half of the BN columns, so one's rescale runs beside the other's wgmma.
        SKIP: row blocks of experts outside [e0, e1) return before setting up the ring
        (:data:`WS_SKIP`)."""
        grid_dependency_sync(PDL)
        blk, pid_n = _block_and_tile(N_FIRST)
        e = gl.load(bexp_ptr + blk)
        active = (e >= e0) & (e < e1)
        nk = gl.where(active, K // BK, 0)
        e_local = gl.where(active, e - e0, 0)
        row0 = blk * BM
        wrow0 = e_local * N + pid_n * BN
        if SKIP:
            # Blocks of other experts (the re-encoding's other chunks) leave before the ring.
            if active:
                _ws_tile(a_desc, b_desc, b3_desc, sa_ptr, f_ptr, f3_ptr, pair_ptr, wt_ptr,
                         out_ptr, e_local, P, N, row0, pid_n, wrow0, nk, stride_sam, stride_fe,
                         stride_fk, stride_om, limit, TWO, HAS_LIMIT, AB, BM, BN, BK, STAGES)
        else:
            _ws_tile(a_desc, b_desc, b3_desc, sa_ptr, f_ptr, f3_ptr, pair_ptr, wt_ptr, out_ptr,
                     e_local, P, N, row0, pid_n, wrow0, nk, stride_sam, stride_fe, stride_fk,
                     stride_om, limit, TWO, HAS_LIMIT, AB, BM, BN, BK, STAGES)


def qualifies(x: torch.Tensor, K: int, N: int, ks: int, plan: GluonGemmPlan) -> bool:
    """Whether the Gluon GEMMs can run this call: Gluon with its Hopper parts, a CUDA device of
    sm_90, K a multiple of the K step ``ks`` (128: the TMA box), N of the N tile."""
    if not (HAVE_GLUON and x.is_cuda and ks == 128):
        return False
    if torch.cuda.get_device_capability(x.device)[0] != 9:
        return False
    return K % ks == 0 and N % plan.BN == 0


def _desc(t: torch.Tensor, rows: int, box: list[int]) -> "TensorDescriptor":
    """A TMA descriptor over ``t`` viewed as [rows, K] e4m3 (K contiguous), box ``box``."""
    K = t.shape[-1]
    view = t.reshape(rows, K)
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.float8e4nv)
    return TensorDescriptor(view, [rows, K], [view.stride(0), 1], box, layout)


def gemm_up(xq: torch.Tensor, xs: torch.Tensor, q1: torch.Tensor, q3: torch.Tensor,
            f1: torch.Tensor, f3: torch.Tensor, pairs: torch.Tensor, block_expert: torch.Tensor,
            wts: torch.Tensor, act: torch.Tensor, P: int, e0: int, e1: int, limit: float,
            ab: int, ks: int, plan: GluonGemmPlan | None = None, n_first: bool = True
            ) -> None:
    """act[plan row] = w · swiglu(w1 x, w3 x) (bf16) for the row blocks of experts e0 <= e < e1
    (the Triton ``_fp8mma_up_kernel`` with ``PREDECODED``): xq [rows, D] e4m3 / xs [rows, D/ab]
    the prepped activation, q1 / q3 [chunk, I, D] e4m3 and f1 / f3 [chunk, D/ks, I] fp32 the
    weights' codes and step factors, rows of the plan's ``BM``-row blocks (``plan``: None for
    :data:`PLAN_UP`)."""
    plan = PLAN_UP if plan is None else plan
    chunk, inter, D = q1.shape
    nb = block_expert.shape[0]
    a_desc = _desc(xq, xq.shape[0], [plan.BM, ks])
    b_desc = _desc(q1, chunk * inter, [plan.BN, ks])
    b3_desc = _desc(q3, chunk * inter, [plan.BN, ks])
    grid, first = tile_grid(nb, inter // plan.BN, n_first=n_first)
    if plan.ws:
        _gemm_ws_kernel[grid](a_desc, b_desc, b3_desc, xs, f1, f3, pairs, block_expert, wts, act,
                              P, inter, e0, e1, xs.stride(0), f1.stride(0), f1.stride(1),
                              act.stride(0), float(limit), TWO=True, HAS_LIMIT=limit > 0, K=D,
                              AB=ab, BM=plan.BM, BN=plan.BN, BK=ks, STAGES=plan.stages,
                              N_FIRST=first, SKIP=WS_SKIP, num_warps=4, **pdl_args(xq))
        return
    _gemm_kernel[grid](a_desc, b_desc, b3_desc, xs, f1, f3, pairs, block_expert, wts, act, P,
                       inter, e0, e1, xs.stride(0),
                       f1.stride(0), f1.stride(1), act.stride(0), float(limit), TWO=True,
                       HAS_LIMIT=limit > 0, K=D, AB=ab, BM=plan.BM, BN=plan.BN, BK=ks,
                       STAGES=plan.stages, N_FIRST=first, LAG=plan.lag, WARPS=plan.warps,
                       num_warps=plan.warps, **pdl_args(xq))


def gemm_down(aq: torch.Tensor, as_: torch.Tensor, q2: torch.Tensor, f2: torch.Tensor,
              pairs: torch.Tensor, block_expert: torch.Tensor, y: torch.Tensor, P: int, e0: int,
              e1: int, ab: int, ks: int, plan: GluonGemmPlan | None = None,
              n_first: bool = True) -> None:
    """y[pair] = w2 · act[plan row] (bf16) for the row blocks of experts e0 <= e < e1 (the
    Triton ``_fp8mma_down_kernel`` with ``PREDECODED``): aq [rows, I] e4m3 / as_ [rows, I/ab],
    q2 [chunk, D, I] e4m3, f2 [chunk, I/ks, D] fp32 (``plan``: None for :data:`PLAN_DOWN`)."""
    plan = PLAN_DOWN if plan is None else plan
    chunk, D, inter = q2.shape
    nb = block_expert.shape[0]
    a_desc = _desc(aq, aq.shape[0], [plan.BM, ks])
    b_desc = _desc(q2, chunk * D, [plan.BN, ks])
    grid, first = tile_grid(nb, D // plan.BN, n_first=n_first)
    if plan.ws:
        _gemm_ws_kernel[grid](a_desc, b_desc, b_desc, as_, f2, f2, pairs, block_expert, pairs, y,
                              P, D, e0, e1, as_.stride(0), f2.stride(0), f2.stride(1),
                              y.stride(0), 0.0, TWO=False, HAS_LIMIT=False, K=inter, AB=ab,
                              BM=plan.BM, BN=plan.BN, BK=ks, STAGES=plan.stages, N_FIRST=first,
                              SKIP=WS_SKIP, num_warps=4, **pdl_args(aq))
        return
    _gemm_kernel[grid](a_desc, b_desc, b_desc, as_, f2, f2, pairs, block_expert, pairs, y, P,
                       D, e0, e1, as_.stride(0), f2.stride(0), f2.stride(1),
                       y.stride(0), 0.0, TWO=False, HAS_LIMIT=False, K=inter, AB=ab,
                       BM=plan.BM, BN=plan.BN, BK=ks, STAGES=plan.stages, N_FIRST=first,
                       LAG=plan.lag, WARPS=plan.warps, num_warps=plan.warps, **pdl_args(aq))
