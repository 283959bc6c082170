"""Triton kernels of the dense hot ops: the FP8 block GEMM with fused activation quantization
(spec §2.4-2.5), and the jit helpers the other kernel modules share (rounding, stores, split-K
counters; the mHC kernels are in ``triton_mhc``).

Same signatures as the torch twins in ``dsv4/ops/torch_dense.py``.  The kernels run on Hopper
GPUs and, at tiny shapes, in the Triton interpreter (``TRITON_INTERPRET=1``) on CPU tensors.

FP8 rounding is done by hand (:func:`round_to_e4m3`) onto the e4m3 grid in fp32 before the cast,
so the quantized values are bit-identical on the GPU and in the interpreter (whose own fp32→fp8
cast mis-rounds values whose mantissa carries into the exponent).
"""

from __future__ import annotations

import math

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
           "pick_fp8_config", "mma", "round_to_bf16", "store_rne"]

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


# Up to this many rows the activation is quantized inside the GEMM (each N tile re-quantizes
# its few rows); beyond, once in its own pass (measured faster from 64 rows: the in-GEMM
# quantization of 64 rows made every tile CUDA-core bound, e.g. wo_b 46.4 vs 20.2 µs).
_FUSE_QUANT_MAX_M = 16
# Beyond this many rows the prefill plan (no K split).
_DECODE_MAX_M = 512


@lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small stand-in off the GPU)."""
    if device.type != "cuda":
        return 4  # the interpreter: a token value that still exercises split-K
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _pow2_at_least(v: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(v, 1.0))))


def _pow2_at_most(v: float) -> int:
    return 1 << max(0, math.floor(math.log2(max(v, 1.0))))


def pick_fp8_config(M: int, N: int, K: int, block: int, device: torch.device) -> Fp8GemmConfig:
    """Tile plan by shape, from the H200 sweep of ``bench/fp8_decode_sweep.py`` (sixth session,
    docs/PERFORMANCE.md: the six projections of a V4-Flash step at 1, 16, 64 and 256 rows).

    * M <= 16 (16-row MMA tiles, A quantized in the GEMM, 8 warps): 256-wide N tiles unsplit
      when they alone give ~one program per SM (wq_b), else 128-wide tiles split over K so
      that ~2 programs per SM stream the weight (<= 8 splits of >= 2 K blocks each).  Splits
      cost no launch: the last split of each tile sums the fp32 slices in the kernel.
    * 16 < M <= 64: A quantized once in its own pass, 64-wide N tiles, 4 warps, 4 stages, the
      fewest power-of-two K splits that reach ~3/4 of a program per SM (wo_b at 64 rows: 20.2
      µs against 46.4 for the former in-GEMM quantization with 128-wide tiles).
    * 64 < M <= 512: 64×128 tiles (64×64 for N <= 2048), split over K while there are fewer
      than ~2 programs per SM and each split keeps >= 16 K blocks.
    * Prefill (M > 512): 64×128 tiles, one warpgroup, 4 stages, A quantized in its own pass.
    """
    n_kb = triton.cdiv(K, block)
    stages = 4 if block >= 128 else 6
    sms = sm_count(device)
    if M > _DECODE_MAX_M:
        return Fp8GemmConfig(BM=64, BN=128, num_warps=4, num_stages=stages, fuse_quant=False)
    if M > 64:
        bn = 64 if N <= 2048 else 128
        tiles = triton.cdiv(M, 64) * triton.cdiv(N, bn)
        split = max(1, min(_pow2_at_most(2 * sms / tiles), n_kb // 16))
        return Fp8GemmConfig(BM=64, BN=bn, split_k=split, num_warps=4, num_stages=stages,
                             fuse_quant=False)
    bm = max(16, triton.next_power_of_2(M))
    max_split = max(1, min(8, n_kb // 2))
    if M > _FUSE_QUANT_MAX_M:
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, 64)
        split = min(max_split, _pow2_at_least(0.72 * sms / tiles))
        return Fp8GemmConfig(BM=bm, BN=64, split_k=split, num_warps=4, num_stages=stages,
                             fuse_quant=False)
    if triton.cdiv(N, 256) >= 0.9 * sms:
        return Fp8GemmConfig(BM=bm, BN=256, split_k=1, num_warps=8, num_stages=3)
    tiles = triton.cdiv(N, 128)
    split = min(max_split, _pow2_at_least(2 * sms / tiles))
    return Fp8GemmConfig(BM=bm, BN=128, split_k=split, num_warps=8,
                         num_stages=3 if block >= 128 else 6)


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


def splitk_workspace(out: torch.Tensor, split: int, tiles: int, op: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials [split, M, N], arrival counters) of a split-K GEMM writing ``out`` [M, N]
    over ``tiles`` output tiles; with one split neither is touched (``out`` stands in).  The
    partials come from the caching allocator per call (also inside CUDA graphs)."""
    if split == 1:
        return out, out
    M, N = out.shape
    ws = torch.empty(split, M, N, dtype=torch.float32, device=out.device)
    return ws, splitk_counters(out.device, tiles, op)


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
    ws, counters = splitk_workspace(out, split, tiles, "fp8_linear")
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


# ------------------------------------------------------------------------- exact fp32 x bf16
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
