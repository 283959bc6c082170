"""Routed experts (spec §3.9) on FP8 tensor cores: MXFP4 stacks under official numerics, for
large prefill steps (dsv4 issue #5).  ``triton_moe.moe_experts`` routes a call here when
:data:`FP8MMA_PREFILL` (``DSV4_FP8MMA``, default on) and :func:`fp8mma_applies` (from
:data:`MIN_PAIRS_PER_EXPERT` pairs per local expert; :data:`MIN_PAIRS_KEPT` /
:data:`MIN_PAIRS_MX` / :data:`MIN_PAIRS_MX_WIDE` where nothing is re-encoded).  On sm_90
with K-chunk-major stacks the GEMMs decode the MXFP4 words in the wgmma's registers
(``gluon_moe_mxfp4``, :func:`mx_applies`, ``DSV4_FP8MMA_MX``: the same bytes and bits as
below, no re-encoding pass).  Else each chunk of experts is first re-encoded to
e4m3 codes and step factors (``_fp8_predecode_kernel``, "predecoded"), so the GEMMs stream
plain FP8 tiles (Gluon GEMMs on sm_90: ``gluon_moe_prefill``); the first form decoded the
codes inside the Triton GEMMs' K loop (``predecode=False``), between the MMAs.  Measured on
the H200 (2026-12-01, V4-Flash, one layer's experts, docs/PERFORMANCE.md tenth session):
predecoded 10.6 ms at 8,192 tokens and 28.0 ms at 32,768 against 10.5 / 35.2 ms for the
bf16-MMA kernels; in-loop 13.3 / 43.4 ms.  Triton 3.6 waits on each step's wgmma before its
rescale (its automatic warp specialization hung); the Gluon GEMMs run one warpgroup's rescale
beside another's products (docs/PERFORMANCE.md, thirty-fifth and thirty-sixth sessions).

The products are exact.  With ``ExpertWeights.act_block`` set, the torch twin
(``dsv4.ops.torch_dense.moe_experts``) FP8-fake-quantizes the expert inputs per act block with
power-of-two (ue8m0) scales, so every activation value is e4m3 × 2^sa(row, block); every MXFP4
weight is e2m1 × 2^s(column, 32-group).  The GEMMs walk K in steps of ``KS`` = 128 (the act
block: one activation scale per row and step; gcd(act_block, 128) in general) and do ONE FP8 dot
per step, DeepGEMM's promotion interval:

    acc += dot(a8 [BM, KS], w8 [KS, BN]) · sa[row] · 2^(sref[n] − 127)

To get there, each 32-group's weight scale is folded into the e4m3 weight bytes relative to the
step's reference exponent ``sref = smax − 6`` (``smax`` the largest of the step's group
exponents of that output row): the byte of code c in group g is the e4m3 of e2m1(c) · 2^u,
u = s_g − sref = 6 − d_g with d_g = smax − s_g.  The nonzero e2m1 magnitudes have e4m3 exponent
fields 6..9 (0.5 .. 6), e4m3 normals have fields 1..15 (and 0x78 = 256, 0x7C = 384 are finite in
e4m3fn): the shifted value is an exact e4m3 *normal* for -5 ≤ u ≤ 6, i.e. for a spread
d_g ≤ :data:`FOLD_SPREAD` = 11 (a factor 2048) within every (expert, row, step).  In that range
the byte is a table byte plus 8·(11 − d_g) in the exponent field, one ``prmt`` and one add per
4 codes, no subnormal encodings.  (Subnormals would reach a spread of 14 with a second encoding;
real MXFP4 rows stay far inside 11.)  Stacks with a wider spread anywhere (or an e8m0 NaN byte)
run the bf16-MMA kernels of ``triton_moe`` instead: :func:`fold_spread_ok` checks each scale
tensor once (one reduction, one host sync, cached per tensor and its version; never inside a
CUDA-graph capture, where an unchecked stack counts as failing).

Numerics: the products are exact, but within one K step the tensor core adds 128 products in
its own reduced precision (Hopper's FP8 MMA keeps ~14 significant bits in the chain of a K = 128
dot, the reason for DeepGEMM's 128-wide promotion interval); the steps are summed in fp32.  So
the result equals the twin (bf16 GEMMs of the same exact products, fp32 sums in another order)
to bf16-level tolerance, not to fp32 rounding: the GPU tests allow a relative 5e-3 against the
twin and the bf16-MMA kernels on V4-Flash-shaped random stacks (3.5e-3 measured; each 128-sum
carries a relative error
of ~2^-14 · sqrt(128) ≈ 7e-4 of its magnitude at worst; the bf16 roundings of the gate/up outputs
and the activation, which both paths make, are ~2^-9 per value and can flip between the paths);
the end-to-end tiny-shape tests keep the old 1e-2 bound of the bf16 expert tests.

Steps (the routing plan, the SwiGLU epilogue and the combine are those of ``triton_moe``):

1. ``moe_plan``: the (token, pick) pairs sorted by expert into row blocks of BM;
2. ``_fp8_prep_kernel`` (GATHER): each pair's token row quantized per act block into e4m3
   codes in the plan's sorted rows, and its fp32 scales [rows, K / block];
3. ``_fp8mma_up_kernel``: gate and up GEMMs per (block, N tile), K in steps of KS: the packed
   weight bytes decoded (scale-folded) to e4m3 bytes in registers, one ``tl.dot`` of the e4m3
   tiles per step scaled into the fp32 accumulator; then the clamped SwiGLU × routing weight,
   stored bf16 (``triton_moe._up_epilogue``);
4. ``_fp8_prep_kernel`` again on that activation (the twin fake-quantizes it before w2);
5. ``_fp8mma_down_kernel``: the w2 GEMM the same way, one bf16 output row per pair;
6. ``triton_moe._moe_combine_kernel``: per token the fp32 sum of its picks.

The weight decode on the GPU (:data:`FP8MMA_DECODE` "asm") turns 4 packed bytes into 8 e4m3
bytes with ``prmt`` table lookups (biased magnitude, the group's exponent add, sign); it leaves
the codes of each 8 columns in an order of its own (:func:`mma_k_position`), so the activation
codes are stored in that order too (a dot does not depend on the order of K, only on both
operands sharing it).  The interpreter takes integer operations (:func:`_e2m1_to_e4m3_folded`)
and a permute to the same order.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from dsv4.ops import gluon_moe_prefill as _gluon
from dsv4.ops import triton_moe as _triton_moe
from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.torch_dense import ExpertWeights
from dsv4.ops.triton_dense import (
    _INTERPRET_HOST,
    INTERPRET,
    quantize_block_rows,
    store_rne,
)
from dsv4.ops.triton_moe import (
    _check_experts,
    cached_scale_stat,
    _moe_combine_kernel,
    _up_epilogue,
    _weight_args,
    block_pairs,
    block_tile_ids,
    moe_plan,
    tile_grid,
)

_E8M0 = getattr(torch, "float8_e8m0fnu", None)

__all__ = ["FP8MMA_PREFILL", "Fp8Codes", "MoeFp8Config", "encode_ahead", "encode_fp8_codes",
           "fold_spread_ok", "fp8_codes_apply", "fp8mma_applies", "moe_experts_fp8mma",
           "pick_fp8mma_config", "MIN_PAIRS_MX", "MIN_PAIRS_MX_WIDE"]

# triton_moe.moe_experts routes calls here when fp8mma_applies (DSV4_FP8MMA=0: never).
FP8MMA_PREFILL = os.environ.get("DSV4_FP8MMA", "1") == "1"

# fp8mma_applies: the fewest (token, pick) pairs per local expert that take this path (the
# expert count stands in for the active ones: no host sync).  The re-encoding streams every
# expert once per call (3.8 ms for a V4-Flash layer), a fixed cost the GEMMs' gain must pay
# for.  H200, V4-Flash, predecoded against the bf16-MMA kernels (bench/moe_prefill_fp8.py,
# bench/sessions/gpu_session_s10e.sh): 4K tokens (96 pairs an expert) 0.77x, 8K (192)
# 0.99x, 32K (768) 1.25x (1.00x / 1.32x in bench/sessions/gpu_session_s11a.sh); with the
# K-chunk-major stacks of the twelfth session (bench/sessions/gpu_session_s12e.sh) 8K 1.19x,
# 32K 1.47x (the bf16 kernels 6-8% slower on that layout, the predecoded path faster): from
# 192 (8K tokens of V4-Flash on one GPU).
MIN_PAIRS_PER_EXPERT = int(os.environ.get("DSV4_FP8MMA_MIN_PAIRS", "192"))
# The same for stacks whose FP8 codes are kept on the device (ExpertWeights.fp8_codes: no
# re-encoding to pay for).  H200, V4-Flash (docs/PERFORMANCE.md, twentieth session): the
# expert call alone against the bf16-MMA kernels 1.00x at 24 pairs an expert, 1.24x at 48,
# 1.53x at 96, 1.79x at 192 (bench/moe_prefill_fp8.py --kept); the 4-layer prefill at 2K
# tokens (48) 27.1 ms with them against 26.0 without, at 4K (96) 35.6 against 44.3
# (bench/flash_bench.py --moe-fp8-codes).  H100, 256 experts (thirty-ninth session, µs):
# 2,642 against 2,531 at 48, 2,869 against 3,047 at 60, 3,382 against 4,250 at 72: from 60.
MIN_PAIRS_KEPT = int(os.environ.get("DSV4_FP8MMA_MIN_PAIRS_KEPT", "60"))
# The same for calls that run the GEMMs on the MXFP4 stacks (mx_applies: nothing re-encoded).
# Their 64-row plans (gluon_moe_mxfp4.plans_for, to SMALL_PAIRS pairs an expert) take calls
# from MIN_PAIRS_MX pairs, their 128-row plans from MIN_PAIRS_MX_WIDE: in between (one
# 128-row block an expert, mostly padding) the bf16-MMA kernels are faster.  H100, V4-Flash,
# 256 experts (docs/PERFORMANCE.md, thirty-ninth session), the call on the MXFP4 GEMMs
# against the bf16-MMA kernels, µs: 24 pairs (1K tokens) 2,154 / 2,135, 36 (1.5K) 2,172 /
# 2,460, 48 (2K, the engine's default steps) 2,243 / 2,531 (64-row plans); 60 (2.5K) 3,430 /
# 3,047, 72 (3K) 3,468 / 4,250 (128-row plans).
MIN_PAIRS_MX = int(os.environ.get("DSV4_FP8MMA_MIN_PAIRS_MX", "32"))
MIN_PAIRS_MX_WIDE = int(os.environ.get("DSV4_FP8MMA_MIN_PAIRS_MX_WIDE", "72"))
# Re-encode the MXFP4 stacks to FP8 codes before the GEMMs (``_fp8_predecode_kernel``), or
# decode in the GEMMs' K loop.  DSV4_FP8MMA_PREDECODE=0 picks the in-loop decode.
FP8MMA_PREDECODE = os.environ.get("DSV4_FP8MMA_PREDECODE", "1") == "1"
# Scratch for the predecoded codes of one chunk of experts (w1 and w3, then w2 in w1's place):
# experts are re-encoded a chunk at a time so the transient buffer stays bounded (V4-Flash:
# 16 MiB of codes per expert, 64 experts a chunk at the default 1 GiB).
PREDECODE_BYTES = int(os.environ.get("DSV4_FP8MMA_PREDECODE_MB", "1024")) << 20
# One predecode program (DSV4_FP8MMA_PREDECODE_TILE="BN,SP[,HOIST[,WARPS]]"): rows, K steps
# (cut to a divisor of the stack's step count), all loads issued first (1) or step by step
# (0), warps.  32 x 8 hoisted, 8 warps: 2.71 ms for V4-Flash's three K-chunk-major stacks
# against 2.95 for 32 x 8 step by step and 3.01 for 64 x 1 (3.71 / 3.41 / 3.35 TB/s; H200,
# bench/moe_prefill_fp8.py --sweep, run A of the seventeenth session; every tile byte-equal:
# tests/kernels/test_moe_fp8mma_gpu.py).
_PREDECODE_TILE = tuple(int(v) for v in
                        os.environ.get("DSV4_FP8MMA_PREDECODE_TILE", "32,8,1,8").split(","))
# DSV4_FP8MMA_OVERLAP=1: re-encode chunk c + 1 on a stream of its own while the GEMMs of chunk
# c run (memory-bound next to tensor-core-bound), in two scratch slots of half the budget each.
# Same bits, measured no faster (H200, V4-Flash, run E of bench/sessions/gpu_session_s10e.sh:
# 8K tokens 10.56 ms, 32K 28.04 against 10.86 / 26.89 in order with a slower re-encoding
# tile), so off: in order on the current stream.  With the GEMMs walking N tiles first it is
# slower (H100, thirty-fourth session, bench/moe_order.py: 8K 10.30-10.37 ms against
# 9.84-9.86, 32K 26.63-26.66 against 25.47-25.94; 43 layers' 8K prefill 639.0 against 639.5).
PREDECODE_OVERLAP = os.environ.get("DSV4_FP8MMA_OVERLAP", "0") == "1"
_predecode_streams: dict[torch.device, torch.cuda.Stream] = {}
# DSV4_FP8MMA_AHEAD=1: a prefill layer starts the re-encoding of all its experts when the layer
# starts (:func:`encode_ahead`, called by the model before the attention), on a stream of its
# own into one layer-sized scratch per device, so that it runs beside the layer's attention
# (compute-bound kernels) instead of before its expert GEMMs; the expert call waits for it.
# Same codes, same bits.  At most DSV4_FP8MMA_AHEAD_MB of scratch (one layer's codes: 1.03
# bytes a weight, 6.6 GB for V4-Flash's 256 experts, 3.3 GB for 128); a layer whose codes do
# not fit re-encodes in the call as before.  Off: it hides little of the re-encoding for its
# memory (H100, docs/PERFORMANCE.md thirty-fourth session: 4 layers of 256 experts, 8K tokens
# 70.4-70.5 ms against 72.4-72.9, 32K 245.5-245.8 against 248.8-248.9; 43 layers of 64 experts
# 8K 638.9 against 640.9), and the FP8-MMA path from 96 pairs an expert with it is slower at
# 4K tokens (46.5 ms against the bf16 path's 36.4-37.1).
AHEAD = os.environ.get("DSV4_FP8MMA_AHEAD", "0") == "1"
AHEAD_BYTES = int(os.environ.get("DSV4_FP8MMA_AHEAD_MB", "8192")) << 20
_ahead_scratch: dict[torch.device, "Fp8Codes"] = {}

# The MXFP4 scale group (host int and kernel constexpr).
GROUP_SIZE = 32
GROUP = tl.constexpr(GROUP_SIZE)
# The widest K step of one FP8 dot (the act block of official numerics).
MAX_STEP = 128
# Largest spread smax - s_g of the group exponents within one (expert, row, K step) that the
# scale-folded decode turns into exact e4m3 normals (see the module docstring).
FOLD_SPREAD = 11
_FOLD = tl.constexpr(FOLD_SPREAD)
# The weight bytes carry 2^(s_g - smax + 6): the step's column factor is 2^(smax - 6 - 127).
_FOLD_UP = 6
_FOLD_UP_C = tl.constexpr(_FOLD_UP)


def k_step(act_block: int) -> int:
    """The K step of the FP8 dots for an act block: the largest width <= 128 that holds one
    activation scale per row (gcd with 128: 128 for the act block 128 of V4, 32 for V4.1's)."""
    return math.gcd(int(act_block), MAX_STEP)


# ------------------------------------------------------------------------------ jit helpers
@triton.jit
def _e2m1_to_e4m3_folded(nib, v):
    """e2m1 codes (int32 0..15) of a group whose exponent add is ``v`` = 8·(11 - d), d the
    group's spread 0..11 below the step's largest -> the e4m3fn bytes of e2m1 · 2^(6 - d).

    The biased table (the e4m3 bytes of e2m1 · 2^-5: 0, 0x08, 0x10, 0x14, 0x18, 0x1C, 0x20,
    0x24) plus v in the exponent field for nonzero magnitudes: fields 1..15, never a carry."""
    m = nib & 7
    base = tl.where(m >= 2, (((m >> 1) + 1) << 3) | ((m & 1) << 2), 8)
    mag = tl.where(m == 0, 0, base + v)
    return mag | ((nib & 8) << 4)


@triton.jit
def mma_k_position(k):
    """Column of natural K index k in the operand order of the MMAs (a permutation within each
    8 columns, the same for both operands, so the dot is unchanged): the byte order in which
    :data:`_E2M1_TO_E4M3_ASM` leaves 4 packed weight bytes (8 codes) joined with their
    neighbours, natural k = 8g + 4h + r -> 8g + 2r + h (r < 4, h < 2)."""
    return (k & -8) | ((k & 3) << 1) | ((k >> 2) & 1)


# Four packed MXFP4 bytes ($2: 8 e2m1 codes of one 32-group, natural k order in its nibbles)
# and the group's exponent add v = 8·(11 - d) ($3: the uint8 v packed 4 times, v·0x01010101)
# -> their scale-folded e4m3 bytes, codes k 0..3 in $0 and k 4..7 in $1.  Per half: prmt looks
# each code's magnitude (nibble & 7) up in the biased table {0x00, 0x08, 0x10, 0x14, 0x18,
# 0x1C, 0x20, 0x24} (e4m3 of e2m1 · 2^-5); a second prmt with the same selectors picks the add
# from {0, v, v, v, v, v, v, v} (0 for magnitude 0); the sum (fields 1..15, no carry between
# bytes) gets the sign from a third prmt (0x00 or 0x80 by nibble bit 3).
_E2M1_TO_E4M3_ASM = tl.constexpr("""{
.reg .b32 lo, hi, sg, z, sel, s, m, a, vlo;
mov.b32 lo, 0x14100800;
mov.b32 hi, 0x24201C18;
mov.b32 sg, 0x00008000;
mov.b32 z, 0;
and.b32 vlo, $3, 0xFFFFFF00;
and.b32 sel, $2, 0x7777;
prmt.b32 m, lo, hi, sel;
prmt.b32 a, vlo, $3, sel;
add.u32 m, m, a;
shr.b32 s, $2, 3; and.b32 s, s, 0x1111;
prmt.b32 s, sg, z, s;
or.b32 $0, m, s;
shr.b32 sel, $2, 16; and.b32 sel, sel, 0x7777;
prmt.b32 m, lo, hi, sel;
prmt.b32 a, vlo, $3, sel;
add.u32 m, m, a;
shr.b32 s, $2, 19; and.b32 s, s, 0x1111;
prmt.b32 s, sg, z, s;
or.b32 $1, m, s;
}""")


@triton.jit
def _pow2_exact(be):
    """2^(be - 127) in fp32 for an int32 biased exponent be (also fp32 subnormals; 0 below)."""
    normal = (tl.maximum(be, 1) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(be + 22, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(be >= 1, normal, tl.where(be >= -22, sub, 0.0))


@triton.jit
def _mxfp4_e4m3_pieces(w_ptr, s_ptr, w_off, s_off, mask, ASM_DECODE: tl.constexpr,
                       R: tl.constexpr, KS: tl.constexpr):
    """R pieces of an MXFP4 stack, each one row's KS-wide K step — its KS / 2 code bytes at
    ``w_ptr + w_off[r]`` and KS / 32 scale bytes at ``s_ptr + s_off[r]`` (both contiguous) —
    as (scale-folded e4m3 codes [R, KS] in the MMA K order of :func:`mma_k_position`, fp32
    factors 2^(smax - 6 - 127) [R]).  Pieces off ``mask`` read as zeros."""
    rg = tl.arange(0, KS // GROUP)
    sb = tl.load(s_ptr + s_off[:, None] + rg[None, :], mask=mask[:, None],
                 other=127).to(tl.int32)                                       # [R, G]
    smax = tl.max(sb, axis=1)
    # Exponent add of each group (8 · (11 - d)); clamped: a wider spread never gets here (the
    # host check routes such stacks to the bf16 kernels).
    v = tl.maximum(_FOLD - (smax[:, None] - sb), 0) * 8                        # [R, G]
    rj = tl.arange(0, GROUP // 2)
    byte = tl.load(w_ptr + w_off[:, None, None]
                   + (rg[:, None] * (GROUP // 2) + rj[None, :])[None, :, :],
                   mask=mask[:, None, None], other=0)                          # [R, G, 16]
    if ASM_DECODE and not INTERPRET:
        vb = tl.broadcast_to(v[:, :, None], (R, KS // GROUP, GROUP // 2)).to(tl.uint8)
        # out_h[4q + r] holds natural k = 8q + 4h + r of the group: joined, 2(4q + r) + h.
        first, second = tl.inline_asm_elementwise(
            _E2M1_TO_E4M3_ASM, "=r,=r,r,r", [byte, vb], dtype=(tl.uint8, tl.uint8),
            is_pure=True, pack=4)
        codes = tl.reshape(tl.join(first, second), (R, KS))
    else:
        b = byte.to(tl.int32)
        vv = v[:, :, None]
        lo = _e2m1_to_e4m3_folded(b & 15, vv)          # k = 2j
        hi = _e2m1_to_e4m3_folded((b >> 4) & 15, vv)   # k = 2j + 1
        natural = tl.reshape(tl.join(lo, hi), (R, KS // 8, 2, 4))   # [n, q, h, r]
        codes = tl.reshape(tl.permute(natural, (0, 1, 3, 2)), (R, KS)).to(tl.uint8)
    w8 = codes.to(tl.float8e4nv, bitcast=True)
    return w8, _pow2_exact(smax - _FOLD_UP_C)


@triton.jit
def _mxfp4_e4m3_step(w_ptr, s_ptr, e, rn, n_mask, k0, stride_we, stride_wn, stride_se,
                     stride_sn, ASM_DECODE: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr,
                     KCHUNK: tl.constexpr = False, n_rows=0):
    """One KS-wide K step of expert e's MXFP4 rows rn: (scale-folded e4m3 codes [BN, KS] in the
    MMA K order of :func:`mma_k_position`, the rows' fp32 step factors 2^(smax - 6 - 127) [BN]).
    ASM_DECODE: the inline-PTX byte lookups (GPU only); else integer ALU operations (the
    interpreter), the same bytes.  KCHUNK: the stack is K-chunk-major with chunks of KS codes
    (``ExpertWeights.kchunk``), ``n_rows`` rows per expert."""
    # 64-bit expert offsets: E × N × K/2 passes 2^31 bytes for V4-Pro stacks.
    e = e.to(tl.int64)
    if KCHUNK:
        s_row = (k0 // KS) * (n_rows * (KS // GROUP)) + rn * (KS // GROUP)
        w_row = (k0 // KS) * (n_rows * (KS // 2)) + rn * (KS // 2)
    else:
        s_row = rn * stride_sn + k0 // GROUP
        w_row = rn * stride_wn + k0 // 2
    return _mxfp4_e4m3_pieces(w_ptr + e * stride_we, s_ptr + e * stride_se, w_row, s_row,
                              n_mask, ASM_DECODE, BN, KS)


@triton.jit
def _weight_step(w_ptr, s_ptr, e, rn, n_mask, k0, stride_we, stride_wn, stride_se, stride_sn,
                 PREDECODED: tl.constexpr, ASM_DECODE: tl.constexpr, BN: tl.constexpr,
                 KS: tl.constexpr, KCHUNK: tl.constexpr = False, n_rows=0):
    """One KS-wide K step of expert e's weight rows rn as (e4m3 codes [BN, KS] in the MMA K
    order, fp32 step factors [BN]).  PREDECODED: read from the buffers that
    ``_fp8_predecode_kernel`` wrote (codes [E, N, K] e4m3, factors [E, K / KS, N]); else
    decoded from the MXFP4 stack in registers (:func:`_mxfp4_e4m3_step`)."""
    if PREDECODED:
        # The codes are typed e4m3 (no bitcast between the load and the dot), so the software
        # pipeliner copies them straight into the MMA's shared-memory operand.
        ee = e.to(tl.int64)
        w8 = tl.load(w_ptr + ee * stride_we + rn.to(tl.int64)[:, None] * stride_wn
                     + (k0 + tl.arange(0, KS))[None, :], mask=n_mask[:, None], other=0.0)
        sw = tl.load(s_ptr + ee * stride_se + (k0 // KS) * stride_sn + rn, mask=n_mask,
                     other=0.0)
    else:
        w8, sw = _mxfp4_e4m3_step(w_ptr, s_ptr, e, rn, n_mask, k0, stride_we, stride_wn,
                                  stride_se, stride_sn, ASM_DECODE, BN, KS, KCHUNK, n_rows)
    return w8, sw


@triton.jit
def _act_step(a_ptr, sa_ptr, rm, m_mask, k0, stride_am, stride_sam, AB: tl.constexpr,
              KS: tl.constexpr):
    """Rows rm of a prepped activation at the KS-wide K step k0: (e4m3 codes [BM, KS] in the
    MMA K order, the rows' fp32 scales of the act block holding the step [BM]).  Padding rows
    read 0."""
    rows = rm.to(tl.int64)
    a8 = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + tl.arange(0, KS))[None, :],
                 mask=m_mask[:, None], other=0.0)
    sa = tl.load(sa_ptr + rows * stride_sam + k0 // AB, mask=m_mask, other=0.0)
    return a8, sa


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _fp8_predecode_kernel(w_ptr, s_ptr, q_ptr, f_ptr, e0, N, stride_we, stride_wn, stride_se,
                          stride_sn, stride_qe, stride_qn, stride_fe, stride_fk,
                          ASM_DECODE: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr,
                          SP: tl.constexpr = 1, KCHUNK: tl.constexpr = False,
                          HOIST: tl.constexpr = False, PDL: tl.constexpr = False):
    """SP K steps (KS wide) of BN rows of expert e0 + program 0 of an MXFP4 stack re-encoded
    losslessly: q[e, n, k] = the scale-folded e4m3 byte (MMA K order within the step),
    f[e, step, n] = the step's fp32 column factor.  The GEMMs then stream plain FP8 tiles that
    the software pipeliner can prefetch, instead of decoding between their MMAs.

    HOIST: the SP · BN (row, step) pieces are one tile, so every load of the program is issued
    before the first decode and store (the step loop waits for each step's loads in turn:
    the compiler does not move a load above an earlier store to global memory)."""
    grid_dependency_sync(PDL)
    el = tl.program_id(0)
    e = (e0 + el).to(tl.int64)
    el64 = el.to(tl.int64)
    if HOIST:
        r = tl.arange(0, SP * BN)
        rn = tl.program_id(1) * BN + r % BN
        step = tl.program_id(2) * SP + r // BN
        n_mask = rn < N
        if KCHUNK:
            s_off = (step * N + rn).to(tl.int64) * (KS // GROUP)
            w_off = (step * N + rn).to(tl.int64) * (KS // 2)
        else:
            s_off = rn.to(tl.int64) * stride_sn + step * (KS // GROUP)
            w_off = rn.to(tl.int64) * stride_wn + step * (KS // 2)
        w8, sw = _mxfp4_e4m3_pieces(w_ptr + e * stride_we, s_ptr + e * stride_se, w_off,
                                    s_off, n_mask, ASM_DECODE, SP * BN, KS)
        tl.store(q_ptr + el64 * stride_qe + rn.to(tl.int64)[:, None] * stride_qn
                 + (step * KS)[:, None] + tl.arange(0, KS)[None, :], w8, mask=n_mask[:, None])
        tl.store(f_ptr + el64 * stride_fe + step * stride_fk + rn, sw, mask=n_mask)
    else:
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        n_mask = rn < N
        for i in tl.static_range(SP):
            k0 = (tl.program_id(2) * SP + i) * KS
            w8, sw = _mxfp4_e4m3_step(w_ptr, s_ptr, e0 + el, rn, n_mask, k0, stride_we,
                                      stride_wn, stride_se, stride_sn, ASM_DECODE, BN, KS,
                                      KCHUNK, N)
            tl.store(q_ptr + el64 * stride_qe + rn.to(tl.int64)[:, None] * stride_qn
                     + (k0 + tl.arange(0, KS))[None, :], w8, mask=n_mask[:, None])
            tl.store(f_ptr + el64 * stride_fe + (k0 // KS) * stride_fk + rn, sw, mask=n_mask)


@triton.jit
def _fp8_prep_kernel(src_ptr, pair_ptr, bexp_ptr, q_ptr, s_ptr, P, E, TOPK, stride_src,
                     stride_q, stride_s, GATHER: tl.constexpr, BM: tl.constexpr,
                     AB: tl.constexpr, ORDER: tl.constexpr = 0, PDL: tl.constexpr = False):
    """One row block and act block: q[row] = the e4m3 codes of the source row (GATHER: the
    pair's token row; else the row itself) in the MMA K order, s[row] its fp32 scale, quantized
    as the twin's fake quant (amax floor 1e-4, ue8m0 scale, e4m3 round-to-nearest-even).
    Padding rows and unused blocks are left unwritten (the GEMMs mask them).  ORDER 0: the
    order of :func:`mma_k_position` (these GEMMs and the Gluon ones on codes); 1: that of
    ``gluon_moe_mxfp4.mx_k_position`` (natural 8q + 4h + i at 16h + 4q + i in each 32)."""
    grid_dependency_sync(PDL)
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
        # Into the MMA K order in registers (natural k = 8g + 4h + r at 8g + 2r + h), then one
        # contiguous store per row: storing each code at mma_k_position(k) scattered single
        # bytes (2.2 ms per 8K-token call on the H200, against ~0.2 ms of bytes).
        if ORDER == 1:
            qp = tl.reshape(tl.permute(tl.reshape(q, (BM, AB // 32, 4, 2, 4)), (0, 1, 3, 2, 4)),
                            (BM, AB))
        else:
            qp = tl.reshape(tl.permute(tl.reshape(q, (BM, AB // 8, 2, 4)), (0, 1, 3, 2)),
                            (BM, AB))
        # q is on the e4m3 grid already: the cast is exact.
        tl.store(q_ptr + rows[:, None] * stride_q + rk[None, :], qp.to(tl.float8e4nv),
                 mask=m_mask[:, None])
        tl.store(s_ptr + rows * stride_s + kb, s, mask=m_mask)


@triton.jit
def _fp8mma_up_kernel(xq_ptr, xs_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, pair_ptr, bexp_ptr,
                      wt_ptr, act_ptr, P, N, K, e0, e1, stride_xm, stride_xsm, stride_actm,
                      stride_we, stride_wn, stride_se, stride_sn, limit,
                      HAS_LIMIT: tl.constexpr, ASM_DECODE: tl.constexpr, AB: tl.constexpr,
                      KS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      PREDECODED: tl.constexpr = False, KCHUNK: tl.constexpr = False,
                      N_FIRST: tl.constexpr = False, PDL: tl.constexpr = False):
    """act[row] = w · swiglu(w1 x, w3 x) (bf16) for the pairs of one row block and N tile;
    x given as e4m3 codes ``xq`` with fp32 scales ``xs`` per act block (``_fp8_prep_kernel``).
    One FP8 dot per KS-wide K step and weight, its row and column powers of two applied in fp32
    (part · sa is exact, the fma rounds once, as an add).  Only the blocks of experts
    e0 <= e < e1 run (a chunk of predecoded experts, weights indexed e - e0; else 0, E)."""
    grid_dependency_sync(PDL)
    blk, pid_n, _, _ = block_tile_ids(N_FIRST)
    e = tl.load(bexp_ptr + blk)
    if (e >= e0) & (e < e1):
        ew = e - e0
        rm, pair, m_mask = block_pairs(pair_ptr, blk, P, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
        acc1 = tl.zeros((BM, BN), dtype=tl.float32)
        acc3 = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, KS):
            a8, sa = _act_step(xq_ptr, xs_ptr, rm, m_mask, k0, stride_xm, stride_xsm, AB, KS)
            g8, sg = _weight_step(w1_ptr, s1_ptr, ew, rn, n_mask, k0, stride_we, stride_wn,
                                  stride_se, stride_sn, PREDECODED, ASM_DECODE, BN, KS,
                                  KCHUNK, N)
            acc1 = tl.fma(tl.dot(a8, tl.trans(g8)) * sa[:, None], sg[None, :], acc1)
            u8, su = _weight_step(w3_ptr, s3_ptr, ew, rn, n_mask, k0, stride_we, stride_wn,
                                  stride_se, stride_sn, PREDECODED, ASM_DECODE, BN, KS,
                                  KCHUNK, N)
            acc3 = tl.fma(tl.dot(a8, tl.trans(u8)) * sa[:, None], su[None, :], acc3)
        _up_epilogue(acc1, acc3, act_ptr, wt_ptr, rm, pair, m_mask, rn, n_mask, stride_actm,
                     limit, tl.bfloat16, HAS_LIMIT)


@triton.jit
def _fp8mma_down_kernel(aq_ptr, as_ptr, w2_ptr, s2_ptr, pair_ptr, bexp_ptr, y_ptr, P, N, K, e0,
                        e1, stride_am, stride_asm, stride_ym, stride_we, stride_wn, stride_se,
                        stride_sn, ASM_DECODE: tl.constexpr, AB: tl.constexpr,
                        KS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        PREDECODED: tl.constexpr = False, KCHUNK: tl.constexpr = False,
                        N_FIRST: tl.constexpr = False, PDL: tl.constexpr = False):
    """y[pair] = w2 · act[row] (bf16) for the pairs of one row block and N tile; act given as
    e4m3 codes ``aq`` with fp32 scales ``as`` per act block; one FP8 dot per KS-wide step.
    Experts e0 <= e < e1 only, as the up kernel."""
    grid_dependency_sync(PDL)
    blk, pid_n, _, _ = block_tile_ids(N_FIRST)
    e = tl.load(bexp_ptr + blk)
    if (e >= e0) & (e < e1):
        ew = e - e0
        rm, pair, m_mask = block_pairs(pair_ptr, blk, P, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, KS):
            a8, sa = _act_step(aq_ptr, as_ptr, rm, m_mask, k0, stride_am, stride_asm, AB, KS)
            w8, sw = _weight_step(w2_ptr, s2_ptr, ew, rn, n_mask, k0, stride_we, stride_wn,
                                  stride_se, stride_sn, PREDECODED, ASM_DECODE, BN, KS,
                                  KCHUNK, N)
            acc = tl.fma(tl.dot(a8, tl.trans(w8)) * sa[:, None], sw[None, :], acc)
        y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        store_rne(y_ptrs, acc, m_mask[:, None] & n_mask[None, :])


# ------------------------------------------------------------------------------ host side
# How the GEMM kernels decode the MXFP4 codes to e4m3 bytes on the GPU: "asm" (prmt byte
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


# The default plans (see pick_fp8mma_config): 2K-token prefill of V4-Flash (~48 rows per
# expert) and 8K (~190).  ptxas for sm_90 (V4-Flash widths): up 196 / down 227 registers,
# 72 / 57 KB shared memory (small); up 195 / down 226, 72 / 80 KB (large); no spills.
PLAN_SMALL = MoeFp8Config(BM=64, BN_up=128, BN_down=128, warps_up=8, warps_down=4, stages=3)
PLAN_LARGE = MoeFp8Config(BM=128, BN_up=64, BN_down=128, warps_up=8, warps_down=8, stages=3)
# The predecoded weights' plan: the fastest of the sweep at 8K and 32K tokens (H200,
# 2026-12-01, bench/moe_prefill_fp8.py --sweep, bench/sessions/gpu_session_s10c.sh).
PLAN_PREDECODED = MoeFp8Config(BM=64, BN_up=128, BN_down=128, warps_up=8, warps_down=8,
                               stages=4)


def pick_fp8mma_config(num_pairs: int, num_experts: int, predecode: bool = False
                       ) -> MoeFp8Config:
    """Tile plan: :data:`PLAN_PREDECODED` for predecoded weights; for the in-loop decode by the
    average rows per active expert: 64-row blocks below 128 rows (2K-token prefill of
    V4-Flash: ~48), 128-row blocks from 128 (8K: ~190).

    The in-loop plans were chosen offline from the sm_90 compile: the up kernel holds two fp32
    accumulators plus a fresh dot result, so it takes 8 warps and 64×128 / 128×64 tiles
    (128×128 spills 88 bytes per thread at 8 warps, 2.8 KB at 4), the down kernel 64×128 with
    4 warps / 128×128 with 8; 3 stages (4 fit too, 96-131 KB).  The in-loop decode is off by
    default (:data:`FP8MMA_PREDECODE`); on the H200 its 128×128 up tile was the faster one
    despite the spill (bench/sessions/gpu_session_s11a.sh, docs/PERFORMANCE.md)."""
    if predecode:
        return PLAN_PREDECODED
    active = max(1, min(num_experts, num_pairs))
    return PLAN_SMALL if num_pairs / active < 128 else PLAN_LARGE


# ------------------------------------------------------------------------------ spread check
def scale_spread(s: torch.Tensor, ks: int) -> int | None:
    """The largest spread max - min of the e8m0 exponents of an MXFP4 scale tensor
    [..., K/32] within each (row, ``ks``-wide K step), 255 if any byte is the e8m0 NaN; cached
    per tensor (and its version), computed with one reduction and one host sync.  None when it
    is not cached and cannot be computed now (inside a CUDA-graph capture)."""
    u = s.view(torch.uint8) if s.dtype == _E8M0 else s
    if u.dtype != torch.uint8:
        raise ValueError(f"scale_spread: needs e8m0 or uint8 scales; found {s.dtype}")
    g = ks // GROUP_SIZE
    if u.shape[-1] % g:
        raise ValueError(f"scale_spread: {u.shape[-1]} groups per row are not whole steps of "
                         f"{ks}")

    def spread_of(t: torch.Tensor) -> int:
        u = t.view(torch.uint8) if t.dtype == _E8M0 else t
        r = u.reshape(*u.shape[:-1], u.shape[-1] // g, g)
        spread = (r.amax(-1).to(torch.int16) - r.amin(-1).to(torch.int16)).amax()
        return int(torch.where((u == 255).any(), torch.full_like(spread, 255), spread).item())

    return cached_scale_stat(s, f"spread{ks}", spread_of)


def fold_spread_ok(experts: ExpertWeights, ks: int) -> bool:
    """Whether every (expert, row, ``ks``-wide K step) of the three scale tensors stays within
    :data:`FOLD_SPREAD` (the scale-folded decode is exact there); False when unknown (first
    call inside a CUDA-graph capture)."""
    for name in ("s1", "s3", "s2"):
        spread = scale_spread(getattr(experts, name), ks)
        if spread is None or spread > FOLD_SPREAD:
            return False
    return True


def fp8mma_applies(x: torch.Tensor, topk_ids: torch.Tensor, experts: ExpertWeights) -> bool:
    """Whether a call should take :func:`moe_experts_fp8mma` (for the op table, with
    :data:`FP8MMA_PREFILL`): MXFP4 stacks with e8m0 (uint8) scales under official numerics with
    an act block that is a multiple of 128 (one dot per 128-wide K step; smaller act blocks
    work but are slower than the bf16-MMA kernels), bf16 x [T, D] with D and I multiples of the
    act block, at least :data:`MIN_PAIRS_PER_EXPERT` pairs per local expert
    (:data:`MIN_PAIRS_KEPT` with the stacks' FP8 codes kept on the device; where the GEMMs
    run on the MXFP4 stacks, :data:`MIN_PAIRS_MX` to ``SMALL_PAIRS`` or from
    :data:`MIN_PAIRS_MX_WIDE`), and every
    scale spread within :data:`FOLD_SPREAD` (checked once per scale tensor; the first check
    syncs)."""
    ab = experts.act_block
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not ab or x.shape[1] % ab:
        return False
    # Kept codes, or the GEMMs on the MXFP4 stacks: no re-encoding to pay for.
    # Pairs an expert: the call's pairs over the experts they spread across (expert-parallel
    # ranks see every rank's ids; no host sync to count the local ones).
    P, E = topk_ids.numel(), experts.spread
    if experts.fp8_codes is not None:
        ok = P >= MIN_PAIRS_KEPT * E
    elif mx_applies(x, experts, P):
        from dsv4.ops import gluon_moe_mxfp4 as mx
        ok = (MIN_PAIRS_MX * E <= P <= mx.SMALL_PAIRS * E) or P >= MIN_PAIRS_MX_WIDE * E
    else:
        ok = P >= MIN_PAIRS_PER_EXPERT * E
    if not ok:
        return False
    return fp8_codes_apply(experts)     # the stacks' conditions, the spread check last (syncs)


def mx_applies(x: torch.Tensor, experts: ExpertWeights, pairs: int | None = None) -> bool:
    """Whether a call without kept codes runs the Gluon GEMMs on the MXFP4 stacks
    (``gluon_moe_mxfp4``, :data:`~dsv4.ops.gluon_moe_mxfp4.MX_PREFILL`) instead of re-encoding
    them: the predecoded form (:data:`FP8MMA_PREDECODE`), K-chunk-major stacks, an sm_90 GPU,
    widths the plans of a call of ``pairs`` pairs tile (None: the default plans)."""
    from dsv4.ops import gluon_moe_mxfp4 as mx
    ab = experts.act_block
    if not (mx.MX_PREFILL and FP8MMA_PREDECODE and ab and x.dim() == 2):
        return False
    up, down = (None, None) if pairs is None else mx.plans_for(pairs, experts.spread)
    return mx.qualifies(x, experts.kchunk, k_step(ab), x.shape[1], experts.inter_dim,
                        up, down)


def predecode_chunk(num_experts: int, inter: int, dim: int, slots: int = 1) -> int:
    """Experts re-encoded per chunk: as many as :data:`PREDECODE_BYTES` holds in each of
    ``slots`` scratch slots (w1 + w3 codes, 2 · I · D bytes an expert), at least one."""
    return max(1, min(num_experts, PREDECODE_BYTES // (2 * inter * dim * slots)))


def _predecode_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _predecode_streams:
        _predecode_streams[device] = torch.cuda.Stream(device)
    return _predecode_streams[device]


def _run_chunks(num_experts: int, chunk: int, slots: int, device: torch.device,
                free: list, predecode, gemm) -> None:
    """For each chunk [e0, e1) of experts: ``predecode(slot, e0, e1)`` then ``gemm(slot, e0,
    e1)``, the chunks taking the ``slots`` scratch slots in turn.  With two slots the
    re-encoding runs on its own stream, chunk c + 1's next to chunk c's GEMMs: it waits for
    the GEMMs that last read its slot (the events in ``free``, kept across calls of one
    expert call) and the GEMMs wait for it.  Allocator-safe without ``record_stream``: the
    scratch is made on the current stream before the first fork, only written on the side
    stream, and its last reader is a GEMM on the current stream."""
    side = _predecode_stream(device) if slots > 1 else None
    main = torch.cuda.current_stream(device) if side is not None else None
    if side is not None:
        side.wait_stream(main)
    for c, e0 in enumerate(range(0, num_experts, chunk)):
        e1, slot = min(num_experts, e0 + chunk), c % slots
        if side is None:
            predecode(slot, e0, e1)
        else:
            if free[slot] is not None:
                side.wait_event(free[slot])
            with torch.cuda.stream(side):
                predecode(slot, e0, e1)
            main.wait_event(side.record_event())
        gemm(slot, e0, e1)
        if side is not None:
            free[slot] = main.record_event()


def _predecode_buffers(chunk: int, inter: int, dim: int, ks: int, device: torch.device
                       ) -> tuple[torch.Tensor, ...]:
    """Codes [chunk, I, D] (e4m3) and step factors [chunk, D / ks, I] (fp32) for w1 and w3
    (w2's [chunk, D, I] / [chunk, I / ks, D] reuse w1's)."""
    q1 = torch.empty(chunk, inter, dim, dtype=torch.float8_e4m3fn, device=device)
    f1 = torch.empty(chunk, dim // ks, inter, dtype=torch.float32, device=device)
    return q1, torch.empty_like(q1), f1, torch.empty_like(f1)


def _predecode(w: torch.Tensor, s: torch.Tensor, q: torch.Tensor, f: torch.Tensor, e0: int,
               e1: int, asm: bool, ks: int, tile: tuple[int, ...] | None = None,
               kchunk: bool = False) -> None:
    """q[e - e0], f[e - e0] = the FP8 re-encoding of MXFP4 experts e0 <= e < e1 of (w, s);
    ``tile``: (rows, K steps[, hoist[, warps]]) of a program (None: :data:`_PREDECODE_TILE`);
    ``kchunk``: (w, s) K-chunk-major with chunks of ``ks`` (q, f stay row-major)."""
    n, k = q.shape[1], q.shape[2]
    given = tuple(tile or _PREDECODE_TILE)
    if not 2 <= len(given) <= 4:
        raise ValueError(f"predecode tile {given}: needs (rows, K steps[, hoist[, warps]])")
    bn, sp, hoist, warps = given + (0, 4)[len(given) - 2:]   # defaults: step loop, 4 warps
    sp = math.gcd(k // ks, sp)
    if min(bn, sp, warps) < 1 or bn & (bn - 1) or sp & (sp - 1) or warps & (warps - 1):
        raise ValueError(f"predecode tile {tile or _PREDECODE_TILE}: rows, steps and warps "
                         "must be powers of two")
    grid = (e1 - e0, triton.cdiv(n, bn), k // ks // sp)
    _fp8_predecode_kernel[grid](w, s, q, f, e0, n, w.stride(0), w.stride(1), s.stride(0),
                                s.stride(1), q.stride(0), q.stride(1), f.stride(0), f.stride(1),
                                ASM_DECODE=asm, BN=bn, KS=ks, SP=sp, KCHUNK=kchunk,
                                HOIST=bool(hoist), num_warps=warps, **pdl_args(w))


@dataclass(frozen=True)
class Fp8Codes:
    """MXFP4 expert stacks re-encoded to FP8 once and kept on the device, so the FP8-MMA
    prefill path skips its per-call re-encoding (``_fp8_predecode_kernel``'s output for every
    expert: codes [E, N, K] e4m3 in the MMA K order of each ``ks``-wide step, step factors
    [E, K / ks, N] fp32, for w1, w3 and w2).  Lossless: made only for stacks within
    :data:`FOLD_SPREAD`.  1.03 bytes a weight, next to the MXFP4 stacks' 0.53.

    ``ready``: None when the codes are made (kept codes), else the CUDA event after which they
    are (:func:`encode_ahead`: written on another stream); the expert call waits for it."""

    ks: int
    q1: torch.Tensor
    q3: torch.Tensor
    q2: torch.Tensor
    f1: torch.Tensor
    f3: torch.Tensor
    f2: torch.Tensor
    ready: Any = None

    def nbytes(self) -> int:
        """Device bytes of the codes and factors."""
        return sum(t.numel() * t.element_size()
                   for t in (self.q1, self.q3, self.q2, self.f1, self.f3, self.f2))


def fp8_codes_apply(experts: ExpertWeights) -> bool:
    """Whether the FP8-MMA path runs ``experts`` (the stacks' part of :func:`fp8mma_applies`)
    and so :func:`encode_fp8_codes` makes codes for them: MXFP4 stacks with e8m0 scales under
    official numerics with an act block that is a multiple of 128, D and I multiples of it,
    K-chunks (if any) of the K step, and every scale spread within :data:`FOLD_SPREAD` (one
    check per scale tensor, cached)."""
    ab = experts.act_block
    if experts.fmt != "fp4" or not ab or ab % MAX_STEP:
        return False
    if experts.dim % ab or experts.inter_dim % ab:
        return False
    if any(getattr(experts, n).dtype not in (_E8M0, torch.uint8) for n in ("s1", "s3", "s2")):
        return False
    ks = k_step(ab)
    if experts.kchunk and experts.kchunk != ks:
        return False
    return fold_spread_ok(experts, ks)


def codes_nbytes(num_experts: int, inter: int, dim: int, ks: int) -> int:
    """Bytes of an :class:`Fp8Codes` of ``num_experts`` experts: three stacks of I · D e4m3
    codes and I · D / ks fp32 step factors each."""
    weights = num_experts * inter * dim
    return 3 * weights + 3 * 4 * (weights // ks)


def _empty_codes(num_experts: int, inter: int, dim: int, ks: int, device: torch.device
                 ) -> Fp8Codes:
    e4m3 = torch.float8_e4m3fn
    q1 = torch.empty(num_experts, inter, dim, dtype=e4m3, device=device)
    f1 = torch.empty(num_experts, dim // ks, inter, dtype=torch.float32, device=device)
    return Fp8Codes(ks, q1, torch.empty_like(q1),
                    torch.empty(num_experts, dim, inter, dtype=e4m3, device=device),
                    f1, torch.empty_like(f1),
                    torch.empty(num_experts, inter // ks, dim, dtype=torch.float32,
                                device=device))


def _encode_into(experts: ExpertWeights, codes: Fp8Codes) -> None:
    """Fill ``codes`` (made for these stacks' shapes) with the re-encoding of every expert."""
    asm, kchunk, E = FP8MMA_DECODE == "asm", bool(experts.kchunk), experts.num_experts
    for name, q, f in (("w1", codes.q1, codes.f1), ("w3", codes.q3, codes.f3),
                       ("w2", codes.q2, codes.f2)):
        w, sc, _ = _weight_args(experts, name)
        _predecode(w, sc, q, f, 0, E, asm, codes.ks, kchunk=kchunk)


def encode_fp8_codes(experts: ExpertWeights) -> Fp8Codes | None:
    """The FP8 re-encoding of every expert of ``experts`` (the re-encoding kernel once per
    stack), or None where :func:`fp8_codes_apply` says no.  Needs a CUDA device (or the
    interpreter)."""
    if not fp8_codes_apply(experts):
        return None
    if experts.w1.device.type != "cuda" and not _INTERPRET_HOST:
        raise ValueError("encode_fp8_codes: needs the stacks on a CUDA device (or "
                         "TRITON_INTERPRET=1)")
    codes = _empty_codes(experts.num_experts, experts.inter_dim, experts.dim,
                         k_step(experts.act_block), experts.w1.device)
    _encode_into(experts, codes)
    return codes


def _ahead_codes(num_experts: int, inter: int, dim: int, ks: int, device: torch.device
                 ) -> Fp8Codes:
    """The device's ahead scratch as codes of ``num_experts`` experts (its first ones): kept
    from call to call, made again (larger, or for other widths) when it does not fit."""
    have = _ahead_scratch.get(device)
    if (have is None or have.ks != ks or have.q1.shape[0] < num_experts
            or have.q1.shape[1:] != (inter, dim)):
        if have is not None and device.type == "cuda":
            # Its last writes may still be queued on the side stream: they finish before
            # anything on this stream can reuse the memory.
            torch.cuda.current_stream(device).wait_stream(_predecode_stream(device))
        _ahead_scratch.pop(device, None)
        have = _ahead_scratch[device] = _empty_codes(num_experts, inter, dim, ks, device)
    n = num_experts
    return Fp8Codes(ks, have.q1[:n], have.q3[:n], have.q2[:n], have.f1[:n], have.f3[:n],
                    have.f2[:n])


def encode_ahead(experts: ExpertWeights, tokens: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16) -> Fp8Codes | None:
    """Start the FP8 re-encoding of ``experts`` for a step of ``tokens`` tokens (``topk``
    picks each, compute ``dtype``) whose expert call will take the re-encoding FP8-MMA path,
    and return its codes to hand to that call as ``ExpertWeights.fp8_codes``; None (nothing
    done) when :data:`AHEAD` is off, the stacks keep their codes already, the call will not
    take that path, the layer's codes exceed :data:`AHEAD_BYTES`, or inside a CUDA-graph
    capture.

    On CUDA the re-encoding is issued on a stream of its own after everything issued so far
    (earlier layers' expert GEMMs read the same scratch) and the codes carry the event the
    expert call waits for; so work issued between this call and the expert call (the layer's
    attention) runs next to it.  In the interpreter it runs in order.  The codes live in one
    scratch per device, which the next call overwrites: use them before starting another."""
    if not (AHEAD and FP8MMA_PREFILL and FP8MMA_PREDECODE) or experts.fp8_codes is not None:
        return None
    device = experts.w1.device
    if device.type != "cuda" and not _INTERPRET_HOST:
        return None
    if dtype != torch.bfloat16 or tokens * topk < MIN_PAIRS_PER_EXPERT * experts.spread:
        return None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if not fp8_codes_apply(experts):      # (the act block and widths too)
        return None
    E, inter, D = experts.num_experts, experts.inter_dim, experts.dim
    ks = k_step(experts.act_block)
    if codes_nbytes(E, inter, D, ks) > AHEAD_BYTES:
        return None
    codes = _ahead_codes(E, inter, D, ks, device)
    if device.type != "cuda":
        _encode_into(experts, codes)
        return codes
    side = _predecode_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        _encode_into(experts, codes)
    return replace(codes, ready=side.record_event())


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
                       cfg: MoeFp8Config | None = None,
                       predecode: bool | None = None) -> torch.Tensor:
    """Weighted sum of the routed experts picked per token (spec §3.9), fp32 [T, D], with the
    GEMMs on FP8 tensor cores: the contract of ``triton_moe.moe_experts`` restricted to MXFP4
    stacks under official numerics (``act_block`` set) and bf16 compute (ValueError otherwise).

    x [T, D] bf16; topk_ids [T, k] (ids outside 0..E-1 are skipped); topk_weights [T, k];
    ``cfg``: the tile plan (None: :func:`pick_fp8mma_config`); ``predecode``: re-encode each
    chunk of experts to FP8 codes first and run the GEMMs on them (same bytes, same dots), or
    decode in the GEMMs' K loop (None: :data:`FP8MMA_PREDECODE`); predecoded with
    ``experts.fp8_codes`` set (:func:`encode_fp8_codes`), the GEMMs read those kept codes and
    nothing is re-encoded (same bits).  Stacks whose scale spread is
    beyond :data:`FOLD_SPREAD` somewhere (or unchecked inside a CUDA-graph capture) run the
    bf16-MMA kernels (``triton_moe.moe_experts_with_config``).  Off CUDA without the Triton
    interpreter it runs the torch twin.
    """
    ab = _check_fp8mma(x, experts)
    _check_experts(x, topk_ids, topk_weights, experts)
    if x.device.type != "cuda" and not _INTERPRET_HOST:
        from dsv4.ops import torch_dense
        return torch_dense.moe_experts(x, topk_ids, topk_weights, experts, swiglu_limit)
    T, D = x.shape
    E, inter, k = experts.num_experts, experts.inter_dim, topk_ids.shape[1]
    if T == 0 or k == 0:
        return torch.zeros(T, D, dtype=torch.float32, device=x.device)
    ks = k_step(ab)
    if experts.kchunk and experts.kchunk != ks:
        raise ValueError(f"moe_experts_fp8mma: K-chunk-major stacks need kchunk = the K step "
                         f"{ks}; found kchunk={experts.kchunk}")
    if not fold_spread_ok(experts, ks):
        from dsv4.ops import triton_moe
        return triton_moe.moe_experts_with_config(x, topk_ids, topk_weights, experts,
                                                  swiglu_limit, None)
    out = torch.empty(T, D, dtype=torch.float32, device=x.device)
    P = T * k
    predecode = FP8MMA_PREDECODE if predecode is None else bool(predecode)
    resident = experts.fp8_codes if predecode else None
    if resident is not None and (resident.ks != ks or resident.q1.shape != (E, inter, D)):
        raise ValueError(f"moe_experts_fp8mma: the kept FP8 codes are for other stacks (K step "
                         f"{resident.ks}, {tuple(resident.q1.shape)}); expected K step {ks}, "
                         f"{(E, inter, D)}")
    # Without kept codes, the Gluon GEMMs on the MXFP4 stacks (DSV4_FP8MMA_MX, read per call)
    # replace the re-encoding and the GEMMs on its codes, with their plans' row blocks; their
    # activation codes are in the MMA order of gluon_moe_mxfp4.mx_k_position (prep ORDER 1).
    from dsv4.ops import gluon_moe_mxfp4 as _mx
    mx_up, mx_down = _mx.plans_for(P, experts.spread)
    use_mx = (predecode and resident is None and mx_applies(x, experts, P)
              and (cfg is None or cfg.BM == mx_up.BM) and mx_up.BM == mx_down.BM)
    if cfg is None:
        cfg = pick_fp8mma_config(P, E, predecode)
        if use_mx:
            cfg = replace(cfg, BM=mx_up.BM)
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
    kchunk = bool(experts.kchunk)

    order = 1 if use_mx else 0
    xq = torch.empty(rows, D, dtype=e4m3, device=x.device)
    xs = torch.empty(rows, D // ab, dtype=torch.float32, device=x.device)
    _fp8_prep_kernel[(nb, D // ab)](x, pairs, block_expert, xq, xs, P, E, k, x.stride(0),
                                    xq.stride(0), xs.stride(0), GATHER=True, BM=cfg.BM, AB=ab,
                                    ORDER=order, num_warps=4, **pdl_args(x))
    act = torch.empty(rows, inter, dtype=torch.bfloat16, device=x.device)
    n_up, n_down = triton.cdiv(inter, cfg.BN_up), triton.cdiv(D, cfg.BN_down)
    # triton_moe.N_FIRST read per call (a benchmark flips it between runs).
    grid_up, first_up = tile_grid(nb, n_up, n_first=_triton_moe.N_FIRST)
    grid_down, first_down = tile_grid(nb, n_down, n_first=_triton_moe.N_FIRST)
    up = dict(HAS_LIMIT=swiglu_limit > 0, ASM_DECODE=asm, AB=ab, KS=ks, BM=cfg.BM,
              BN=cfg.BN_up, N_FIRST=first_up, num_warps=cfg.warps_up, num_stages=cfg.stages)
    down = dict(ASM_DECODE=asm, AB=ab, KS=ks, BM=cfg.BM, BN=cfg.BN_down, N_FIRST=first_down,
                num_warps=cfg.warps_down, num_stages=cfg.stages)
    # The Gluon GEMMs on the codes (DSV4_FP8MMA_GLUON, read per call): same bits.
    use_gluon = (predecode and _gluon.enabled(resident is not None)
                 and cfg.BM == _gluon.PLAN_UP.BM
                 and cfg.BM == _gluon.PLAN_DOWN.BM
                 and _gluon.qualifies(x, D, inter, ks, _gluon.PLAN_UP)
                 and _gluon.qualifies(x, inter, D, ks, _gluon.PLAN_DOWN))
    if use_mx:
        _mx.gemm_up(xq, xs, w1, s1, w3, s3, pairs, block_expert, wts, act, P, swiglu_limit, ab,
                    mx_up, n_first=first_up)
    elif not predecode:
        _fp8mma_up_kernel[grid_up](
            xq, xs, w1, w3, s1, s3, pairs, block_expert, wts, act, P, inter, D, 0, E,
            xq.stride(0), xs.stride(0), act.stride(0), w1.stride(0), w1.stride(1), s1.stride(0),
            s1.stride(1), float(swiglu_limit), **up, KCHUNK=kchunk, **pdl_args(xq))
    else:
        if resident is not None:     # codes kept on the device: one chunk, nothing to encode
            slots, chunk = 1, E
            bufs = [(resident.q1, resident.q3, resident.f1, resident.f3)]
            if resident.ready is not None:   # encode_ahead's: the plan and prep ran meanwhile
                torch.cuda.current_stream(x.device).wait_event(resident.ready)
        else:
            overlap = PREDECODE_OVERLAP and x.is_cuda and not _INTERPRET_HOST
            slots = 2 if overlap and predecode_chunk(E, inter, D) < E else 1
            chunk = predecode_chunk(E, inter, D, slots)
            bufs = [_predecode_buffers(chunk, inter, D, ks, x.device) for _ in range(slots)]
        free: list = [None] * slots

        def predecode_up(slot: int, e0: int, e1: int) -> None:
            if resident is not None:
                return
            q1, q3, f1, f3 = bufs[slot]
            _predecode(w1, s1, q1, f1, e0, e1, asm, ks, kchunk=kchunk)
            _predecode(w3, s3, q3, f3, e0, e1, asm, ks, kchunk=kchunk)

        def gemm_up(slot: int, e0: int, e1: int) -> None:
            q1, q3, f1, f3 = bufs[slot]
            if use_gluon:
                _gluon.gemm_up(xq, xs, q1, q3, f1, f3, pairs, block_expert, wts, act, P, e0,
                               e1, swiglu_limit, ab, ks, n_first=first_up)
                return
            _fp8mma_up_kernel[grid_up](
                xq, xs, q1, q3, f1, f3, pairs, block_expert, wts, act, P, inter, D, e0, e1,
                xq.stride(0), xs.stride(0), act.stride(0), q1.stride(0), q1.stride(1),
                f1.stride(0), f1.stride(1), float(swiglu_limit), **up, PREDECODED=True,
                **pdl_args(xq))

        _run_chunks(E, chunk, slots, x.device, free, predecode_up, gemm_up)
    del xq, xs
    aq = torch.empty(rows, inter, dtype=e4m3, device=x.device)
    as_ = torch.empty(rows, inter // ab, dtype=torch.float32, device=x.device)
    _fp8_prep_kernel[(nb, inter // ab)](act, pairs, block_expert, aq, as_, P, E, k,
                                        act.stride(0), aq.stride(0), as_.stride(0),
                                        GATHER=False, BM=cfg.BM, AB=ab, ORDER=order,
                                        num_warps=4, **pdl_args(act))
    del act
    y = torch.empty(P, D, dtype=torch.bfloat16, device=x.device)
    if use_mx:
        _mx.gemm_down(aq, as_, w2, s2, pairs, block_expert, y, P, ab, mx_down,
                      n_first=first_down)
    elif not predecode:
        _fp8mma_down_kernel[grid_down](
            aq, as_, w2, s2, pairs, block_expert, y, P, D, inter, 0, E, aq.stride(0),
            as_.stride(0), y.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
            **down, KCHUNK=kchunk, **pdl_args(aq))
    else:
        if resident is not None:
            down_bufs = [(resident.q2, resident.f2)]
        else:
            # w2 [chunk, D, I] in the storage of w1's codes [chunk, I, D] (same size).
            down_bufs = [(q1.view(chunk, D, inter), f1.view(chunk, inter // ks, D))
                         for q1, _, f1, _ in bufs]

        def predecode_down(slot: int, e0: int, e1: int) -> None:
            if resident is not None:
                return
            q2, f2 = down_bufs[slot]
            _predecode(w2, s2, q2, f2, e0, e1, asm, ks, kchunk=kchunk)

        def gemm_down(slot: int, e0: int, e1: int) -> None:
            q2, f2 = down_bufs[slot]
            if use_gluon:
                _gluon.gemm_down(aq, as_, q2, f2, pairs, block_expert, y, P, e0, e1, ab, ks,
                                 n_first=first_down)
                return
            _fp8mma_down_kernel[grid_down](
                aq, as_, q2, f2, pairs, block_expert, y, P, D, inter, e0, e1, aq.stride(0),
                as_.stride(0), y.stride(0), q2.stride(0), q2.stride(1), f2.stride(0),
                f2.stride(1), **down, PREDECODED=True, **pdl_args(aq))

        _run_chunks(E, chunk, slots, x.device, free, predecode_down, gemm_down)
        del bufs, down_bufs
    del aq, as_
    BD = min(1024, triton.next_power_of_2(D))
    _moe_combine_kernel[(T, triton.cdiv(D, BD))](y, ids, out, out, D, E, TOPK=k, BD=BD, num_warps=4,
                                                 **pdl_args(y))
    return out
