"""The prefill experts' FP8 GEMMs on predecoded weights, written in Gluon so that each K step's
wgmma overlaps the rescale of the step before (dsv4 issue #5).

The Triton kernels of :mod:`dsv4.ops.triton_moe_fp8` (``_fp8mma_up_kernel`` /
``_fp8mma_down_kernel`` with ``PREDECODED``) do one FP8 dot per 128-wide K step and scale it
into the fp32 accumulator at once (the per-step activation and weight powers of two), so Triton
waits for every wgmma before the next is issued: the tensor cores idle while the scales are
applied and the next tiles are checked in.  Triton 3.6's automatic warp specialization hung on
these kernels (docs/PERFORMANCE.md, nineteenth session).  Gluon exposes the asynchronous
wgmma, so these kernels keep two fresh partial products in flight:

    step i:  cur  = wgmma(A_i, W_i)               (async, zero-initialized)
             prev = wait(1 outstanding)           (step i - 1's product is ready)
             acc  = fma(prev · sa_{i-1}, sw_{i-1}, acc)
             TMA-load step i + STAGES - 1 into the slot step i - 1 used
             prev = cur

The operands come through TMA into a ring of STAGES shared-memory slots (one mbarrier each).
The numerics are the Triton kernels' exactly: the same K = 128 FP8 products (the same wgmma
chain per step), the same fma per step and order of steps, the same epilogues (bf16 rounding
to nearest even, the clamped SwiGLU × routing weight) — so the GPU test asks for equal bits.

Gluon has no interpreter (triton 3.6): these kernels run only on an sm_90 GPU.  Their CPU checks
are the offline sm_90 compile (``tests/kernels/sm90_cases.py``) and the host-side argument
checks; the torch twin of the whole expert call is ``dsv4.ops.torch_dense.moe_experts``, and the
GPU test compares with the Triton kernels bit for bit.  They are used when :data:`GLUON_GEMMS`
(``DSV4_FP8MMA_GLUON=1``, off until measured faster on the H200).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

try:  # Gluon ships with triton >= 3.5; without it (or its NVIDIA parts) this path is off.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
                warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

__all__ = ["GLUON_GEMMS", "GluonPlan", "HAVE_GLUON", "gluon_down", "gluon_up"]

# triton_moe_fp8 runs its predecoded GEMMs here when set (and Gluon is importable).
GLUON_GEMMS = os.environ.get("DSV4_FP8MMA_GLUON", "0") == "1"


@dataclass(frozen=True)
class GluonPlan:
    """Tiles of the Gluon GEMMs: BM rows per block (the routing plan's), BN output columns,
    warps (4: one warp group over BM = 64; 8: two, split along N for BM = 64, along M for
    BM = 128), STAGES shared-memory slots of the TMA ring, K steps per loop iteration of each
    kernel (its K loop must be a multiple of it).  The default compiles for sm_90 without
    spills: up 254 registers, down 189."""

    BM: int = 64
    BN_up: int = 64
    BN_down: int = 128
    warps_up: int = 4
    warps_down: int = 8
    stages: int = 4
    unroll_up: int = 2
    unroll_down: int = 8

    def __post_init__(self) -> None:
        if self.BM not in (64, 128):
            raise ValueError(f"GluonPlan: BM must be 64 or 128; found {self.BM!r}")
        for name in ("BN_up", "BN_down"):
            v = getattr(self, name)
            if v not in (32, 64, 128, 256):
                raise ValueError(f"GluonPlan: {name} must be 32, 64, 128 or 256; found {v!r}")
        for name in ("warps_up", "warps_down"):
            if getattr(self, name) not in (4, 8):
                raise ValueError(f"GluonPlan: {name} must be 4 or 8; found "
                                 f"{getattr(self, name)!r}")
        if not isinstance(self.stages, int) or not 2 <= self.stages <= 8:
            raise ValueError(f"GluonPlan: stages must be 2..8; found {self.stages!r}")
        for name in ("unroll_up", "unroll_down"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"GluonPlan: {name} must be 1, 2, 4, 8 or 16; found "
                                 f"{getattr(self, name)!r}")


# DSV4_FP8MMA_GLUON_PLAN="BM,BN_up,BN_down,warps_up,warps_down,stages,unroll_up,unroll_down"
# overrides the default.
_PLAN_ENV = os.environ.get("DSV4_FP8MMA_GLUON_PLAN")
DEFAULT_PLAN = GluonPlan(*(int(v) for v in _PLAN_ENV.split(","))) if _PLAN_ENV else GluonPlan()


if HAVE_GLUON:

    @gluon.constexpr_function
    def _acc_layout(BM, BN, num_warps):
        wm = min(num_warps, BM // 16)
        wn = num_warps // wm
        # One wgmma instruction covers the warp's share of N (at most 256 columns).
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[wm, wn],
                                         instr_shape=[16, min(256, BN // wn), 32])

    @gluon.jit
    def _round_bf16(v):
        """fp32 rounded to bf16 precision (nearest, ties to even), kept in fp32: the Triton
        kernels' ``round_to_bf16``."""
        b = v.to(gl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(gl.float32, bitcast=True)

    @gluon.jit
    def _load_step(a_desc, w_desc, w2_desc, bar, a_buf, w_buf, w2_buf, row0, wrow0, k,
                   TWO: gl.constexpr):
        """TMA-load one K step (the activation tile and one or two weight tiles) into a slot."""
        if TWO:
            mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes
                            + w2_desc.block_type.nbytes)
        else:
            mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [row0, k], bar, a_buf)
        tma.async_copy_global_to_shared(w_desc, [wrow0, k], bar, w_buf)
        if TWO:
            tma.async_copy_global_to_shared(w2_desc, [wrow0, k], bar, w2_buf)

    @gluon.jit
    def _gl_down_kernel(a_desc, w_desc, sa_ptr, sw_ptr, pair_ptr, bexp_ptr, y_ptr, P, N, K,
                        e0, e1, stride_sam, stride_ym, stride_swe, stride_swk,
                        AB: gl.constexpr, KS: gl.constexpr, BM: gl.constexpr,
                        BN: gl.constexpr, STAGES: gl.constexpr, UNROLL: gl.constexpr,
                        num_warps: gl.constexpr):
        """y[pair] = w2 · act[row] (bf16) for the pairs of one row block and N tile: the
        contract of ``triton_moe_fp8._fp8mma_down_kernel`` with PREDECODED, the codes through
        TMA descriptors (act codes [rows, I], the chunk's w2 codes [chunk · D, I]).

        UNROLL steps a loop iteration, in straight-line code: step s + 1's wgmma is issued
        before step s's product is scaled in, and the iteration ends with none in flight
        (ptxas serializes every wgmma of a loop whose in-flight products cross the back
        edge: warning C7514).  K is a multiple of UNROLL · KS."""
        blk = gl.program_id(0)
        pid_n = gl.program_id(1)
        e = gl.load(bexp_ptr + blk)
        if (e >= e0) & (e < e1):
            ew = e - e0
            acc_l: gl.constexpr = _acc_layout(BM, BN, num_warps)
            row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
            col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
            a_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, KS], a_desc.layout)
            w_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, KS], w_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for st in gl.static_range(STAGES):
                mbarrier.init(bars.index(st), count=1)
            row0 = blk * BM
            wrow0 = ew * N + pid_n * BN
            nk = K // KS
            for st in gl.static_range(STAGES):
                if st < nk:
                    _load_step(a_desc, w_desc, w_desc, bars.index(st), a_s.index(st),
                               w_s.index(st), w_s.index(st), row0, wrow0, st * KS, False)
            rm = row0 + gl.arange(0, BM, layout=row_l)
            rn = pid_n * BN + gl.arange(0, BN, layout=col_l)
            sa_row = sa_ptr + rm.to(gl.int64) * stride_sam
            sw_col = sw_ptr + ew.to(gl.int64) * stride_swe + rn
            zero = gl.zeros([BM, BN], gl.float32, acc_l)
            acc = gl.zeros([BM, BN], gl.float32, acc_l)
            for i0 in range(0, nk, UNROLL):
                slot = i0 % STAGES
                mbarrier.wait(bars.index(slot), (i0 // STAGES) & 1)
                p = warpgroup_mma(a_s.index(slot), w_s.index(slot).permute((1, 0)), zero,
                                  use_acc=False, is_async=True)
                sa = gl.load(sa_row + (i0 * KS) // AB)
                sw = gl.load(sw_col + i0 * stride_swk)
                for u in gl.static_range(1, UNROLL + 1):
                    i = i0 + u            # the step issued now (UNROLL: none)
                    if u < UNROLL:
                        slot = i % STAGES
                        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
                        q = warpgroup_mma(a_s.index(slot), w_s.index(slot).permute((1, 0)),
                                          zero, use_acc=False, is_async=True)
                        sa_next = gl.load(sa_row + (i * KS) // AB)
                        sw_next = gl.load(sw_col + i * stride_swk)
                        d = warpgroup_mma_wait(num_outstanding=1, deps=(p,))
                    else:
                        d = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
                    acc = gl.fma(d * sa[:, None], sw[None, :], acc)
                    # Step i - 1 is done with its slot: refill it with step i - 1 + STAGES.
                    j = i - 1 + STAGES
                    if j < nk:
                        sj = j % STAGES
                        _load_step(a_desc, w_desc, w_desc, bars.index(sj), a_s.index(sj),
                                   w_s.index(sj), w_s.index(sj), row0, wrow0, j * KS, False)
                    if u < UNROLL:
                        p = q
                        sa = sa_next
                        sw = sw_next
            for st in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(st))
            pair = gl.load(pair_ptr + rm)
            m_mask = pair < P
            n_mask = rn < N
            y = _round_bf16(acc).to(gl.bfloat16)
            gl.store(y_ptr + pair.to(gl.int64)[:, None] * stride_ym + rn[None, :], y,
                     mask=m_mask[:, None] & n_mask[None, :])

    @gluon.jit
    def _gl_up_kernel(a_desc, w1_desc, w3_desc, sa_ptr, s1_ptr, s3_ptr, pair_ptr, bexp_ptr,
                      wt_ptr, act_ptr, P, N, K, e0, e1, stride_sam, stride_actm, stride_swe,
                      stride_swk, limit, HAS_LIMIT: gl.constexpr, AB: gl.constexpr,
                      KS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                      STAGES: gl.constexpr, UNROLL: gl.constexpr, num_warps: gl.constexpr):
        """act[row] = w · swiglu(w1 x, w3 x) (bf16) for the pairs of one row block and N tile:
        the contract of ``triton_moe_fp8._fp8mma_up_kernel`` with PREDECODED (x codes
        [rows, D], the chunk's w1 / w3 codes [chunk · I, D] through TMA descriptors).

        The products are a chain gate_0, up_0, gate_1, up_1, ...: each is scaled in while the
        next one runs, UNROLL steps an iteration in straight-line code, none in flight across
        the back edge (see the down kernel)."""
        blk = gl.program_id(0)
        pid_n = gl.program_id(1)
        e = gl.load(bexp_ptr + blk)
        if (e >= e0) & (e < e1):
            ew = e - e0
            acc_l: gl.constexpr = _acc_layout(BM, BN, num_warps)
            row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
            col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
            a_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, KS], a_desc.layout)
            g_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, KS], w1_desc.layout)
            u_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, KS], w3_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for st in gl.static_range(STAGES):
                mbarrier.init(bars.index(st), count=1)
            row0 = blk * BM
            wrow0 = ew * N + pid_n * BN
            nk = K // KS
            for st in gl.static_range(STAGES):
                if st < nk:
                    _load_step(a_desc, w1_desc, w3_desc, bars.index(st), a_s.index(st),
                               g_s.index(st), u_s.index(st), row0, wrow0, st * KS, True)
            rm = row0 + gl.arange(0, BM, layout=row_l)
            rn = pid_n * BN + gl.arange(0, BN, layout=col_l)
            sa_row = sa_ptr + rm.to(gl.int64) * stride_sam
            col_off = ew.to(gl.int64) * stride_swe + rn
            zero = gl.zeros([BM, BN], gl.float32, acc_l)
            acc1 = gl.zeros([BM, BN], gl.float32, acc_l)
            acc3 = gl.zeros([BM, BN], gl.float32, acc_l)
            for i0 in range(0, nk, UNROLL):
                slot = i0 % STAGES
                mbarrier.wait(bars.index(slot), (i0 // STAGES) & 1)
                p_gate = warpgroup_mma(a_s.index(slot), g_s.index(slot).permute((1, 0)), zero,
                                       use_acc=False, is_async=True)
                for u in gl.static_range(UNROLL):
                    i = i0 + u
                    slot = i % STAGES
                    sa = gl.load(sa_row + (i * KS) // AB)
                    s1 = gl.load(s1_ptr + col_off + i * stride_swk)
                    s3 = gl.load(s3_ptr + col_off + i * stride_swk)
                    p_up = warpgroup_mma(a_s.index(slot), u_s.index(slot).permute((1, 0)), zero,
                                         use_acc=False, is_async=True)
                    d_gate = warpgroup_mma_wait(num_outstanding=1, deps=(p_gate,))
                    acc1 = gl.fma(d_gate * sa[:, None], s1[None, :], acc1)
                    if u + 1 < UNROLL:
                        nslot = (i + 1) % STAGES
                        mbarrier.wait(bars.index(nslot), ((i + 1) // STAGES) & 1)
                        p_gate = warpgroup_mma(a_s.index(nslot),
                                               g_s.index(nslot).permute((1, 0)), zero,
                                               use_acc=False, is_async=True)
                        d_up = warpgroup_mma_wait(num_outstanding=1, deps=(p_up,))
                    else:
                        d_up = warpgroup_mma_wait(num_outstanding=0, deps=(p_up,))
                    acc3 = gl.fma(d_up * sa[:, None], s3[None, :], acc3)
                    # Step i is done with its slot: refill it with step i + STAGES.
                    j = i + STAGES
                    if j < nk:
                        _load_step(a_desc, w1_desc, w3_desc, bars.index(slot), a_s.index(slot),
                                   g_s.index(slot), u_s.index(slot), row0, wrow0, j * KS, True)
            for st in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(st))
            pair = gl.load(pair_ptr + rm)
            m_mask = pair < P
            n_mask = rn < N
            wt = gl.load(wt_ptr + pair, mask=m_mask, other=0.0)
            # weighted_swiglu of triton_moe: g, u rounded to bf16 first, the V4 clamp.
            g = _round_bf16(acc1)
            u = _round_bf16(acc3)
            if HAS_LIMIT:
                u = gl.minimum(gl.maximum(u, -limit), limit)
                g = gl.minimum(g, limit)
            a = g * (1 / (1 + gl.exp(-g))) * u * wt[:, None]   # tl.sigmoid's form
            gl.store(act_ptr + rm.to(gl.int64)[:, None] * stride_actm + rn[None, :],
                     _round_bf16(a).to(gl.bfloat16), mask=m_mask[:, None] & n_mask[None, :])


def _desc(t: torch.Tensor, block: list[int]) -> "TensorDescriptor":
    """A TMA descriptor of a 2-D e4m3 tensor with the wgmma operand's swizzled layout."""
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def _check(ks: int, unroll: int, *tensors: torch.Tensor) -> None:
    if not HAVE_GLUON:
        raise RuntimeError("gluon_moe_fp8: this triton has no Gluon (needs triton >= 3.5)")
    if ks != 128:
        raise ValueError(f"gluon_moe_fp8: needs the K step 128 (one act block of V4); found {ks}")
    if tensors[0].shape[1] % (unroll * ks):
        raise ValueError(f"gluon_moe_fp8: K = {tensors[0].shape[1]} must be a multiple of "
                         f"{unroll * ks} ({unroll} steps per loop iteration)")
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            raise ValueError("gluon_moe_fp8: TMA operands must be 16-byte aligned with "
                             "contiguous rows")


def gluon_down(aq: torch.Tensor, as_: torch.Tensor, q2: torch.Tensor, f2: torch.Tensor,
               pairs: torch.Tensor, block_expert: torch.Tensor, y: torch.Tensor, P: int,
               e0: int, e1: int, ab: int, ks: int, plan: GluonPlan | None = None) -> None:
    """The down GEMM of experts e0 <= e < e1 on predecoded codes: y[pair] = w2 · act[row].

    aq [rows, I] e4m3 and as_ [rows, I / ab] fp32: the prepped activation in the plan's rows;
    q2 [chunk, D, I] e4m3 and f2 [chunk, I / ks, D] fp32: the chunk's re-encoded w2;
    y [P, D] bf16."""
    plan = plan or DEFAULT_PLAN
    _check(ks, plan.unroll_down, aq, q2)
    chunk, D, inter = q2.shape
    a_desc = _desc(aq, [plan.BM, ks])
    w_desc = _desc(q2.view(chunk * D, inter), [plan.BN_down, ks])
    grid = (block_expert.shape[0], triton.cdiv(D, plan.BN_down))
    _gl_down_kernel[grid](a_desc, w_desc, as_, f2, pairs, block_expert, y, P, D, inter, e0, e1,
                          as_.stride(0), y.stride(0), f2.stride(0), f2.stride(1), AB=ab, KS=ks,
                          BM=plan.BM, BN=plan.BN_down, STAGES=plan.stages, UNROLL=plan.unroll_down,
                          num_warps=plan.warps_down)


def gluon_up(xq: torch.Tensor, xs: torch.Tensor, q1: torch.Tensor, q3: torch.Tensor,
             f1: torch.Tensor, f3: torch.Tensor, pairs: torch.Tensor,
             block_expert: torch.Tensor, wts: torch.Tensor, act: torch.Tensor, P: int, e0: int,
             e1: int, ab: int, ks: int, swiglu_limit: float,
             plan: GluonPlan | None = None) -> None:
    """The gate / up GEMMs of experts e0 <= e < e1 on predecoded codes with the SwiGLU
    epilogue: act[row] = w · swiglu(w1 x, w3 x).

    xq [rows, D] e4m3 and xs [rows, D / ab] fp32: the prepped tokens in the plan's rows;
    q1, q3 [chunk, I, D] e4m3 and f1, f3 [chunk, D / ks, I] fp32: the chunk's re-encoded w1,
    w3; wts [P] fp32 routing weights; act [rows, I] bf16."""
    plan = plan or DEFAULT_PLAN
    _check(ks, plan.unroll_up, xq, q1, q3)
    if f1.stride() != f3.stride():
        raise ValueError("gluon_up: f1 / f3 must share their strides")
    chunk, inter, D = q1.shape
    a_desc = _desc(xq, [plan.BM, ks])
    w1_desc = _desc(q1.view(chunk * inter, D), [plan.BN_up, ks])
    w3_desc = _desc(q3.view(chunk * inter, D), [plan.BN_up, ks])
    grid = (block_expert.shape[0], triton.cdiv(inter, plan.BN_up))
    _gl_up_kernel[grid](a_desc, w1_desc, w3_desc, xs, f1, f3, pairs, block_expert, wts, act, P,
                        inter, D, e0, e1, xs.stride(0), act.stride(0), f1.stride(0),
                        f1.stride(1), float(swiglu_limit), HAS_LIMIT=swiglu_limit > 0, AB=ab,
                        KS=ks, BM=plan.BM, BN=plan.BN_up, STAGES=plan.stages,
                        UNROLL=plan.unroll_up,
                        num_warps=plan.warps_up)
