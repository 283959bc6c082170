"""Triton kernels of the dense hot ops: the FP8 block GEMM with fused activation quantization
(spec §2.4-2.5) and the mHC pre / post / head mixes (spec §3.4, §3.10).

Same signatures as the torch twins in ``dsv4/ops/torch_dense.py``.  The kernels run on Hopper
GPUs and, at tiny shapes, in the Triton interpreter (``TRITON_INTERPRET=1``) on CPU tensors.

FP8 rounding is done by hand (:func:`round_to_e4m3`) onto the e4m3 grid in fp32 before the cast,
so the quantized values are bit-identical on the GPU and in the interpreter (whose own fp32→fp8
cast mis-rounds values whose mantissa carries into the exponent).
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, TypeVar

import torch
import triton
import triton.language as tl

__all__ = ["fp8_linear", "fp8_linear_with_config", "act_quant", "Fp8GemmConfig",
           "pick_fp8_config", "hc_pre", "hc_post", "hc_post_pre", "hc_head", "mma",
           "round_to_bf16", "store_rne"]

_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_E4M3 = torch.float8_e4m3fn


_F = TypeVar("_F", bound=Callable[..., Any])


def torch_twin_off_gpu(module: str) -> Callable[[_F], _F]:
    """Route calls on non-CUDA tensors to the torch twin of the same name in ``module``
    (unless the Triton interpreter is on), so ``get_ops("triton")`` works on any device."""
    def deco(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else next(iter(kwargs.values()))
            if first.device.type != "cuda" and not _INTERPRET_HOST:
                return getattr(importlib.import_module(module), fn.__name__)(*args, **kwargs)
            return fn(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return deco


# ------------------------------------------------------------------------- shared jit helpers
# The interpreter multiplies bf16 tiles as raw uint16 integers: kernels upcast them there.
_INTERPRET_HOST = os.environ.get("TRITON_INTERPRET", "0") == "1"
INTERPRET = tl.constexpr(_INTERPRET_HOST)


@triton.jit
def mma(a, b, PREC: tl.constexpr):
    """``tl.dot(a, b)`` with fp32 accumulation; PREC applies to fp32 operands only."""
    if INTERPRET:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
        if b.dtype == tl.bfloat16:
            b = b.to(tl.float32)
    if a.dtype == tl.float32:
        c = tl.dot(a, b, input_precision=PREC)
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def e8m0_to_f32(b):
    """uint8 e8m0 exponents → fp32 ``2^(b-127)`` exactly (built from the exponent bits)."""
    return (b.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_from_exp(e):
    """int32 exponent e (normal range) → fp32 ``2^e`` exactly."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3(v):
    """Round fp32 ``v`` (|v| <= 448) to the nearest e4m3fn value, ties to even, kept in fp32.

    Normal range: round the fp32 mantissa to 3 bits in integer space (a carry into the exponent
    is then exact).  Below 2^-6 the e4m3 grid is uniform (step 2^-9): the 1.5·2^23 trick rounds.
    """
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576  # clear the low 20 mantissa bits, RNE
    normal = b.to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2**23
    sub = ((v * 512.0 + magic) - magic) * 0.001953125
    sub = tl.where(sub == 0.0, v * 0.0, sub)  # keep the sign of zero, as a real cast does
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def round_to_bf16(v):
    """Round fp32 ``v`` to bf16 precision (nearest, ties to even), kept in fp32.

    The GPU's fp32→bf16 cast already rounds this way; the interpreter's truncates, so every bf16
    store goes through here and both give the same bits."""
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def store_rne(ptrs, v, mask):
    """Store fp32 ``v`` into ``ptrs`` (any float dtype), bf16 rounded to nearest-even."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        v = round_to_bf16(v)
    tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def round_as(v, ptr):
    """fp32 ``v`` rounded as a store through ``ptr`` would round it (bf16 RNE), kept in fp32."""
    if ptr.dtype.element_ty == tl.bfloat16:
        v = round_to_bf16(v)
    return v


@triton.jit
def ue8m0_exponent(amax):
    """Exponent e of the power-of-two scale ``2^ceil(log2(amax · fp32(1/448)))``, read off the
    fp32 bits like the reference's ``fast_round_scale`` (a multiply by the fp32 reciprocal of
    448, not a division)."""
    t = amax * 0.002232142857142857
    bits = t.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def quantize_block_rows(x):
    """Per-row e4m3 quantization of a [R, B] fp32 tile (spec §2.5: amax floor 1e-4, ue8m0
    scale, clamp to ±448, round to nearest even): returns (q fp32 on the e4m3 grid, s [R])."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    e = ue8m0_exponent(amax)
    # x · 2^-e is exactly the reference's x / s (both scales are exact powers of two).
    q = tl.clamp(x * pow2_from_exp(-e)[:, None], -448.0, 448.0)
    return round_to_e4m3(q), pow2_from_exp(e)


# ------------------------------------------------------------------------------ act quant
@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, n_kb,
                      B: tl.constexpr, BR: tl.constexpr):
    pid_r = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = kb * B + tl.arange(0, B)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    q, s = quantize_block_rows(x.to(tl.float32))
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=mask)
    tl.store(s_ptr + rows * n_kb + kb, s, mask=rows < M)


def act_quant(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference activation quantizer on the GPU: x [M, K] → (q e4m3 [M, K], s fp32 [M, K/block])."""
    if x.dim() != 2 or x.shape[1] % block:
        raise ValueError(f"act_quant: x must be [M, K] with K a multiple of block={block}; "
                         f"found {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    M, K = x.shape
    n_kb = K // block
    q = torch.empty(M, K, dtype=_E4M3, device=x.device)
    s = torch.empty(M, n_kb, dtype=torch.float32, device=x.device)
    BR = 32
    if M and n_kb:
        _act_quant_kernel[(triton.cdiv(M, BR), n_kb)](
            x, q, s, M, K, x.stride(0), q.stride(0), n_kb, B=block, BR=BR, num_warps=4)
    return q, s


# ------------------------------------------------------------------------------ split-K
@triton.jit
def splitk_reduce(acc, part, mask, split, stride_ws, count, SPLITS: tl.constexpr):
    """The split-K reduction inside a GEMM kernel: split ``split`` of SPLITS stores its fp32
    partial tile ``acc`` at ``part + split·stride_ws`` and counts itself in at its tile's
    arrival counter ``count``; returns ``(last, total)``: ``last`` for the split that arrived
    last, which gets ``total`` = the slices summed in the fixed order ``((s0 + s1) + s2) + …``
    (bit-reproducible whatever the arrival order) and has reset the counter to 0 (the next
    launch and CUDA-graph replays start clean); the caller stores ``total`` when ``last``."""
    tl.store(part + split * stride_ws, acc, mask=mask)
    # Every thread's partial stores are issued before one thread publishes the arrival; the
    # release of the atomic then orders them before any later acquirer's reads.
    tl.debug_barrier()
    arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLITS - 1
    total = acc
    if last:
        # The acquire was done by one thread: the barrier orders all threads' reads after it
        # (cheap, and independent of how the atomic's result is broadcast).
        tl.debug_barrier()
        # Unrolled, so the SPLITS loads are in flight together (one L2 round trip); .cg reads
        # L2, never a possibly stale L1 line.
        total = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLITS):
            total += tl.load(part + s * stride_ws, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(count, 0)
    return last, total


# ------------------------------------------------------------------------------ FP8 GEMM
@triton.jit
def _fp8_gemm_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr, ws_ptr, count_ptr,
                     M, N, K, stride_am, stride_wn, stride_om, stride_ws, stride_wm, n_kb,
                     k_blocks_per_split,
                     QUANT_A: tl.constexpr, SW_E8M0: tl.constexpr, B: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                     SPLITS: tl.constexpr):
    """out[M, N] = Σ_kb (A8·sA)(W8·sW)^T, one B-wide K block per step.

    QUANT_A: A is the raw activation (bf16/fp32) and is quantized here, per row and K block,
    exactly as the reference act_quant; else A is e4m3 with fp32 scales sa [M, n_kb].
    Grid: (tiles of M×N in grouped order, SPLITS).  With SPLITS == 1 the tile is stored
    straight into ``out``.  Otherwise split s covers K blocks
    ``[s·k_blocks_per_split, min((s+1)·k_blocks_per_split, n_kb))`` (the last may be shorter)
    and the reduction happens here, deterministically:

    1. every split stores its fp32 partial tile into its slice ``ws[s]`` of the workspace;
    2. it then bumps the tile's int32 arrival counter ``count[pid]`` (acq_rel, gpu scope);
    3. the split that arrives last re-reads all the slices (its own too: the same bits) and
       sums them in the fixed order ``((ws[0] + ws[1]) + ws[2]) + … + ws[SPLITS−1]`` (fp32),
       so the bits never depend on which split arrived last; it stores the sum in out's dtype
       (bf16 rounded to nearest-even) and resets the counter to 0 for the next launch (and
       CUDA-graph replays).
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    # Grouped ordering: consecutive programs share W tiles in L2.
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    gsize = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gsize
    pid_n = (pid % group) // gsize

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, B)
    m_mask = rm < M
    n_mask = rn < N
    # Weight scale row of each output column (blocks are B×B).
    sw_row = sw_ptr + (rn // B) * n_kb

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    kb0 = split * k_blocks_per_split
    kb1 = tl.minimum(kb0 + k_blocks_per_split, n_kb)
    for kb in range(kb0, kb1):
        ks = kb * B + rk
        k_mask = ks < K
        a = tl.load(a_ptr + rm[:, None] * stride_am + ks[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if QUANT_A:
            q, sa = quantize_block_rows(a.to(tl.float32))
            a8 = q.to(tl.float8e4nv)
        else:
            a8 = a
            sa = tl.load(sa_ptr + rm * n_kb + kb, mask=m_mask, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + ks[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if SW_E8M0:
            sw = e8m0_to_f32(tl.load(sw_row + kb, mask=n_mask, other=127))
        else:
            sw = tl.load(sw_row + kb, mask=n_mask, other=1.0)
        # A fresh dot per K block keeps the tensor-core partial sums short (Hopper FP8 MMA
        # accumulates with reduced precision); the scaled sum is fp32.
        acc += tl.dot(a8, tl.trans(w)) * (sa[:, None] * sw[None, :])
    mask = m_mask[:, None] & n_mask[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    if SPLITS > 1:
        part = ws_ptr + rm[:, None] * stride_wm + rn[None, :]
        last, total = splitk_reduce(acc, part, mask, split, stride_ws, count_ptr + pid, SPLITS)
        if last:
            store_rne(out, total, mask)
    else:
        store_rne(out, acc, mask)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tile plan of one FP8 GEMM launch."""

    BM: int
    BN: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    fuse_quant: bool = True  # quantize A inside the GEMM (decode) or in a separate pass


# Above this many rows the activation is quantized once in its own pass: re-quantizing it in
# every N tile would cost CUDA-core time comparable to the FP8 MMA itself.
_FUSE_QUANT_MAX_M = 64


@lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small stand-in off the GPU)."""
    if device.type != "cuda":
        return 4  # the interpreter: a token value that still exercises split-K
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def pick_fp8_config(M: int, N: int, K: int, block: int, device: torch.device) -> Fp8GemmConfig:
    """Tile plan by shape (tuned on the H200, docs/PERFORMANCE.md).

    Prefill (M > 64): 64×128 tiles, one warpgroup, 4 stages, A quantized in its own pass.
    Decode: the weight stream must keep ~2 programs per SM busy: the widest N tile that
    reaches that with at most 8 K splits (each keeping >= 2 K blocks), and the fewest splits
    that do.  Splitting costs no extra launch (the last split of each tile sums the fp32
    slices in the kernel), so a wide split tile beats a narrow unsplit one: on the H200 at
    M = 1, N = 8192, K = 1024, BN 128 × 4 splits took 8.0 µs against 9.3 for BN 32 unsplit,
    and N = 16384, K = 1024 (wq_b at TP 2) BN 128 × 2 splits 11.1 µs against 12.7 for BN 64.
    """
    n_kb = triton.cdiv(K, block)
    stages = 3 if block >= 128 else 6
    if M > _FUSE_QUANT_MAX_M:
        return Fp8GemmConfig(BM=64, BN=128, num_warps=4, num_stages=4 if block >= 128 else 6,
                             fuse_quant=False)
    bm = max(16, triton.next_power_of_2(M))
    target = int(1.9 * sm_count(device))
    # 64-row tiles run on a full warpgroup MMA: narrow N tiles measured slower there.
    widths = (128, 64, 32) if bm < 64 else (128, 64)
    tiles = {bn: triton.cdiv(M, bm) * triton.cdiv(N, bn) for bn in widths}
    max_split = max(1, min(8, n_kb // 2))
    bn = next((b for b in widths if tiles[b] * max_split >= target), widths[-1])
    split = max(1, min(max_split, triton.cdiv(target, tiles[bn])))
    return Fp8GemmConfig(BM=bm, BN=bn, split_k=split, num_warps=4, num_stages=stages)


# Split-K arrival counters, one int32 per output tile, per device.  Every launch leaves them at
# zero (the last split of each tile resets its counter), so they are zeroed once, at allocation,
# and never per call.  Growing allocates: the first call of each shape must happen before any
# CUDA-graph capture (the engine's and the bench's warm-up runs do that), and the split plans
# (FP8 GEMM, experts, linear_fp32: all share this buffer) never need more than a few tiles per
# SM, well under the initial size.  Launches that could run concurrently on two streams of one
# device would share these counters: the ops run a device's kernels on one stream.
_SPLITK_MIN_COUNTERS = 4096
_splitk_counter_cache: dict[torch.device, torch.Tensor] = {}
# Outgrown buffers are kept alive: a captured CUDA graph still holds their addresses.
_splitk_retired: list[torch.Tensor] = []


def splitk_counters(device: torch.device, tiles: int, op: str = "split-K") -> torch.Tensor:
    """The zeroed int32 arrival counters of ``device``, at least ``tiles`` of them: one buffer
    per device shared by every split-K kernel (FP8 GEMM, experts, ``linear_fp32``), whose
    launches are stream-ordered and each leave their counters at zero.  ``op`` names the caller
    in the error raised when the buffer would have to grow inside a CUDA-graph capture."""
    buf = _splitk_counter_cache.get(device)
    if buf is not None and buf.numel() >= tiles:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{op}: a split-K launch needs {tiles} tile counters but the buffer holds "
            f"{0 if buf is None else buf.numel()}; growing it inside a CUDA-graph capture is not "
            "allowed: run this shape once before capturing")
    if buf is not None:
        _splitk_retired.append(buf)
    size = max(_SPLITK_MIN_COUNTERS, triton.next_power_of_2(tiles))
    buf = torch.zeros(size, dtype=torch.int32, device=device)
    _splitk_counter_cache[device] = buf
    return buf


def _check_fp8_args(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int) -> None:
    if w8.dim() != 2 or w8.dtype != _E4M3:
        raise ValueError(f"fp8_linear: weight must be a 2-D float8_e4m3fn tensor; found "
                         f"{w8.dtype} of shape {tuple(w8.shape)}")
    N, K = w8.shape
    if x.shape[-1] != K:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} input features, weight expects {K}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"fp8_linear: block must be a power of two >= 16; found {block}")
    if K % block:
        raise ValueError(f"fp8_linear: input features {K} are not a multiple of block {block}")
    want = (triton.cdiv(N, block), triton.cdiv(K, block))
    if tuple(w_scale.shape) != want:
        raise ValueError(f"fp8_linear: weight scale must be {list(want)} for a [{N}, {K}] weight "
                         f"with block {block}; found {list(w_scale.shape)}")
    if w_scale.dtype not in (_E8M0, torch.float32):
        raise ValueError(f"fp8_linear: weight scale dtype must be float8_e8m0fnu or float32; "
                         f"found {w_scale.dtype}")
    if x.device != w8.device or w_scale.device != w8.device:
        raise ValueError(f"fp8_linear: x, weight and scale must share a device; found "
                         f"{x.device}, {w8.device}, {w_scale.device}")


def fp8_linear_with_config(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int,
                           out_dtype: torch.dtype | None, cfg: Fp8GemmConfig | None
                           ) -> torch.Tensor:
    """:func:`fp8_linear` with an explicit tile plan (``None``: :func:`pick_fp8_config`)."""
    _check_fp8_args(x, w8, w_scale, block)
    out_dtype = out_dtype or x.dtype
    N, K = w8.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M == 0 or N == 0:
        return torch.empty(*lead, N, dtype=out_dtype, device=x.device)
    w8 = w8 if w8.stride(1) == 1 else w8.contiguous()
    n_kb = K // block
    if cfg is None:
        cfg = pick_fp8_config(M, N, K, block, x.device)
    if w_scale.dtype == torch.float32:
        sw, sw_e8m0 = w_scale.contiguous(), False
    else:
        sw, sw_e8m0 = w_scale.contiguous().view(torch.uint8), True
    if cfg.fuse_quant:
        a, sa = x2, x2  # sa unused when QUANT_A
    else:
        a, sa = act_quant(x2, block)
    split = max(1, min(cfg.split_k, n_kb))
    kbps = triton.cdiv(n_kb, split)
    split = triton.cdiv(n_kb, kbps)  # every split gets >= 1 K block (the last may get fewer)
    tiles = triton.cdiv(M, cfg.BM) * triton.cdiv(N, cfg.BN)
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if split == 1:
        ws, counters = out, out  # unused with one split
    else:
        # Per-call workspace: the caching allocator serves it (also inside CUDA graphs).
        ws = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        counters = splitk_counters(x.device, tiles, "fp8_linear")
    _fp8_gemm_kernel[(tiles, split)](
        a, sa, w8, sw, out, ws, counters, M, N, K, a.stride(0), w8.stride(0), out.stride(0),
        ws.stride(0) if split > 1 else 0, ws.stride(-2), n_kb, kbps,
        QUANT_A=cfg.fuse_quant, SW_E8M0=sw_e8m0, B=block, BM=cfg.BM, BN=cfg.BN,
        GROUP_M=cfg.group_m, SPLITS=split, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out.view(*lead, N)


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP8 block GEMM with the activation quantization fused (spec §2.5).

    x [..., K] (bf16 / fp32); w8 [N, K] float8_e4m3fn; w_scale [ceil(N/block), K/block]
    (float8_e8m0fnu or fp32).  x is quantized per row and per ``block`` of K to e4m3 with
    power-of-two scales; ``y = Σ_kblocks (x8·sx)(W8·sW)^T`` in fp32, returned in ``out_dtype``
    (default x.dtype).
    """
    return fp8_linear_with_config(x, w8, w_scale, block, out_dtype, None)


# ------------------------------------------------------------------------------ mHC
# Why the prefill launches were slow (dsv4 issue #5; register counts from the offline sm_90
# compile of the real launches, T = 8192, bf16 streams): the fused post + mixes kernel ran
# BT 64 × BD 32 at 4 warps with a tf32x3 dot: 255 registers + 624 B of spills and 114 KB of
# shared memory, so one 4-warp program per SM; a 32-column chunk gives each thread one bf16
# (2-byte accesses); tf32x3 splits the fp32 A tile into two more register tiles.  The plain
# mixes kernel (hc_pre) at BT 64 spilled too.  The fused kernel now computes each output stream
# as its own 2-D tile with its own dot (no 3-D tile reshaped into an MMA operand), and the
# prefill plans take more warps and, for bf16 streams, the "bf16x3" mix: the bf16 activation
# is exact as an MMA operand and fn is split exactly into three bf16 parts, so three bf16 MMAs
# give the fp32 products exactly (fp32 sums; tf32x3 drops a lo·lo term) with no split of the
# activation tile.
@dataclass(frozen=True)
class HcPlan:
    """Tile plan of one mHC launch.

    BT tokens per program (``hc_post``: 1, one token per program); BD columns of each of the n
    streams per chunk (the mixes dot runs over n·BD columns of flatten(x)); num_warps /
    num_stages of the launch; per_sm: the D (K) split aims at this many programs per SM;
    mix: "fp32" (tf32x3 on the GPU, ieee where rejected and in the interpreter) or "bf16x3"
    (bf16 streams only: three exact bf16 parts of fn against the bf16 activation; fp32 streams
    take "fp32")."""

    BT: int
    BD: int
    num_warps: int = 4
    num_stages: int = 3
    per_sm: int = 2
    mix: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("BT", "BD", "num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"HcPlan: {name} must be a power of two; found {v!r}")
        if self.num_stages < 1 or self.per_sm < 1:
            raise ValueError(f"HcPlan: num_stages and per_sm must be >= 1; found "
                             f"{self.num_stages}, {self.per_sm}")
        if self.mix not in ("fp32", "bf16x3"):
            raise ValueError(f"HcPlan: mix must be 'fp32' or 'bf16x3'; found {self.mix!r}")

    def label(self) -> str:
        """Short text for tables: BTxBD/warps/stages/per_sm/mix."""
        return (f"BT{self.BT} BD{self.BD} w{self.num_warps} s{self.num_stages} "
                f"sm{self.per_sm} {self.mix}")


# From this many tokens the prefill plans apply; below, the decode plans of before (unchanged).
HC_PREFILL_T = 1024


def pick_hc_plan(op: str, T: int, n: int, D: int, dtype: torch.dtype) -> HcPlan:
    """Default plan of ``op`` ("pre": hc_pre / hc_head mixes, "post_pre": the fused post +
    mixes, "post": hc_post) for T tokens of n streams of width D.

    The H200 sweep (bench/sweep_glue.py, docs/PERFORMANCE.md fifth session, V4-Flash widths):
    bf16 streams take the "bf16x3" mixes at every T (exact products; 4–8% faster than the
    fp32 path at decode, ~2× at prefill), so decode and prefill sum the same products.  Decode
    (T < HC_PREFILL_T) keeps the tile sizes the kernels had before plans existed.  Prefill: the
    fused post + mixes on 16-column chunks with 4 warps and ~4 programs per SM (8,192 tokens:
    577 µs against 795 for 32-column chunks at 8 warps, 1,255 before plans); the mixes alone on
    64-token tiles at 4 warps (259 µs, 187 registers, no spills)."""
    mix = "bf16x3" if dtype == torch.bfloat16 else "fp32"
    chunk = max(triton.cdiv(16, n), min(128 // n, triton.next_power_of_2(D)))
    if op == "post":
        return HcPlan(BT=1, BD=min(512, triton.next_power_of_2(D)), num_warps=4, num_stages=3)
    if op not in ("pre", "post_pre"):
        raise ValueError(f"pick_hc_plan: op must be 'pre', 'post_pre' or 'post'; found {op!r}")
    if T < HC_PREFILL_T:
        return HcPlan(BT=16, BD=chunk, num_warps=4, num_stages=3, mix=mix)
    if op == "pre":
        return HcPlan(BT=64, BD=chunk, num_warps=4, num_stages=3, per_sm=2, mix=mix)
    return HcPlan(BT=64, BD=max(triton.cdiv(16, n), chunk // 2), num_warps=4, num_stages=3,
                  per_sm=4, mix=mix)


@triton.jit
def _dot_bf16x3(acc, a, f):
    """acc += a @ f for a bf16 tile ``a`` and an fp32 tile ``f``: f is split into three bf16
    parts whose sum is f exactly (each remainder is exact in fp32 and has <= 16, then <= 8
    significant bits; the interpreter's truncating cast splits exactly too), so each product is
    exact and only the fp32 sums round."""
    f1 = f.to(tl.bfloat16)
    r = f - f1.to(tl.float32)
    f2 = r.to(tl.bfloat16)
    f3 = (r - f2.to(tl.float32)).to(tl.bfloat16)
    acc += mma(a, f3, "ieee")
    acc += mma(a, f2, "ieee")
    acc += mma(a, f1, "ieee")
    return acc


@triton.jit
def _hc_mix_partial_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, T, KTOT, k_per_split,
                           NJ: tl.constexpr, NJP: tl.constexpr, BT: tl.constexpr,
                           BK: tl.constexpr, PRECISION: tl.constexpr, BF16X3: tl.constexpr):
    """Split-K partials of ``flatten(x) @ fn^T`` [T, NJ] and of Σ x² [T] (fp32).

    BF16X3 (bf16 x): the x tile is the MMA operand as loaded, fn in three exact bf16 parts."""
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    rt = pid_t * BT + tl.arange(0, BT)
    rj = tl.arange(0, NJP)
    t_mask = rt < T
    j_mask = rj < NJ
    acc = tl.zeros((BT, NJP), dtype=tl.float32)
    sq = tl.zeros((BT,), dtype=tl.float32)
    k0 = split * k_per_split
    for kk in range(0, k_per_split, BK):
        rk = k0 + kk + tl.arange(0, BK)
        k_mask = (rk < KTOT) & (kk + tl.arange(0, BK) < k_per_split)
        xl = tl.load(x_ptr + rt[:, None] * KTOT + rk[None, :],
                     mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        xv = xl.to(tl.float32)
        fv = tl.load(fn_ptr + rj[None, :] * KTOT + rk[:, None],
                     mask=k_mask[:, None] & j_mask[None, :], other=0.0)
        if BF16X3:
            acc = _dot_bf16x3(acc, xl, fv)
        else:
            acc += tl.dot(xv, fv, input_precision=PRECISION)
        sq += tl.sum(xv * xv, axis=1)
    base = split * T
    tl.store(part_ptr + (base + rt[:, None]) * NJP + rj[None, :], acc,
             mask=t_mask[:, None] & j_mask[None, :])
    tl.store(sq_ptr + base + rt, sq, mask=t_mask)


@triton.jit
def _hc_sum_vec(part_ptr, t, T, NJP: tl.constexpr, offs, SPLITS, SP: tl.constexpr):
    """Σ over splits of the partial mixes at the [n] columns ``offs`` of token t (one load)."""
    rs = tl.arange(0, SP)
    v = tl.load(part_ptr + (rs[:, None] * T + t) * NJP + offs[None, :],
                mask=(rs < SPLITS)[:, None], other=0.0)
    return tl.sum(v, axis=0)


@triton.jit
def _hc_sum_mat(part_ptr, t, T, NJP: tl.constexpr, offs, SPLITS, SP: tl.constexpr):
    """Σ over splits of the partial mixes at the [n, n] columns ``offs`` of token t."""
    rs = tl.arange(0, SP)
    v = tl.load(part_ptr + (rs[:, None, None] * T + t) * NJP + offs[None, :, :],
                mask=(rs < SPLITS)[:, None, None], other=0.0)
    return tl.sum(v, axis=0)


@triton.jit
def _hc_collapse_kernel(x_ptr, part_ptr, sq_ptr, scale_ptr, base_ptr, y_ptr, post_ptr, comb_ptr,
                        T, D, SPLITS, norm_eps, hc_eps, ITERS: tl.constexpr, N: tl.constexpr,
                        NJP: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr,
                        HEAD: tl.constexpr):
    """Per token: RMS factor, sigmoid gates, Sinkhorn (in registers), collapse Σ_j pre_j·x_j.

    HEAD: the final hc_head (mixes are the n pre gates only; no post / Sinkhorn).
    Grid (T, D blocks); every D block recomputes the tiny gate math, block 0 writes post/comb.
    (At T = 8192 it moved 335 MB in 83 µs on the H200, ~4 TB/s: at its bytes floor already.)
    """
    t = tl.program_id(0)
    pid_d = tl.program_id(1)
    rs = tl.arange(0, SP)
    sq = tl.sum(tl.load(sq_ptr + rs * T + t, mask=rs < SPLITS, other=0.0), axis=0)
    rstd = 1.0 / tl.sqrt(sq / (N * D) + norm_eps)
    rn = tl.arange(0, N)
    pre_mix = _hc_sum_vec(part_ptr, t, T, NJP, rn, SPLITS, SP) * rstd
    pre = tl.sigmoid(pre_mix * tl.load(scale_ptr) + tl.load(base_ptr + rn)) + hc_eps
    if not HEAD:
        if pid_d == 0:
            post_mix = _hc_sum_vec(part_ptr, t, T, NJP, N + rn, SPLITS, SP) * rstd
            post = 2.0 * tl.sigmoid(post_mix * tl.load(scale_ptr + 1)
                                    + tl.load(base_ptr + N + rn))
            tl.store(post_ptr + t * N + rn, post)
            cidx = 2 * N + rn[:, None] * N + rn[None, :]
            c = (_hc_sum_mat(part_ptr, t, T, NJP, cidx, SPLITS, SP) * rstd * tl.load(scale_ptr + 2)
                 + tl.load(base_ptr + cidx))
            # softmax over k (axis 1), + eps, column normalization, then (row, column) rounds.
            c = tl.exp(c - tl.max(c, axis=1)[:, None])
            c = c / tl.sum(c, axis=1)[:, None] + hc_eps
            c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
            for _ in range(ITERS - 1):
                c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
                c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
            tl.store(comb_ptr + t * N * N + rn[:, None] * N + rn[None, :], c)
    rd = pid_d * BD + tl.arange(0, BD)
    d_mask = rd < D
    xv = tl.load(x_ptr + t * N * D + rn[:, None] * D + rd[None, :], mask=d_mask[None, :],
                 other=0.0).to(tl.float32)
    y = tl.sum(pre[:, None] * xv, axis=0)
    store_rne(y_ptr + t * D + rd, y, d_mask)


# fp32 mixes as the reference computes them: "tf32x3" keeps ~fp32 accuracy on tensor cores;
# "ieee" (FMA) is the fallback if this Triton build rejects it, and the interpreter's choice.
_HC_PRECISIONS = ["tf32x3", "ieee"]


def _check_plan(name: str, plan: HcPlan, n: int, dot: bool) -> None:
    if dot and (plan.BT < 16 or n * plan.BD < 16):
        raise ValueError(f"{name}: the mixes dot needs BT >= 16 and n·BD >= 16; found BT "
                         f"{plan.BT}, n·BD {n * plan.BD}")


def _launch_mixes(kernel: Any, grid: tuple[int, int], args: tuple, device: torch.device,
                  plan: HcPlan, bf16x3: bool, **constexprs: Any) -> None:
    """Launch a mixes kernel with the first fp32 dot precision this Triton build accepts."""
    precisions = _HC_PRECISIONS if device.type == "cuda" else ["ieee"]
    for i, prec in enumerate(precisions):
        try:
            kernel[grid](*args, **constexprs, PRECISION=prec, BF16X3=bf16x3,
                         num_warps=plan.num_warps, num_stages=plan.num_stages)
            return
        except Exception:  # compile-time rejection of the precision: drop it for good
            if i + 1 == len(precisions):
                raise
            _HC_PRECISIONS.remove(prec)


def _splits(length: int, chunk: int, tiles: int, plan: HcPlan, device: torch.device
            ) -> tuple[int, int]:
    """(per_split, splits): split ``length`` in multiples of ``chunk`` until the launch has
    ~plan.per_sm programs per SM (decode: T is tiny, the reduction long)."""
    want = max(1, triton.cdiv(plan.per_sm * sm_count(device), tiles))
    per_split = max(chunk, triton.cdiv(triton.cdiv(length, want), chunk) * chunk)
    return per_split, triton.cdiv(length, per_split)


def _hc_mix(x: torch.Tensor, fn: torch.Tensor, rows: int, name: str, plan: HcPlan | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    if x.dim() != 3:
        raise ValueError(f"{name}: x must be [T, n_hc, D]; found shape {tuple(x.shape)}")
    T, n, D = x.shape
    if n < 1 or n & (n - 1):
        raise ValueError(f"{name}: n_hc must be a power of two for the Triton kernel; found {n}")
    if tuple(fn.shape) != (rows, n * D):
        raise ValueError(f"{name}: fn must be [{rows}, {n * D}] for x {tuple(x.shape)}; "
                         f"found {tuple(fn.shape)}")
    plan = plan or pick_hc_plan("pre", T, n, D, x.dtype)
    _check_plan(name, plan, n, dot=True)
    x = x.contiguous()
    fn = fn.float().contiguous()
    ktot = n * D
    njp = max(16, triton.next_power_of_2(rows))
    BT, BK = plan.BT, n * plan.BD
    tiles = triton.cdiv(T, BT)
    k_per_split, splits = _splits(ktot, BK, tiles, plan, x.device)
    part = torch.empty(splits, T, njp, dtype=torch.float32, device=x.device)
    sq = torch.empty(splits, T, dtype=torch.float32, device=x.device)
    if T:
        _launch_mixes(_hc_mix_partial_kernel, (tiles, splits),
                      (x, fn, part, sq, T, ktot, k_per_split), x.device, plan,
                      plan.mix == "bf16x3" and x.dtype == torch.bfloat16,
                      NJ=rows, NJP=njp, BT=BT, BK=BK)
    return x, part, sq, splits, njp


def hc_pre_with_plan(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                     norm_eps: float, hc_eps: float, iters: int, plan: HcPlan | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`hc_pre` with an explicit mixes plan (``None``: :func:`pick_hc_plan`)."""
    n = x.shape[1] if x.dim() == 3 else 0
    if iters < 1:
        raise ValueError(f"hc_pre: iters must be >= 1; found {iters}")
    x, part, sq, splits, njp = _hc_mix(x, fn, (2 + n) * n, "hc_pre", plan)
    T, n, D = x.shape
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    post = torch.empty(T, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=x.device)
    if T:
        BD = min(1024, triton.next_power_of_2(D))
        _hc_collapse_kernel[(T, triton.cdiv(D, BD))](
            x, part, sq, scale.float().contiguous(), base.float().contiguous(), y, post, comb,
            T, D, splits, float(norm_eps), float(hc_eps), ITERS=int(iters), N=n, NJP=njp,
            SP=triton.next_power_of_2(splits), BD=BD, HEAD=False, num_warps=4)
    return y, post, comb


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, iters: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre-mix (spec §3.4): split-K mixes + RMS statistic, then gates, Sinkhorn, collapse.

    x [T, n, D]; fn [(2+n)·n, n·D]; scale [3]; base [(2+n)·n].  Returns y [T, D] (x.dtype),
    post [T, n] fp32, comb [T, n, n] fp32 (rows j = input stream, columns k = output stream).
    """
    return hc_pre_with_plan(x, fn, scale, base, norm_eps, hc_eps, iters, None)


def hc_head_with_plan(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                      norm_eps: float, hc_eps: float, plan: HcPlan | None = None
                      ) -> torch.Tensor:
    """:func:`hc_head` with an explicit mixes plan (``None``: :func:`pick_hc_plan`)."""
    n = x.shape[1] if x.dim() == 3 else 0
    x, part, sq, splits, njp = _hc_mix(x, fn, n, "hc_head", plan)
    T, n, D = x.shape
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T:
        BD = min(1024, triton.next_power_of_2(D))
        _hc_collapse_kernel[(T, triton.cdiv(D, BD))](
            x, part, sq, scale.float().contiguous(), base.float().contiguous(), y, y, y,
            T, D, splits, float(norm_eps), float(hc_eps), ITERS=1, N=n, NJP=njp,
            SP=triton.next_power_of_2(splits), BD=BD, HEAD=True, num_warps=4)
    return y


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """Final collapse of the n streams (spec §3.10): ``Σ_j pre_j x_j``; x [T, n, D] → [T, D]."""
    return hc_head_with_plan(x, fn, scale, base, norm_eps, hc_eps, None)


@triton.jit
def _hc_post_kernel(out_ptr, xr_ptr, post_ptr, comb_ptr, y_ptr, D,
                    N: tl.constexpr, BD: tl.constexpr):
    """new[k, :] = post[k]·out + Σ_j comb[j, k]·x_res[j, :] for one token and D block (fp32)."""
    t = tl.program_id(0)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    d_mask = rd < D
    rn = tl.arange(0, N)
    o = tl.load(out_ptr + t * D + rd, mask=d_mask, other=0.0).to(tl.float32)
    xr = tl.load(xr_ptr + t * N * D + rn[:, None] * D + rd[None, :], mask=d_mask[None, :],
                 other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + rn)
    comb = tl.load(comb_ptr + t * N * N + rn[:, None] * N + rn[None, :])  # [j, k]
    mixed = tl.sum(comb[:, :, None] * xr[:, None, :], axis=0)  # [k, BD]
    new = post[:, None] * o[None, :] + mixed
    store_rne(y_ptr + t * N * D + rn[:, None] * D + rd[None, :], new, d_mask[None, :])


def hc_post_with_plan(out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor,
                      comb: torch.Tensor, plan: HcPlan | None = None) -> torch.Tensor:
    """:func:`hc_post` with an explicit plan (``None``: :func:`pick_hc_plan`); one token per
    program (plan.BT must be 1), plan.BD columns of the n streams, plan.num_warps."""
    _check_post_args("hc_post", out, x_res, post, comb)
    T, n, D = x_res.shape
    plan = plan or pick_hc_plan("post", T, n, D, x_res.dtype)
    if plan.BT != 1:
        raise ValueError(f"hc_post: the kernel takes one token per program (plan BT 1); "
                         f"found BT {plan.BT}")
    y = torch.empty_like(x_res, memory_format=torch.contiguous_format)
    if T:
        _hc_post_kernel[(T, triton.cdiv(D, plan.BD))](
            out.contiguous(), x_res.contiguous(), post.float().contiguous(),
            comb.float().contiguous(), y, D, N=n, BD=plan.BD, num_warps=plan.num_warps,
            num_stages=plan.num_stages)
    return y


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def hc_post(out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """Expand a sublayer output back to n streams (spec §3.4), fp32 math, x_res.dtype out.

    ``new_k = post_k · out + Σ_j comb[j, k] · x_res_j``; out [T, D]; x_res [T, n, D];
    post [T, n]; comb [T, n, n].
    """
    return hc_post_with_plan(out, x_res, post, comb, None)


# ------------------------------------------------------------ mHC post fused with the next pre
@triton.jit
def _load_stream(xr_ptr, rt, j: tl.constexpr, N: tl.constexpr, D, rd, m2):
    """x_res stream j of the BT tokens, columns rd: [BT, BD] fp32."""
    return tl.load(xr_ptr + rt[:, None] * (N * D) + j * D + rd[None, :], mask=m2,
                   other=0.0).to(tl.float32)


@triton.jit
def _comb_col(comb_ptr, rt, t_mask, j: tl.constexpr, k, N: tl.constexpr):
    """comb[t, j, k] of the BT tokens: [BT, 1]."""
    return tl.load(comb_ptr + rt * (N * N) + j * N + k, mask=t_mask, other=0.0)[:, None]


@triton.jit
def _hc_post_mix_kernel(out_ptr, xr_ptr, post_ptr, comb_ptr, fn_ptr, xnew_ptr, part_ptr, sq_ptr,
                        T, D, d_per_split, N: tl.constexpr, NJ: tl.constexpr,
                        NJP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                        PRECISION: tl.constexpr, BF16X3: tl.constexpr):
    """hc_post for BT tokens and one D range of all n (1, 2 or 4) streams, stored once, plus
    the next pre's split-K partials (Σ x_new² and x_new @ fn^T over that range) from the
    stored values.

    Partials go to ``part [splits, T, NJP]`` / ``sq [splits, T]`` exactly as
    ``_hc_mix_partial_kernel`` writes them, so ``_hc_collapse_kernel`` finishes the pre.
    Each output stream k is its own 2-D [BT, BD] tile (the n input streams are loaded once per
    chunk) and its own dot against fn's columns k·D + d: no 3-D tile to reshape into an MMA
    operand.  Every x_new element is ``post_k·out`` then + comb[j, k]·x_res_j for j = 0..n-1
    (one fused multiply-add each), whatever the plan: the stored streams are the same bits
    under every tile plan.  BF16X3 (bf16 streams): the stored bf16 tile is the MMA operand, fn
    in three exact bf16 parts.
    """
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    rt = pid_t * BT + tl.arange(0, BT)
    t_mask = rt < T
    rj = tl.arange(0, NJP)
    j_mask = rj < NJ
    rb = tl.arange(0, BD)
    acc = tl.zeros((BT, NJP), dtype=tl.float32)
    sq = tl.zeros((BT,), dtype=tl.float32)
    d0 = split * d_per_split
    for dd in range(0, d_per_split, BD):
        rd = d0 + dd + rb
        d_mask = (rd < D) & (dd + rb < d_per_split)
        m2 = t_mask[:, None] & d_mask[None, :]
        o = tl.load(out_ptr + rt[:, None] * D + rd[None, :], mask=m2, other=0.0).to(tl.float32)
        x0 = _load_stream(xr_ptr, rt, 0, N, D, rd, m2)
        if N > 1:
            x1 = _load_stream(xr_ptr, rt, 1, N, D, rd, m2)
        if N > 2:
            x2 = _load_stream(xr_ptr, rt, 2, N, D, rd, m2)
            x3 = _load_stream(xr_ptr, rt, 3, N, D, rd, m2)
        for k in tl.static_range(N):
            post_k = tl.load(post_ptr + rt * N + k, mask=t_mask, other=0.0)
            new = post_k[:, None] * o
            new += _comb_col(comb_ptr, rt, t_mask, 0, k, N) * x0
            if N > 1:
                new += _comb_col(comb_ptr, rt, t_mask, 1, k, N) * x1
            if N > 2:
                new += _comb_col(comb_ptr, rt, t_mask, 2, k, N) * x2
                new += _comb_col(comb_ptr, rt, t_mask, 3, k, N) * x3
            # The next pre reads the streams as stored: round first (RNE, as store_rne does),
            # so its statistics see the same values hc_pre(x_new) would.
            if xnew_ptr.dtype.element_ty == tl.bfloat16:
                new = round_to_bf16(new)
            stored = new.to(xnew_ptr.dtype.element_ty)
            new = stored.to(tl.float32)
            tl.store(xnew_ptr + rt[:, None] * (N * D) + k * D + rd[None, :], stored, mask=m2)
            sq += tl.sum(new * new, axis=1)
            fv = tl.load(fn_ptr + rj[None, :] * (N * D) + (k * D + rd)[:, None],
                         mask=d_mask[:, None] & j_mask[None, :], other=0.0)
            if BF16X3:
                acc = _dot_bf16x3(acc, stored, fv)
            else:
                acc += tl.dot(new, fv, input_precision=PRECISION)
    base = split * T
    tl.store(part_ptr + (base + rt[:, None]) * NJP + rj[None, :], acc,
             mask=t_mask[:, None] & j_mask[None, :])
    tl.store(sq_ptr + base + rt, sq, mask=t_mask)


def _check_post_args(name: str, out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor,
                     comb: torch.Tensor) -> None:
    if x_res.dim() != 3 or out.shape != (x_res.shape[0], x_res.shape[2]):
        raise ValueError(f"{name}: out must be [T, D] and x_res [T, n, D]; found "
                         f"{tuple(out.shape)} and {tuple(x_res.shape)}")
    T, n, _ = x_res.shape
    if tuple(post.shape) != (T, n) or tuple(comb.shape) != (T, n, n):
        raise ValueError(f"{name}: post must be [{T}, {n}] and comb [{T}, {n}, {n}]; found "
                         f"{tuple(post.shape)} and {tuple(comb.shape)}")
    if n < 1 or n & (n - 1):
        raise ValueError(f"{name}: n_hc must be a power of two for the Triton kernel; found {n}")


def hc_post_pre_with_plan(out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor,
                          comb: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                          base: torch.Tensor, norm_eps: float, hc_eps: float, iters: int,
                          plan: HcPlan | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`hc_post_pre` with an explicit plan of the post + mixes kernel (``None``:
    :func:`pick_hc_plan`).  x_new is the same bits under every plan; the mixes (and through
    the gates, y) agree to fp32 rounding (other split / dot orders)."""
    _check_post_args("hc_post_pre", out, x_res, post, comb)
    if iters < 1:
        raise ValueError(f"hc_post_pre: iters must be >= 1; found {iters}")
    T, n, D = x_res.shape
    rows = (2 + n) * n
    if tuple(fn.shape) != (rows, n * D):
        raise ValueError(f"hc_post_pre: fn must be [{rows}, {n * D}] for x_res "
                         f"{tuple(x_res.shape)}; found {tuple(fn.shape)}")
    if n > 4:
        # The fused kernel holds n_hc <= 4 input streams (every V4 model has 4): compose.
        x_new = hc_post_with_plan(out, x_res, post, comb, None)
        return (x_new, *hc_pre_with_plan(x_new, fn, scale, base, norm_eps, hc_eps, iters, plan))
    plan = plan or pick_hc_plan("post_pre", T, n, D, x_res.dtype)
    _check_plan("hc_post_pre", plan, n, dot=True)
    dev = x_res.device
    x_new = torch.empty(T, n, D, dtype=x_res.dtype, device=dev)
    y = torch.empty(T, D, dtype=x_res.dtype, device=dev)
    post_n = torch.empty(T, n, dtype=torch.float32, device=dev)
    comb_n = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    if not T:
        return x_new, y, post_n, comb_n
    njp = max(16, triton.next_power_of_2(rows))
    tiles = triton.cdiv(T, plan.BT)
    d_per_split, splits = _splits(D, plan.BD, tiles, plan, dev)
    part = torch.empty(splits, T, njp, dtype=torch.float32, device=dev)
    sq = torch.empty(splits, T, dtype=torch.float32, device=dev)
    args = (out.contiguous(), x_res.contiguous(), post.float().contiguous(),
            comb.float().contiguous(), fn.float().contiguous(), x_new, part, sq, T, D,
            d_per_split)
    _launch_mixes(_hc_post_mix_kernel, (tiles, splits), args, dev, plan,
                  plan.mix == "bf16x3" and x_res.dtype == torch.bfloat16,
                  N=n, NJ=rows, NJP=njp, BT=plan.BT, BD=plan.BD)
    BDC = min(1024, triton.next_power_of_2(D))
    _hc_collapse_kernel[(T, triton.cdiv(D, BDC))](
        x_new, part, sq, scale.float().contiguous(), base.float().contiguous(), y, post_n,
        comb_n, T, D, splits, float(norm_eps), float(hc_eps), ITERS=int(iters), N=n, NJP=njp,
        SP=triton.next_power_of_2(splits), BD=BDC, HEAD=False, num_warps=4)
    return x_new, y, post_n, comb_n


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def hc_post_pre(out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
                hc_eps: float, iters: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hc_post`` of one sublayer fused with the ``hc_pre`` of the next (spec §3.4, §3.5).

    out [T, D]; x_res [T, n, D]; post [T, n]; comb [T, n, n] (this sublayer's);
    fn [(2+n)·n, n·D], scale [3], base [(2+n)·n] (the next sublayer's).  Returns
    ``(x_new [T, n, D] x_res.dtype, y [T, D], post' [T, n] fp32, comb' [T, n, n] fp32)`` =
    ``(x_new, *hc_pre(x_new, ...))`` with ``x_new = hc_post(out, x_res, post, comb)``.

    Two launches instead of three: one kernel writes x_new and the next pre's split-K partials
    (RMS statistic and 24-wide projection), then the collapse kernel of hc_pre finishes.
    """
    return hc_post_pre_with_plan(out, x_res, post, comb, fn, scale, base, norm_eps, hc_eps,
                                 iters, None)
