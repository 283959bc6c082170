"""Prefill expert GEMMs straight on the MXFP4 stacks, the codes decoded on the fly (Gluon,
sm_90; dsv4 issue #5).

Without kept FP8 codes, the FP8-MMA prefill path (:mod:`dsv4.ops.triton_moe_fp8`) first
re-encodes every chunk of experts to e4m3 codes and step factors (``_fp8_predecode_kernel``:
3.2 GB of MXFP4 read and 6.4 GB of codes written per V4-Flash layer, read again by the GEMMs).
These kernels skip that pass: the weights are the M side of the wgmma (64 rows a warpgroup),
loaded as packed bytes into the registers of their A fragments and scale-folded to e4m3 there
(the re-encoding's own ``prmt`` decode: :data:`~dsv4.ops.triton_moe_fp8._E2M1_TO_E4M3_ASM`,
the same bytes); the plan's rows (the pairs' activation codes) are the N side, a shared-memory
ring filled by TMA.  Per 128-wide K step: four chained ``m64nBMk32`` products (one per 32-group)
for each weight, waited for, then ``fma(d · sa, f, acc)`` in fp32, the Triton kernels'
operation, with f the step factor 2^(smax − 6 − 127) of each weight row (the re-encoding's).

Three forms (:class:`MxPlan`): the plain kernel (:func:`_gemm_mx_kernel`, the default down
GEMM: each warpgroup decodes its own A fragments in registers), one with a decode warpgroup
(:func:`_gemm_mx_dec_kernel`: one warpgroup decodes each K step's w1 and w3 tiles into shared
memory, the A operand of two consumer warpgroups of 64 plan rows each), and its persistent
form (:func:`_gemm_mx_pdec_kernel`, the default up GEMM: one program an SM walking the tiles,
the weight tiles brought by TMA, chained products; 3-7% faster than the non-persistent form;
every persistent down form is slower than the plain kernel: docs/PERFORMANCE.md,
thirty-seventh and thirty-eighth sessions).  (Two consumer warpgroups each decoding w1 or w3
of the same rows measured 4% slower than the decode warpgroup for up and the same as the
plain kernel for down: removed, the code is at commit c05b8e5.)

The MMA column order differs from the Triton kernels' (:func:`mx_k_position`): in each 32-group,
column 16h + 4q + i holds natural column 8q + 4h + i, so the activation codes are prepped in
that order (``_fp8_prep_kernel`` with ``ORDER=1``).  Each k32 product sums the same 32 products
as the Triton kernels', in another order inside the instruction, and the tensor cores' sum does
not depend on that order: every form gives the re-encoded path's bits (the GPU test).

Gluon has no interpreter (triton 3.6): the kernels run on sm_90 GPUs only and are compiled
offline for sm_90 by the CPU tests.  On by default (:data:`MX_PREFILL`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import torch

from dsv4.ops import gluon_moe_prefill as _gp
from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.triton_dense import sm_count
from dsv4.ops.triton_moe import tile_grid
from dsv4.ops.triton_moe_fp8 import _FOLD, _FOLD_UP_C, _pow2_exact

HAVE_GLUON = _gp.HAVE_GLUON
if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

    from dsv4.ops.gluon_moe_decode import _byte_layout

__all__ = ["MX_PREFILL", "MxPlan", "PLAN_UP", "PLAN_DOWN", "PLAN_UP_SMALL", "PLAN_DOWN_SMALL",
           "SMALL_PAIRS", "plans_for", "gemm_up", "gemm_down",
           "mx_k_position", "parse_plan", "qualifies"]

# Expert calls without kept codes run these GEMMs on the MXFP4 stacks, with no re-encoding
# pass (DSV4_FP8MMA_MX, default on; 0: the re-encoding).  H100, V4-Flash, 256 experts
# (docs/PERFORMANCE.md, thirty-sixth session), the same bits: the expert call 7.5 against
# 9.9 ms at 8K tokens, 3.9 against 7.6 at 4K, 24.8 against 24.6 at 32K; the 4-layer prefill
# 62.0 against 72.4 ms at 8K, 242 against 245 at 32K.
MX_PREFILL = os.environ.get("DSV4_FP8MMA_MX", "1") == "1"

STEP = 128   # the K step (the act block of V4; one activation scale per row and step)


def mx_k_position(k: torch.Tensor | int) -> torch.Tensor | int:
    """Column of natural K index k in these kernels' MMA order: inside each 32-group, natural
    8q + 4h + i (q, i < 4; h < 2) sits at 16h + 4q + i (lane q's 4 packed bytes decode to the
    codes 8q..8q+3 and 8q+4..8q+7, the two halves of its A fragment)."""
    r = k % 32
    return k - r + 16 * ((r // 4) % 2) + 4 * (r // 8) + r % 4


@dataclass(frozen=True)
class MxPlan:
    """Tile plan of one GEMM: BM plan rows (the wgmma N side; the plan's row blocks), warps
    (4: one warpgroup, 8: two, stacked on the weight rows), ``mt`` 64-row weight tiles a
    warpgroup (BN = 16 · warps · mt weight rows a program), ``stages`` activation slots;
    ``dec``: a decode warpgroup of ``dregs`` registers feeding two consumer warpgroups of
    ``regs``, BM / 2 rows each (:func:`_gemm_mx_dec_kernel`; BM 128 or 256, 64 weight rows);
    ``persist``: that form with about one program an SM walking the tiles
    (:func:`_gemm_mx_pdec_kernel`), its consumers chaining ``chain`` steps' products a loop
    turn when > 0 (:func:`_p_consumer_chain`), its weight tiles brought by TMA
    (:func:`_p_producer`, :func:`_p_decoder`)."""

    BM: int = 64
    warps: int = 4
    mt: int = 1
    stages: int = 3
    dec: bool = False
    regs: int | None = None
    dregs: int | None = None
    persist: bool = False
    chain: int = 0

    def __post_init__(self) -> None:
        if (self.BM not in (32, 64, 128, 256) or (self.BM == 256 and not self.dec)
                or self.warps not in (4, 8) or self.mt not in (1, 2)):
            raise ValueError(f"MxPlan: BM 32/64/128 (256 with dec), warps 4/8, mt 1/2; found "
                             f"{self}")
        if not 2 <= self.stages <= 6:
            raise ValueError(f"MxPlan: stages must be 2..6; found {self.stages}")
        given = [r for r in (self.regs, self.dregs) if r is not None]
        if self.dec and (self.warps != 4 or self.mt != 1 or self.BM not in (128, 256)
                         or any(r % 8 or not 24 <= r <= 256 for r in given)):
            raise ValueError(f"MxPlan: dec takes BM 128 / 256, 4 warps a consumer, mt 1, regs "
                             f"and dregs multiples of 8 in 24..256; found {self}")
        if ((self.persist and not self.dec) or (self.chain and not self.persist)
                or self.chain not in (0, 1, 2, 4, 8)):
            raise ValueError(f"MxPlan: persist needs dec; chain (1, 2, 4, 8 steps) needs "
                             f"persist; found {self}")

    def registers(self, two: bool) -> tuple[int, int]:
        """(consumer, decoder) registers a thread of the decode-warpgroup forms.  The default
        consumer partition gets what the workers leave of the 64K (the load warp counts as a
        warpgroup of 40): 168 beside 192 / 112.  The persistent forms balance the two
        consumers (up: 184 / 104; down: 176 / 112), where their chained products compile
        without spills (offline sm_90 compile)."""
        if self.persist:
            regs, dregs = (184, 104) if two else (176, 112)
        else:
            regs, dregs = 192, 112
        return (self.regs if self.regs is not None else regs,
                self.dregs if self.dregs is not None else dregs)

    @property
    def BN(self) -> int:
        """Weight rows a program: 16 · warps · mt; 64 with a decode warpgroup (for the up GEMM,
        those rows of w1 and of w3)."""
        return 64 if self.dec else 16 * self.warps * self.mt


# The fastest plans of bench/moe_gluon_mx.py (H100, 8K / 16K / 32K tokens, 256 experts;
# docs/PERFORMANCE.md, thirty-sixth and thirty-eighth sessions): 128-row blocks (each decoded
# weight feeds 128 rows); the up GEMM with a decode warpgroup (w1 and w3 decoded once into
# shared memory for two consumer warpgroups of 64 rows), persistent, TMA-fed, two steps'
# products chained (the non-persistent form 3-7% slower, the 4-layer 8K prefill 1% slower);
# the down GEMM plain with 4 stages (3: 2-6% slower; its decode-warpgroup forms, persistent
# ones included, slower).
PLAN_UP = MxPlan(BM=128, stages=4, dec=True, persist=True, chain=2)
PLAN_DOWN = MxPlan(BM=128, stages=4)
# Calls of few pairs an expert (the engine's 2,048-token steps: 48 for V4-Flash) fill one
# 64-row block an expert where a 128-row block would be mostly padding: the plain kernels on
# 64-row blocks, up to SMALL_PAIRS pairs an expert (H100, 256 experts, 2K tokens: up 1,377
# against 2,027 µs, down 704 against 1,101, the call 2,243 against 3,345; at 3K tokens, 72
# pairs, the 128-row plans win: docs/PERFORMANCE.md, thirty-ninth session).  Where the bf16
# kernels take over: triton_moe_fp8.MIN_PAIRS_MX / MIN_PAIRS_MX_WIDE.
PLAN_UP_SMALL = MxPlan(BM=64, stages=4)
PLAN_DOWN_SMALL = MxPlan(BM=64, stages=4)
SMALL_PAIRS = 56


def parse_plan(text: str) -> MxPlan:
    """``BM:warps:mt:stages[:FORM]`` -> the plan; FORM ``dec``: the decode-warpgroup form;
    ``pdec[N]``: its persistent form (weight tiles brought by TMA), with N steps' products
    chained a loop turn."""
    parts = text.split(":")
    form = parts[4] if len(parts) == 5 else ""
    m = re.fullmatch(r"pdec(\d*)", form)
    if len(parts) not in (4, 5) or not all(p.isdigit() for p in parts[:4]) or not (
            form in ("", "dec") or m):
        raise ValueError(f"MxPlan: bad plan {text!r} (BM:warps:mt:stages[:dec|:pdec[N]])")
    BM, warps, mt, stages = (int(v) for v in parts[:4])
    return MxPlan(BM=BM, warps=warps, mt=mt, stages=stages, dec=form != "",
                  persist=m is not None, chain=int(m.group(1) or 0) if m else 0)


# DSV4_FP8MMA_MX_PLANS="UP,DOWN" (parse_plan's form) replaces the default plans, and
# DSV4_FP8MMA_MX_SMALL_PLANS the small calls' ones, for A/B runs.
if os.environ.get("DSV4_FP8MMA_MX_PLANS"):
    PLAN_UP, PLAN_DOWN = (parse_plan(t) for t in os.environ["DSV4_FP8MMA_MX_PLANS"].split(","))
if os.environ.get("DSV4_FP8MMA_MX_SMALL_PLANS"):
    PLAN_UP_SMALL, PLAN_DOWN_SMALL = (
        parse_plan(t) for t in os.environ["DSV4_FP8MMA_MX_SMALL_PLANS"].split(","))


def plans_for(pairs: int, experts: int) -> tuple[MxPlan, MxPlan]:
    """The (up, down) plans of a call of ``pairs`` (token, pick) pairs over ``experts`` local
    experts: the small calls' 64-row plans up to :data:`SMALL_PAIRS` pairs an expert (the
    mean: no host sync), the default ones beyond."""
    if pairs <= SMALL_PAIRS * max(experts, 1):
        return PLAN_UP_SMALL, PLAN_DOWN_SMALL
    return PLAN_UP, PLAN_DOWN


if HAVE_GLUON:

    # The re-encoding's decode (triton_moe_fp8._E2M1_TO_E4M3_ASM: the same bytes) on whole
    # words, in fewer instructions: each instance gets 4 copies of one int32 of packed bytes
    # ($2..$5: 8 e2m1 codes, natural order) and of the group's exponent add v · 0x01010101
    # ($6..$9), the same registers, and leaves the codes 0..3 in $0 and 4..7 in $1 (the A
    # fragment's registers).  The tables {0, 8, 16, 20 | 24, 28, 32, 36} (e4m3 of e2m1 · 2^-5)
    # get v added once ({0, v, v, v | v, v, v, v}: magnitude 0 stays 0; bytes stay below 0x80),
    # so one prmt per 4 codes gives magnitude + v; the signs (nibble bit 3) pick 0x00 / 0x80
    # from a third prmt.  prmt reads the low 16 bits of its selector: the masks serve both
    # halves.  (Bytes in, the compiler split each loaded word into bytes and packed them again:
    # 10 instructions a call.)
    _ASM_WORDS = gl.constexpr("""{
    .reg .b32 tl, th, sel, s, t, sg;
    mov.b32 sg, 0x00008000;
    and.b32 tl, $6, 0xFFFFFF00;
    add.u32 tl, tl, 0x14100800;
    add.u32 th, $6, 0x24201C18;
    and.b32 sel, $2, 0x77777777;
    shr.b32 s, $2, 3;
    and.b32 s, s, 0x11111111;
    prmt.b32 $0, tl, th, sel;
    prmt.b32 t, sg, 0, s;
    or.b32 $0, $0, t;
    shr.b32 sel, sel, 16;
    shr.b32 s, s, 16;
    prmt.b32 $1, tl, th, sel;
    prmt.b32 t, sg, 0, s;
    or.b32 $1, $1, t;
    }""")

    _WORD_ASM = """
    and.b32 sel, {w}, 0x77777777;
    shr.b32 s, {w}, 3;
    and.b32 s, s, 0x11111111;
    prmt.b32 {lo}, tl, th, sel;
    prmt.b32 t, sg, 0, s;
    or.b32 {lo}, {lo}, t;
    shr.b32 sel, sel, 16;
    shr.b32 s, s, 16;
    prmt.b32 {hi}, tl, th, sel;
    prmt.b32 t, sg, 0, s;
    or.b32 {hi}, {hi}, t;"""
    # _ASM_WORDS on a row's whole group (four distinct words, $8..$11; its exponent add in
    # $12, $13..$15 equal copies): outputs $2w / $2w + 1 hold word w's codes 0..3 / 4..7.
    # For words read from shared memory as they lie (the TMA-fed decoder).
    _ASM_GROUP = gl.constexpr("{\n    .reg .b32 tl, th, sel, s, t, sg;\n"
                              "    mov.b32 sg, 0x00008000;\n"
                              "    and.b32 tl, $12, 0xFFFFFF00;\n"
                              "    add.u32 tl, tl, 0x14100800;\n"
                              "    add.u32 th, $12, 0x24201C18;"
                              + "".join(_WORD_ASM.format(w=f"${8 + w}", lo=f"${2 * w}",
                                                         hi=f"${2 * w + 1}")
                                        for w in range(4))
                              + "\n    }")

    @gluon.jit
    def _load_step(w_base, s_base, c, N: gl.constexpr):
        """K step c of the program's weight rows (K-chunk-major: [K / 128, N, 64] bytes and
        [K / 128, N, 4] scales an expert): group by group, each lane's word of packed bytes
        (int32 [BN, 16] in the A fragments' byte layout, 4 equal elements a lane: one load),
        and each row's four scale bytes as one int32."""
        w = (w_base + c * (N * 64)).to(gl.pointer_type(gl.int32), bitcast=True)
        return (gl.load(w), gl.load(w + 4), gl.load(w + 8), gl.load(w + 12),
                gl.load((s_base + c * (N * 4)).to(gl.pointer_type(gl.int32), bitcast=True)))

    @gluon.jit
    def _smax(sw):
        """The largest of the four biased group exponents packed in each int32."""
        return gl.maximum(gl.maximum(sw & 255, (sw >> 8) & 255),
                          gl.maximum((sw >> 16) & 255, (sw >> 24) & 255))

    @gluon.jit
    def _decode_group(word, v, BN: gl.constexpr, a_l: gl.constexpr):
        """Packed words of one 32-group ([BN, 16], 4 copies a lane) and its exponent add v [BN]
        (8 · (11 − d)) -> the scale-folded e4m3 codes [BN, 32] in the A operand layout (MMA
        column order of :func:`mx_k_position`)."""
        vw = gl.broadcast((v * 0x01010101)[:, None], word)[0]
        first, second = gl.inline_asm_elementwise(_ASM_WORDS, "=r,=r,r,r,r,r,r,r,r,r",
                                                  [word, vw], dtype=(gl.uint8, gl.uint8),
                                                  is_pure=True, pack=4)
        codes = gl.reshape(gl.permute(gl.reshape(gl.join(first, second), [BN, 4, 4, 2]),
                                      [0, 3, 1, 2]), [BN, 32])
        return gl.convert_layout(codes.to(gl.float8e4nv, bitcast=True), a_l,
                                 assert_trivial=True)

    @gluon.jit
    def _step_product(b0, b1, b2, b3, sw, smax, x, zero, BN: gl.constexpr, a_l: gl.constexpr):
        """One K step's product of the weight rows (packed words b0..b3 per group, scale words
        sw, their largest exponents smax) with the activation tile x [BM, 128] in shared
        memory: four chained asynchronous k32 products, each group's exponent add folded into
        its codes."""
        d = warpgroup_mma(_decode_group(b0, gl.maximum(_FOLD - (smax - (sw & 255)), 0) * 8,
                                        BN, a_l),
                          x.slice(0, 32, dim=1).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        d = warpgroup_mma(_decode_group(b1, gl.maximum(_FOLD - (smax - ((sw >> 8) & 255)), 0)
                                        * 8, BN, a_l),
                          x.slice(32, 32, dim=1).permute((1, 0)), d, is_async=True)
        d = warpgroup_mma(_decode_group(b2, gl.maximum(_FOLD - (smax - ((sw >> 16) & 255)), 0)
                                        * 8, BN, a_l),
                          x.slice(64, 32, dim=1).permute((1, 0)), d, is_async=True)
        return warpgroup_mma(_decode_group(b3, gl.maximum(_FOLD - (smax - ((sw >> 24) & 255)),
                                                          0) * 8, BN, a_l),
                             x.slice(96, 32, dim=1).permute((1, 0)), d, is_async=True)

    @gluon.jit
    def _factor(smax, row_l: gl.constexpr):
        """The step factor 2^(smax − 6 − 127) of each weight row (fp32, accumulator rows)."""
        return _pow2_exact(gl.convert_layout(smax, row_l) - _FOLD_UP_C)

    @gluon.jit
    def _issue_x(x_desc, x_s, bars, step, row0, pred, STAGES: gl.constexpr):
        """TMA load of K step ``step`` of the block's activation rows into its slot."""
        slot = step % STAGES
        mbarrier.expect(bars.index(slot), x_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(x_desc, [row0, step * 128], bars.index(slot),
                                        x_s.index(slot), pred)

    @gluon.jit
    def _scales_to_shared(xs_ptr, row0, stride_xsm, AB: gl.constexpr, BM: gl.constexpr,
                          NK: gl.constexpr, WARPS: gl.constexpr):
        """The row block's activation scales [BM, NK] into shared memory once, step-major
        (each step then reads its column there: in registers, the accumulator layout holds 16
        columns a thread, and their pointers alone would take 32 registers)."""
        xs_l: gl.constexpr = gl.BlockedLayout([1, 1], [32 // NK if NK < 32 else 1,
                                                       NK if NK < 32 else 32],
                                              [WARPS, 1], [1, 0])
        rx = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, xs_l))
        kx = gl.arange(0, NK, layout=gl.SliceLayout(0, xs_l))
        sa_all = gl.load(xs_ptr + rx.to(gl.int64)[:, None] * stride_xsm
                         + ((kx * 128) // AB)[None, :])
        sa_s = gl.allocate_shared_memory(gl.float32, [NK, BM],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        sa_s.store(gl.permute(sa_all, [1, 0]))
        gl.thread_barrier()
        # The same bytes as NK rows of BM, to index by step.
        return sa_s._reinterpret(gl.float32, [NK, BM],
                                 gl.SwizzledSharedLayout(1, 1, 1, order=[0]))

    @gluon.jit
    def _epilogue(acc, acc3, row0, n0, pair_ptr, wt_ptr, out_ptr, P, N, stride_om, limit,
                  TWO: gl.constexpr, HAS_LIMIT: gl.constexpr, BM: gl.constexpr,
                  BN: gl.constexpr, WARPS: gl.constexpr):
        """The transposed sums [BN, BM] as [BM, BN] in a layout that stores whole rows of
        columns, through the Triton kernels' epilogue (gluon_moe_prefill._store_tile)."""
        out_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
        out = gl.convert_layout(gl.permute(acc, [1, 0]), out_l)
        out3 = gl.convert_layout(gl.permute(acc3, [1, 0]), out_l)
        rm = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, out_l))
        rn = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, out_l))
        _gp._store_tile(out, out3, rm, rn, pair_ptr, wt_ptr, out_ptr, P, N, stride_om, limit,
                        TWO, HAS_LIMIT)

    @gluon.jit
    def _gemm_mx_kernel(x_desc, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, pair_ptr, bexp_ptr,
                        wt_ptr, out_ptr, P, E, stride_xsm, stride_we, stride_se, stride_om,
                        limit, N: gl.constexpr, K: gl.constexpr, TWO: gl.constexpr,
                        HAS_LIMIT: gl.constexpr, AB: gl.constexpr, BM: gl.constexpr,
                        WARPS: gl.constexpr, MT: gl.constexpr, STAGES: gl.constexpr,
                        N_FIRST: gl.constexpr,
                        PDL: gl.constexpr = False):
        """One (row block, N tile) of the up (TWO: w1 and w3; act = w · swiglu stored per plan
        row) or down (y stored per pair) GEMM on K-chunk-major MXFP4 stacks: BN weight rows
        × BM plan rows, accumulated transposed ([BN, BM]) and stored through the Triton
        kernels' epilogue (:func:`dsv4.ops.gluon_moe_prefill._store_tile`)."""
        grid_dependency_sync(PDL)
        blk, pid_n = _gp._block_and_tile(N_FIRST)
        e = gl.load(bexp_ptr + blk)
        if (e >= 0) & (e < E):
            BN: gl.constexpr = 16 * WARPS * MT
            NK: gl.constexpr = K // 128
            BYTE_L: gl.constexpr = _byte_layout(WARPS, MT)
            acc_l: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BM, 32])
            a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
            x_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, 128], x_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(STAGES):
                mbarrier.init(bars.index(s), count=1)
            row0 = blk * BM
            for s in gl.static_range(STAGES - 1):
                _issue_x(x_desc, x_s, bars, s, row0, s < NK, STAGES)
            e64 = e.to(gl.int64)
            rb = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, BYTE_L))
            cb = gl.arange(0, 16, layout=gl.SliceLayout(0, BYTE_L))
            # Byte offsets of each lane's word (4 equal elements a lane: one load).
            w_off = e64 * stride_we + rb[:, None] * 64 + (cb - cb % 4)[None, :]
            sb_off = e64 * stride_se + rb * 4
            row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
            sa_s = _scales_to_shared(xs_ptr, row0, stride_xsm, AB, BM, NK, WARPS)
            zero = gl.zeros([BN, BM], gl.float32, acc_l)
            acc = zero
            acc3 = zero
            a0, a1, a2, a3, asw = _load_step(w1_ptr + w_off, s1_ptr + sb_off, 0, N)
            b0, b1, b2, b3, bsw = _load_step(w3_ptr + w_off, s3_ptr + sb_off, 0, N)
            for i in range(NK):
                slot = i % STAGES
                mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
                # Step i - 1's slot is free (its products were waited for).
                nxt = i + STAGES - 1
                _issue_x(x_desc, x_s, bars, nxt, row0, nxt < NK, STAGES)
                x = x_s.index(slot)
                smax1 = _smax(asw)
                d = _step_product(a0, a1, a2, a3, asw, smax1, x, zero, BN, a_l)
                if TWO:
                    smax3 = _smax(bsw)
                    d3 = _step_product(b0, b1, b2, b3, bsw, smax3, x, zero, BN, a_l)
                    b0, b1, b2, b3, bsw_next = _load_step(w3_ptr + w_off, s3_ptr + sb_off,
                                                          gl.minimum(i + 1, NK - 1), N)
                # This step's packed bytes are decoded: the next step's take their registers
                # and load while the products run (the last step loads itself again, unread).
                a0, a1, a2, a3, asw_next = _load_step(w1_ptr + w_off, s1_ptr + sb_off,
                                                      gl.minimum(i + 1, NK - 1), N)
                sa = sa_s.index(i).load(gl.SliceLayout(0, acc_l))[None, :]
                f1 = _factor(smax1, row_l)
                if TWO:
                    # w1's products are done while w3's run (4 groups outstanding).
                    done = warpgroup_mma_wait(num_outstanding=4, deps=(d,))
                    acc = gl.fma(done * sa, f1[:, None], acc)
                    f3 = _factor(smax3, row_l)
                    done3 = warpgroup_mma_wait(num_outstanding=0, deps=(d3,))
                    acc3 = gl.fma(done3 * sa, f3[:, None], acc3)
                    bsw = bsw_next
                else:
                    done = warpgroup_mma_wait(num_outstanding=0, deps=(d,))
                    acc = gl.fma(done * sa, f1[:, None], acc)
                asw = asw_next
            for s in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(s))
            _epilogue(acc, acc3, row0, pid_n * BN, pair_ptr, wt_ptr, out_ptr, P, N, stride_om,
                      limit, TWO, HAS_LIMIT, BM, BN, WARPS)

    @gluon.jit
    def _x_producer(x_desc, x_s, full, empty, row0, NK: gl.constexpr, STAGES: gl.constexpr):
        """The TMA warp: step i's activation tile into slot i % STAGES once both consumers
        released the slot's previous step."""
        for i in range(NK):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
            mbarrier.expect(full.index(slot), x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [row0, i * 128], full.index(slot),
                                            x_s.index(slot))

    # -------------------------------------------------------------- decode partition form
    @gluon.jit
    def _dec_load(w_base, s_base, c, N: gl.constexpr):
        """K step c of the decoder's 64 weight rows: [64, 64] int32, each lane's packed words
        of one (row, group) as 4 copies each (one load a word), and the rows' scale words."""
        w = (w_base + c * (N * 64)).to(gl.pointer_type(gl.int32), bitcast=True)
        return (gl.load(w),
                gl.load((s_base + c * (N * 4)).to(gl.pointer_type(gl.int32), bitcast=True)))

    @gluon.jit
    def _dec_tile(words, sw, shift):
        """One K step of 64 weight rows decoded: (e4m3 codes [64, 128] in the order of
        :func:`mx_k_position`, each row's fp32 step factor [64])."""
        smax = _smax(sw)
        v = gl.maximum(_FOLD - (smax[:, None] - ((sw[:, None] >> shift[None, :]) & 255)), 0) * 8
        first, second = gl.inline_asm_elementwise(_ASM_WORDS, "=r,=r,r,r,r,r,r,r,r,r",
                                                  [words, v * 0x01010101],
                                                  dtype=(gl.uint8, gl.uint8), is_pure=True,
                                                  pack=4)
        # (row, 16g + 4q + b, h) -> column 32g + 16h + 4q + b.
        codes = gl.reshape(gl.permute(gl.reshape(gl.join(first, second), [64, 4, 4, 4, 2]),
                                      [0, 1, 4, 2, 3]), [64, 128])
        return codes.to(gl.float8e4nv, bitcast=True), _pow2_exact(smax - _FOLD_UP_C)

    @gluon.jit
    def _dec_tile_group(words, sw, shift):
        """:func:`_dec_tile` on words as they lie ([64, 16] int32, a thread a row's group of
        four), one asm instance a (row, group)."""
        smax = _smax(sw)
        v = gl.maximum(_FOLD - (smax[:, None] - ((sw[:, None] >> shift[None, :]) & 255)), 0) * 8
        o = gl.inline_asm_elementwise(_ASM_GROUP, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r",
                                      [words, v * 0x01010101], dtype=(gl.uint8,) * 8,
                                      is_pure=True, pack=4)
        # o[2w + h][row, 4g + b] is natural code 8w + 4h + b of group g: MMA column
        # 32g + 16h + 4w + b (mx_k_position).  q[row, 4g + b, h, w & 1, w >> 1]:
        q = gl.join(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])),
                    gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])))
        codes = gl.reshape(gl.permute(gl.reshape(q, [64, 4, 4, 2, 2, 2]), [0, 1, 3, 5, 4, 2]),
                           [64, 128])
        return codes.to(gl.float8e4nv, bitcast=True), _pow2_exact(smax - _FOLD_UP_C)

    @gluon.jit
    def _dec_decoder(a_s, a3_s, f_s, f3_s, full_a, empty, w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, n0,
                     stride_we, stride_se, N: gl.constexpr, TWO: gl.constexpr,
                     K: gl.constexpr, STAGES: gl.constexpr):
        """The decode warpgroup: each K step's 64 weight rows (w1 and w3 for the up GEMM)
        decoded into the slot's shared-memory A tiles and factors, once both consumers
        released the slot's previous step; the next step's words load meanwhile."""
        NK: gl.constexpr = K // 128
        DEC_L: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        e64 = e.to(gl.int64)
        rows = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, DEC_L))
        cb = gl.arange(0, 64, layout=gl.SliceLayout(0, DEC_L))
        w_off = e64 * stride_we + rows[:, None] * 64 + (cb - cb % 4)[None, :]
        s_off = e64 * stride_se + rows * 4
        shift = (cb // 16) * 8
        wa, swa = _dec_load(w1_ptr + w_off, s1_ptr + s_off, 0, N)
        wb, swb = _dec_load(w3_ptr + w_off, s3_ptr + s_off, 0, N)
        for i in range(NK):
            slot = i % STAGES
            j = gl.minimum(i + 1, NK - 1)
            na, nsa = _dec_load(w1_ptr + w_off, s1_ptr + s_off, j, N)
            if TWO:
                nb, nsb = _dec_load(w3_ptr + w_off, s3_ptr + s_off, j, N)
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
            codes, f = _dec_tile(wa, swa, shift)
            a_s.index(slot).store(codes)
            f_s.index(slot).store(f)
            if TWO:
                codes3, f3 = _dec_tile(wb, swb, shift)
                a3_s.index(slot).store(codes3)
                f3_s.index(slot).store(f3)
                wb, swb = nb, nsb
            fence_async_shared()
            mbarrier.arrive(full_a.index(slot), count=1)
            wa, swa = na, nsa

    @gluon.jit
    def _dec_consumer(x_s, a_s, a3_s, f_s, f3_s, full_x, full_a, empty, sa_s, pair_ptr, wt_ptr,
                      out_ptr, P, N, row0, n0, stride_om, limit, PART: gl.constexpr,
                      TWO: gl.constexpr, HAS_LIMIT: gl.constexpr, K: gl.constexpr,
                      BMC: gl.constexpr, STAGES: gl.constexpr):
        """A consumer warpgroup: plan rows [PART · BMC, (PART + 1) · BMC) of the block against
        the decoded A tiles (w1 and w3: both sums here, so the epilogue too)."""
        acc, acc3 = _consume_steps(x_s, a_s, a3_s, f_s, f3_s, sa_s, full_x, full_a, empty, 0,
                                   PART, TWO, K, BMC, STAGES, False)
        _epilogue(acc, acc3, row0 + PART * BMC, n0, pair_ptr, wt_ptr, out_ptr, P, N, stride_om,
                  limit, TWO, HAS_LIMIT, BMC, 64, 4)

    @gluon.jit
    def _consume_steps(x_s, a_s, a3_s, f_s, f3_s, sa_s, full_x, full_a, empty, g,
                       PART: gl.constexpr, TWO: gl.constexpr, K: gl.constexpr,
                       BMC: gl.constexpr, STAGES: gl.constexpr, SA_RING: gl.constexpr):
        """A consumer's K steps of one tile, the ring's steps g .. g + K / 128 - 1: each
        step's products waited for and rescaled in turn (w1's while w3's runs), the slot
        released after the last; the activation scales by ring slot (``SA_RING``) or by K
        step.  Returns the (w1, w3) sums [64, BMC]."""
        NK: gl.constexpr = K // 128
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BMC, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
        col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
        zero = gl.zeros([64, BMC], gl.float32, acc_l)
        acc = zero
        acc3 = zero
        for i in range(NK):
            s = g + i
            slot = s % STAGES
            phase = (s // STAGES) & 1
            mbarrier.wait(full_x.index(slot), phase)
            mbarrier.wait(full_a.index(slot), phase)
            xb = x_s.index(slot).slice(PART * BMC, BMC, dim=0).permute((1, 0))
            d = warpgroup_mma(a_s.index(slot), xb, zero, use_acc=False, is_async=True)
            if TWO:
                d3 = warpgroup_mma(a3_s.index(slot), xb, zero, use_acc=False, is_async=True)
                f3 = f3_s.index(slot).load(row_l)
            f1 = f_s.index(slot).load(row_l)
            if SA_RING:
                sa = sa_s.index(slot).slice(PART * BMC, BMC).load(col_l)[None, :]
            else:
                sa = sa_s.index(i).slice(PART * BMC, BMC).load(col_l)[None, :]
            if TWO:
                done = warpgroup_mma_wait(num_outstanding=1, deps=(d,))
                acc = gl.fma(done * sa, f1[:, None], acc)
                done3 = warpgroup_mma_wait(num_outstanding=0, deps=(d3,))
                mbarrier.arrive(empty.index(slot), count=1)
                acc3 = gl.fma(done3 * sa, f3[:, None], acc3)
            else:
                done = warpgroup_mma_wait(num_outstanding=0, deps=(d,))
                mbarrier.arrive(empty.index(slot), count=1)
                acc = gl.fma(done * sa, f1[:, None], acc)
        return acc, acc3

    @gluon.jit
    def _dec_ring(x_desc, BM: gl.constexpr, STAGES: gl.constexpr, TWO: gl.constexpr):
        """The decode-warpgroup forms' ring in shared memory: per slot the activation tile,
        the decoded A tiles and row factors of w1 (and w3 for the up GEMM; w1's again for
        down), and the barriers: activations in (``full_x``), A tiles in (``full_a``), slot
        released by both consumers (``empty``)."""
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
        f_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        x_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, 128], x_desc.layout)
        a_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 64, 128], a_layout)
        f_s = gl.allocate_shared_memory(gl.float32, [STAGES, 64], f_layout)
        if TWO:
            a3_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 64, 128], a_layout)
            f3_s = gl.allocate_shared_memory(gl.float32, [STAGES, 64], f_layout)
        else:
            a3_s = a_s
            f3_s = f_s
        full_x = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        full_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(full_x.index(s), count=1)
            mbarrier.init(full_a.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)
        return x_s, a_s, a3_s, f_s, f3_s, full_x, full_a, empty

    @gluon.jit
    def _gemm_mx_dec_kernel(x_desc, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, pair_ptr, bexp_ptr,
                            wt_ptr, out_ptr, P, E, stride_xsm, stride_we, stride_se, stride_om,
                            limit, N: gl.constexpr, K: gl.constexpr, TWO: gl.constexpr,
                            HAS_LIMIT: gl.constexpr, AB: gl.constexpr, BM: gl.constexpr,
                            STAGES: gl.constexpr, REGS: gl.constexpr, DREGS: gl.constexpr,
                            N_FIRST: gl.constexpr, PDL: gl.constexpr = False):
        """:func:`_gemm_mx_kernel` with each weight tile decoded once for the whole row block:
        a decode warpgroup writes each K step's 64 weight rows (w1 and w3 for the up GEMM) as
        e4m3 A tiles into shared memory, two consumer warpgroups multiply them against half of
        the BM plan rows each (A and B from shared memory), a TMA warp fills the activation
        ring.  REGS / DREGS: the consumers' / the decoder's registers."""
        grid_dependency_sync(PDL)
        blk, pid_n = _gp._block_and_tile(N_FIRST)
        e = gl.load(bexp_ptr + blk)
        if (e >= 0) & (e < E):
            NK: gl.constexpr = K // 128
            BMC: gl.constexpr = BM // 2
            row0 = blk * BM
            n0 = pid_n * 64
            x_s, a_s, a3_s, f_s, f3_s, full_x, full_a, empty = _dec_ring(x_desc, BM, STAGES,
                                                                         TWO)
            sa_s = _scales_to_shared(xs_ptr, row0, stride_xsm, AB, BM, NK, 4)
            gl.warp_specialize([
                (_dec_consumer, (x_s, a_s, a3_s, f_s, f3_s, full_x, full_a, empty, sa_s,
                                 pair_ptr, wt_ptr, out_ptr, P, N, row0, n0, stride_om, limit, 0,
                                 TWO, HAS_LIMIT, K, BMC, STAGES)),
                (_dec_consumer, (x_s, a_s, a3_s, f_s, f3_s, full_x, full_a, empty, sa_s,
                                 pair_ptr, wt_ptr, out_ptr, P, N, row0, n0, stride_om, limit, 1,
                                 TWO, HAS_LIMIT, K, BMC, STAGES)),
                (_dec_decoder, (a_s, a3_s, f_s, f3_s, full_a, empty, w1_ptr, s1_ptr, w3_ptr,
                                s3_ptr, e, n0, stride_we, stride_se, N, TWO, K, STAGES)),
                (_x_producer, (x_desc, x_s, full_x, empty, row0, NK, STAGES)),
            ], [4, 4, 1], [REGS, DREGS, 40])


    # ------------------------------------------------------- persistent decode form
    @gluon.jit
    def _tile_coords(t, NB, NT: gl.constexpr, N_FIRST: gl.constexpr):
        """Tile t of the persistent walk as (row block, N tile): N tiles first (all of a
        block's N tiles in a row) or row blocks first, as the non-persistent grids order
        them."""
        if N_FIRST:
            return t // NT, t % NT
        else:
            return t % NB, t // NB

    @gluon.jit
    def _stage_x(x_desc, x_s, sa_s, full, slot, row0, i, sa):
        """K step i of the block's activations into a released slot: its scales (plain
        stores) and its codes (TMA), both complete on the slot's barrier."""
        sa_s.index(slot).store(sa)
        # Every lane's scales are in shared memory before the slot's arrive.
        gl.thread_barrier()
        mbarrier.expect(full.index(slot), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [row0, i * 128], full.index(slot),
                                        x_s.index(slot))

    @gluon.jit
    def _p_producer(x_desc, w_desc, w3_desc, s_desc, s3_desc, x_s, w_s, w3_s, sw_s, sw3_s,
                    sa_s, full_x, full_w, empty, xs_ptr, bexp_ptr, E, NB, stride_xsm,
                    N: gl.constexpr, K: gl.constexpr, TWO: gl.constexpr, AB: gl.constexpr,
                    BM: gl.constexpr, STAGES: gl.constexpr, N_FIRST: gl.constexpr):
        """The load warp of the persistent form: for every step of the program's tiles, once
        both consumers released the step's slot, the weight tiles for :func:`_p_decoder`
        (TMA: the packed words of the tile's 64 rows, [64, 64] bytes of the K-chunk-major
        stack viewed as [E · K/128 · N, 64], and their scale words, [1, 256] bytes of the
        scales viewed as [E · K/128, N · 4]; w3's too for the up GEMM), the block's
        activation scales of the step (plain loads, one step ahead) and its activation tile
        (TMA)."""
        NK: gl.constexpr = K // 128
        NT: gl.constexpr = N // 64
        W_BYTES: gl.constexpr = (w_desc.block_type.nbytes + s_desc.block_type.nbytes) * (1 + TWO)
        SA_L: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])
        r = gl.arange(0, BM, layout=SA_L)
        g = gl.program_id(0) * 0
        for t in range(gl.program_id(0), NB * NT, gl.num_programs(0)):
            blk, pid_n = _tile_coords(t, NB, NT, N_FIRST)
            e = gl.load(bexp_ptr + blk)
            if (e >= 0) & (e < E):
                row0 = blk * BM
                sa_row = xs_ptr + (row0 + r).to(gl.int64) * stride_xsm
                sa = gl.load(sa_row)
                for i in range(NK):
                    s = g + i
                    slot = s % STAGES
                    sa_next = gl.load(sa_row + (gl.minimum(i + 1, NK - 1) * 128) // AB)
                    mbarrier.wait(empty.index(slot), ((s // STAGES) & 1) ^ 1, pred=s >= STAGES)
                    chunk = e * NK + i
                    mbarrier.expect(full_w.index(slot), W_BYTES)
                    tma.async_copy_global_to_shared(w_desc, [chunk * N + pid_n * 64, 0],
                                                    full_w.index(slot), w_s.index(slot))
                    tma.async_copy_global_to_shared(s_desc, [chunk, pid_n * 256],
                                                    full_w.index(slot), sw_s.index(slot))
                    if TWO:
                        tma.async_copy_global_to_shared(w3_desc, [chunk * N + pid_n * 64, 0],
                                                        full_w.index(slot), w3_s.index(slot))
                        tma.async_copy_global_to_shared(s3_desc, [chunk, pid_n * 256],
                                                        full_w.index(slot), sw3_s.index(slot))
                    _stage_x(x_desc, x_s, sa_s, full_x, slot, row0, i, sa)
                    sa = sa_next
                g += NK

    @gluon.jit
    def _p_decoder(a_s, a3_s, f_s, f3_s, w_s, w3_s, sw_s, sw3_s, full_w, full_a, bexp_ptr,
                   E, NB, N: gl.constexpr, TWO: gl.constexpr, K: gl.constexpr,
                   STAGES: gl.constexpr, N_FIRST: gl.constexpr):
        """The decode warpgroup of the persistent form (:func:`_dec_decoder` over the
        program's tiles, the ring's steps counted across them) on weight tiles the load warp
        brought into the ring by TMA (packed words [64, 64] bytes and the rows' scale words a
        step): no global load is in flight at the proxy fence each step ends with (ptxas
        makes it a MEMBAR.ALL.CTA, which would wait for prefetched loads)."""
        NK: gl.constexpr = K // 128
        NT: gl.constexpr = N // 64
        WORD_L: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        ROW_L: gl.constexpr = gl.SliceLayout(1, WORD_L)
        words_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        scale_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        shift = (gl.arange(0, 16, layout=gl.SliceLayout(0, WORD_L)) // 4) * 8
        g = gl.program_id(0) * 0
        for t in range(gl.program_id(0), NB * NT, gl.num_programs(0)):
            blk, pid_n = _tile_coords(t, NB, NT, N_FIRST)
            e = gl.load(bexp_ptr + blk)
            if (e >= 0) & (e < E):
                for i in range(NK):
                    s = g + i
                    slot = s % STAGES
                    mbarrier.wait(full_w.index(slot), (s // STAGES) & 1)
                    wa = w_s.index(slot)._reinterpret(gl.int32, [64, 16], words_l).load(WORD_L)
                    swa = sw_s.index(slot)._reinterpret(gl.int32, [64], scale_l).load(ROW_L)
                    codes, f = _dec_tile_group(wa, swa, shift)
                    a_s.index(slot).store(codes)
                    f_s.index(slot).store(f)
                    if TWO:
                        wb = w3_s.index(slot)._reinterpret(gl.int32, [64, 16],
                                                           words_l).load(WORD_L)
                        swb = sw3_s.index(slot)._reinterpret(gl.int32, [64],
                                                             scale_l).load(ROW_L)
                        codes3, f3 = _dec_tile_group(wb, swb, shift)
                        a3_s.index(slot).store(codes3)
                        f3_s.index(slot).store(f3)
                    fence_async_shared()
                    mbarrier.arrive(full_a.index(slot), count=1)
                g += NK

    @gluon.jit
    def _p_consumer(x_s, a_s, a3_s, f_s, f3_s, sa_s, full_x, full_a, empty, bexp_ptr, E, NB,
                    pair_ptr, wt_ptr, out_ptr, P, stride_om, limit, PART: gl.constexpr,
                    TWO: gl.constexpr, HAS_LIMIT: gl.constexpr, N: gl.constexpr,
                    K: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
                    N_FIRST: gl.constexpr, CHAIN: gl.constexpr):
        """A consumer warpgroup of the persistent form (``CHAIN`` > 0:
        :func:`_p_consumer_chain`)."""
        if CHAIN > 0:
            _p_consumer_chain(x_s, a_s, a3_s, f_s, f3_s, sa_s, full_x, full_a, empty, bexp_ptr,
                              E, NB, pair_ptr, wt_ptr, out_ptr, P, stride_om, limit, PART, TWO,
                              HAS_LIMIT, N, K, BM, STAGES, N_FIRST, CHAIN)
        else:
            _p_consumer_step(x_s, a_s, a3_s, f_s, f3_s, sa_s, full_x, full_a, empty, bexp_ptr,
                             E, NB, pair_ptr, wt_ptr, out_ptr, P, stride_om, limit, PART, TWO,
                             HAS_LIMIT, N, K, BM, STAGES, N_FIRST)

    @gluon.jit
    def _p_consumer_step(x_s, a_s, a3_s, f_s, f3_s, sa_s, full_x, full_a, empty, bexp_ptr, E,
                         NB, pair_ptr, wt_ptr, out_ptr, P, stride_om, limit, PART: gl.constexpr,
                         TWO: gl.constexpr, HAS_LIMIT: gl.constexpr, N: gl.constexpr,
                         K: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
                         N_FIRST: gl.constexpr):
        """:func:`_dec_consumer` over the program's tiles: plan rows [PART · BM / 2,
        (PART + 1) · BM / 2) of each tile's block, its epilogue while the decoder and the
        load warp fill the next tile's first steps."""
        NK: gl.constexpr = K // 128
        NT: gl.constexpr = N // 64
        BMC: gl.constexpr = BM // 2
        g = gl.program_id(0) * 0
        for t in range(gl.program_id(0), NB * NT, gl.num_programs(0)):
            blk, pid_n = _tile_coords(t, NB, NT, N_FIRST)
            e = gl.load(bexp_ptr + blk)
            if (e >= 0) & (e < E):
                acc, acc3 = _consume_steps(x_s, a_s, a3_s, f_s, f3_s, sa_s, full_x, full_a,
                                           empty, g, PART, TWO, K, BMC, STAGES, True)
                _epilogue(acc, acc3, blk * BM + PART * BMC, pid_n * 64, pair_ptr, wt_ptr,
                          out_ptr, P, N, stride_om, limit, TWO, HAS_LIMIT, BMC, 64, 4)
                g += NK

    @gluon.jit
    def _ready(x_s, full_x, full_a, s, PART: gl.constexpr, BMC: gl.constexpr,
               STAGES: gl.constexpr):
        """Ring step s's slot once its activation and weight tiles are in, and this consumer's
        rows of the activation tile as the wgmma's B operand."""
        slot = s % STAGES
        phase = (s // STAGES) & 1
        mbarrier.wait(full_x.index(slot), phase)
        mbarrier.wait(full_a.index(slot), phase)
        return slot, x_s.index(slot).slice(PART * BMC, BMC, dim=0).permute((1, 0))

    @gluon.jit
    def _scales(f_s, sa_s, slot, PART: gl.constexpr, BMC: gl.constexpr, acc_l: gl.constexpr):
        """A slot's weight-row factors [64, 1] and this consumer's activation scales [1, BMC]."""
        return (f_s.index(slot).load(gl.SliceLayout(1, acc_l))[:, None],
                sa_s.index(slot).slice(PART * BMC, BMC).load(gl.SliceLayout(0, acc_l))[None, :])

    @gluon.jit
    def _p_consumer_chain(x_s, a_s, a3_s, f_s, f3_s, sa_s, full_x, full_a, empty, bexp_ptr, E,
                        NB, pair_ptr, wt_ptr, out_ptr, P, stride_om, limit, PART: gl.constexpr,
                        TWO: gl.constexpr, HAS_LIMIT: gl.constexpr, N: gl.constexpr,
                        K: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
                        N_FIRST: gl.constexpr, U: gl.constexpr):
        """:func:`_p_consumer_step` with the next product in flight while one is rescaled:
        a loop turn takes U steps as one chain of products (w1 and w3 of each step for the up
        GEMM), each issued before the previous one is waited for and rescaled, so the tensor
        cores idle only during a turn's last rescale.  (A product in flight across the loop's
        back edge makes ptxas serialize every wgmma, C7514: hence whole chains in a turn.)
        Same operations in the same order per accumulator: the same bits.  A slot is released
        once its last product is waited for and its scales are read."""
        NK: gl.constexpr = K // 128
        NT: gl.constexpr = N // 64
        BMC: gl.constexpr = BM // 2
        W: gl.constexpr = 2 if TWO else 1
        gl.static_assert(NK % U == 0, "K steps must fill whole loop turns")
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BMC, 32])
        zero = gl.zeros([64, BMC], gl.float32, acc_l)
        g = gl.program_id(0) * 0
        for t in range(gl.program_id(0), NB * NT, gl.num_programs(0)):
            blk, pid_n = _tile_coords(t, NB, NT, N_FIRST)
            e = gl.load(bexp_ptr + blk)
            if (e >= 0) & (e < E):
                acc = zero
                acc3 = zero
                for i0 in range(0, NK, U):
                    slot, xb = _ready(x_s, full_x, full_a, g + i0, PART, BMC, STAGES)
                    dp = warpgroup_mma(a_s.index(slot), xb, zero, use_acc=False, is_async=True)
                    sp = slot
                    # Product j: step i0 + j // W, w1 (j % W == 0) or w3.
                    for j in gl.static_range(1, U * W):
                        if j % W == 0:
                            slot, xb = _ready(x_s, full_x, full_a, g + i0 + j // W, PART, BMC,
                                              STAGES)
                            dq = warpgroup_mma(a_s.index(slot), xb, zero, use_acc=False,
                                               is_async=True)
                        else:
                            dq = warpgroup_mma(a3_s.index(slot), xb, zero, use_acc=False,
                                               is_async=True)
                        done = warpgroup_mma_wait(num_outstanding=1, deps=(dp,))
                        if (j - 1) % W == 1:
                            f, sa = _scales(f3_s, sa_s, sp, PART, BMC, acc_l)
                            mbarrier.arrive(empty.index(sp), count=1)
                            acc3 = gl.fma(done * sa, f, acc3)
                        else:
                            f, sa = _scales(f_s, sa_s, sp, PART, BMC, acc_l)
                            if W == 1:
                                mbarrier.arrive(empty.index(sp), count=1)
                            acc = gl.fma(done * sa, f, acc)
                        dp = dq
                        sp = slot
                    done = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
                    if TWO:
                        f, sa = _scales(f3_s, sa_s, sp, PART, BMC, acc_l)
                        mbarrier.arrive(empty.index(sp), count=1)
                        acc3 = gl.fma(done * sa, f, acc3)
                    else:
                        f, sa = _scales(f_s, sa_s, sp, PART, BMC, acc_l)
                        mbarrier.arrive(empty.index(sp), count=1)
                        acc = gl.fma(done * sa, f, acc)
                _epilogue(acc, acc3, blk * BM + PART * BMC, pid_n * 64, pair_ptr, wt_ptr,
                          out_ptr, P, N, stride_om, limit, TWO, HAS_LIMIT, BMC, 64, 4)
                g += NK

    @gluon.jit
    def _gemm_mx_pdec_kernel(x_desc, w_desc, w3_desc, s_desc, s3_desc, xs_ptr, pair_ptr,
                             bexp_ptr, wt_ptr, out_ptr, P, E, NB, stride_xsm, stride_om, limit,
                             N: gl.constexpr, K: gl.constexpr, TWO: gl.constexpr,
                             HAS_LIMIT: gl.constexpr, AB: gl.constexpr, BM: gl.constexpr,
                             STAGES: gl.constexpr, REGS: gl.constexpr, DREGS: gl.constexpr,
                             N_FIRST: gl.constexpr, CHAIN: gl.constexpr,
                             PDL: gl.constexpr = False):
        """:func:`_gemm_mx_dec_kernel`, persistent: a grid of about one program an SM walks
        the NB · N / 64 tiles (row block, 64 weight rows) round robin; every partition walks
        the same tiles and counts the ring's steps across them, so the decoder and the load
        warp run into the next tile while the consumers store the last one.  The load warp
        brings each step's weight tiles (w_desc / s_desc: packed words and scale words, w3's
        for the up GEMM) and activation tile by TMA and stages the step's activation scales;
        the decoder reads the weights from shared memory (with words prefetched by plain
        loads, its per-step proxy fence waited for them: 9% (up) to 22% (down) slower, that
        form removed, code at 542b095)."""
        grid_dependency_sync(PDL)
        x_s, a_s, a3_s, f_s, f3_s, full_x, full_a, empty = _dec_ring(x_desc, BM, STAGES, TWO)
        sa_s = gl.allocate_shared_memory(gl.float32, [STAGES, BM],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        w_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 64, 64], w_desc.layout)
        sw_s = gl.allocate_shared_memory(s_desc.dtype, [STAGES, 1, 256], s_desc.layout)
        if TWO:
            w3_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 64, 64], w_desc.layout)
            sw3_s = gl.allocate_shared_memory(s_desc.dtype, [STAGES, 1, 256], s_desc.layout)
        else:
            w3_s = w_s
            sw3_s = sw_s
        full_w = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(full_w.index(s), count=1)
        gl.warp_specialize([
            (_p_consumer, (x_s, a_s, a3_s, f_s, f3_s, sa_s, full_x, full_a, empty, bexp_ptr,
                           E, NB, pair_ptr, wt_ptr, out_ptr, P, stride_om, limit, 0, TWO,
                           HAS_LIMIT, N, K, BM, STAGES, N_FIRST, CHAIN)),
            (_p_consumer, (x_s, a_s, a3_s, f_s, f3_s, sa_s, full_x, full_a, empty, bexp_ptr,
                           E, NB, pair_ptr, wt_ptr, out_ptr, P, stride_om, limit, 1, TWO,
                           HAS_LIMIT, N, K, BM, STAGES, N_FIRST, CHAIN)),
            (_p_decoder, (a_s, a3_s, f_s, f3_s, w_s, w3_s, sw_s, sw3_s, full_w, full_a,
                          bexp_ptr, E, NB, N, TWO, K, STAGES, N_FIRST)),
            (_p_producer, (x_desc, w_desc, w3_desc, s_desc, s3_desc, x_s, w_s, w3_s, sw_s,
                           sw3_s, sa_s, full_x, full_w, empty, xs_ptr, bexp_ptr, E, NB,
                           stride_xsm, N, K, TWO, AB, BM, STAGES, N_FIRST)),
        ], [4, 4, 1], [REGS, DREGS, 40])


def qualifies(x: torch.Tensor, kchunk: int, ks: int, D: int, inter: int,
              up: MxPlan | None = None, down: MxPlan | None = None) -> bool:
    """Whether these GEMMs can run this call: Gluon with its Hopper parts, an sm_90 CUDA
    device, K-chunk-major stacks of 128-wide chunks (the K step), D and I multiples of 128 and
    of the plans' N tiles (and their K steps of the plans' chains)."""
    up, down = up or PLAN_UP, down or PLAN_DOWN
    if not (HAVE_GLUON and x.is_cuda and kchunk == STEP and ks == STEP):
        return False
    if torch.cuda.get_device_capability(x.device)[0] != 9:
        return False
    return (D % STEP == 0 and inter % STEP == 0 and inter % up.BN == 0
            and D % down.BN == 0 and (D // STEP) % max(up.chain, 1) == 0
            and (inter // STEP) % max(down.chain, 1) == 0)


def _x_desc(xq: torch.Tensor, BM: int) -> "_gp.TensorDescriptor":
    return _gp._desc(xq, xq.shape[0], [BM, STEP])


def gemm_up(xq: torch.Tensor, xs: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
            w3: torch.Tensor, s3: torch.Tensor, pairs: torch.Tensor, block_expert: torch.Tensor,
            wts: torch.Tensor, act: torch.Tensor, P: int, limit: float, ab: int,
            plan: MxPlan | None = None, n_first: bool = True) -> None:
    """act[plan row] = w · swiglu(w1 x, w3 x) (bf16) for every row block: xq [rows, D] e4m3 in
    the order of :func:`mx_k_position` / xs [rows, D / ab] the prepped activation; w1 / w3
    [E, I, D / 2] packed MXFP4 and s1 / s3 [E, I, D / 32] uint8 scales, K-chunk-major
    (128-wide chunks); rows in the plan's ``BM``-row blocks (``plan``: None for
    :data:`PLAN_UP`)."""
    plan = PLAN_UP if plan is None else plan
    E, inter, half = w1.shape
    _launch(plan, xq, xs, w1, s1, w3, s3, pairs, block_expert, wts, act, P, E, inter,
            2 * half, True, float(limit), ab, n_first)


def gemm_down(aq: torch.Tensor, as_: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
              pairs: torch.Tensor, block_expert: torch.Tensor, y: torch.Tensor, P: int, ab: int,
              plan: MxPlan | None = None, n_first: bool = True) -> None:
    """y[pair] = w2 · act[plan row] (bf16) for every row block: aq [rows, I] e4m3 in the order
    of :func:`mx_k_position` / as_ [rows, I / ab]; w2 [E, D, I / 2] and s2 [E, D, I / 32]
    K-chunk-major (``plan``: None for :data:`PLAN_DOWN`)."""
    plan = PLAN_DOWN if plan is None else plan
    E, D, half = w2.shape
    _launch(plan, aq, as_, w2, s2, w2, s2, pairs, block_expert, pairs, y, P, E, D, 2 * half,
            False, 0.0, ab, n_first)


def _whole_stacks(w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                  N: int, K: int) -> bool:
    """Whether the stacks are whole K-chunk-major tensors (experts N · K / 2 bytes apart), as
    the persistent form's TMA views of them need."""
    return all(w.stride(0) == N * K // 2 and w.is_contiguous() and sc.stride(0) == N * K // 32
               and sc.is_contiguous() for w, sc in ((w1, s1), (w3, s3)))


def _weight_descs(w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                  N: int, K: int) -> tuple:
    """TMA descriptors of the K-chunk-major stacks for :func:`_p_producer`: the packed
    words as [E · K/128 · N, 64] bytes (box: 64 rows of a chunk), the scales as
    [E · K/128, N · 4] bytes (box: 64 rows' scale words, 256 bytes)."""
    words_l = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    out = []
    for w, sc in ((w1, s1), (w3, s3)):
        E, KC = w.shape[0], K // STEP
        wv = torch.as_strided(w.view(torch.uint8), (E * KC * N, 64), (64, 1))
        sv = torch.as_strided(sc.view(torch.uint8), (E * KC, N * 4), (N * 4, 1))
        out.append((_gp.TensorDescriptor(wv, list(wv.shape), [64, 1], [64, 64], words_l),
                    _gp.TensorDescriptor(sv, list(sv.shape), [N * 4, 1], [1, 256], words_l)))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def _launch(plan: MxPlan, xq: torch.Tensor, xs: torch.Tensor, w1: torch.Tensor,
            s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor, pairs: torch.Tensor,
            block_expert: torch.Tensor, wts: torch.Tensor, out: torch.Tensor, P: int, E: int,
            N: int, K: int, two: bool, limit: float, ab: int, n_first: bool) -> None:
    """One GEMM's launch in the plan's form (up: ``two``, w1 / w3, wts the pairs' weights;
    down: w2 twice, wts unused)."""
    nb = block_expert.shape[0]
    regs, dregs = plan.registers(two)
    args = (_x_desc(xq, plan.BM), xs, w1, s1, w3, s3, pairs, block_expert, wts, out, P, E)
    strides = (xs.stride(0), w1.stride(0), s1.stride(0), out.stride(0), limit)
    common = dict(N=N, K=K, TWO=two, HAS_LIMIT=two and limit > 0, AB=ab, BM=plan.BM,
                  STAGES=plan.stages, num_warps=4 if plan.dec else plan.warps)
    if plan.chain and (K // STEP) % plan.chain:
        raise ValueError(f"gluon_moe_mxfp4: {K // STEP} K steps do not fill chains of "
                         f"{plan.chain}")
    if plan.persist and not _whole_stacks(w1, s1, w3, s3, N, K):
        # A view into larger stacks has no TMA view of its chunks: the non-persistent form.
        plan = replace(plan, persist=False, chain=0)
    if plan.persist:
        # One program an SM (the three partitions' registers fill it), N tiles first unless
        # asked otherwise; no grid-axis limit on a 1-D grid.
        tiles = nb * (N // plan.BN)
        grid = (max(1, min(tiles, sm_count(xq.device))),)
        _gemm_mx_pdec_kernel[grid](args[0], *_weight_descs(w1, s1, w3, s3, N, K), xs, pairs,
                                   block_expert, wts, out, P, E, nb, xs.stride(0),
                                   out.stride(0), limit, REGS=regs, DREGS=dregs,
                                   N_FIRST=bool(n_first), CHAIN=plan.chain, **common,
                                   **pdl_args(xq))
        return
    grid, first = tile_grid(nb, N // plan.BN, n_first=n_first)
    if plan.dec:
        _gemm_mx_dec_kernel[grid](*args, *strides, REGS=regs, DREGS=dregs,
                                  N_FIRST=first, **common, **pdl_args(xq))
    else:
        _gemm_mx_kernel[grid](*args, *strides, WARPS=plan.warps, MT=plan.mt, N_FIRST=first,
                              **common, **pdl_args(xq))
