"""Warm the GPU's L2 with weights ahead of their use (decode at batch 1: the weight-streaming
kernels are latency-bound, and read faster from L2 than from HBM).

Two forms:

* ``l2_prefetch(t, programs)`` (thirteenth session, a bench experiment): reads every 32-bit word
  of ``t`` (through L2 only, ``.cg``, or with an evict-last hint) with a few programs and
  returns their XOR (int32 [1]); its reads occupy SMs and streamed at only 1.0-1.6 TB/s
  (``bench/l2_prefetch.py``).
* ``l2_bulk_prefetch(t)`` and ``moe_l2_prefetch(topk_ids, experts)`` (sixteenth session): Hopper's
  bulk prefetch (``cp.async.bulk.prefetch.L2``, sm_90): one thread hands a byte range to the
  TMA unit and goes on, so a one-warp program issues megabytes without holding them in
  registers or shared memory, and the kernel ends long before the bytes arrive.  The experts'
  form reads the routing ids on the device (CUDA graphs): the picked experts' stacks.  Both
  return the bytes they asked for (int32 [1]), which the twins compute on the host side —
  prefetches have no other observable effect.  Measured (``bench/l2_bulk.py``, H200,
  docs/PERFORMANCE.md sixteenth session): the prefetch kernel lasts as long as reading its
  bytes, a prefetch issued before the experts made the next GEMV 20 µs later, and the experts
  from a warmed L2 are only 8% faster — not called by the model.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.torch_dense import ExpertWeights
from dsv4.ops.triton_dense import _INTERPRET_HOST, INTERPRET, sm_count

__all__ = ["l2_bulk_prefetch", "l2_bulk_prefetch_torch", "l2_prefetch", "l2_prefetch_torch",
           "moe_l2_prefetch", "moe_l2_prefetch_torch"]


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as int32 words (contiguous, whole words)."""
    if not t.is_contiguous():
        raise ValueError("l2_prefetch: the tensor must be contiguous")
    nbytes = t.numel() * t.element_size()
    if nbytes % 4:
        raise ValueError(f"l2_prefetch: {nbytes} bytes is not a whole number of 32-bit words")
    return t.reshape(-1).view(torch.uint8).view(torch.int32)


def l2_prefetch_torch(t: torch.Tensor, programs: int = 0) -> torch.Tensor:
    """Twin of :func:`l2_prefetch`: the XOR of ``t``'s 32-bit words, int32 [1]."""
    acc = np.bitwise_xor.reduce(_words(t).cpu().numpy()) if t.numel() else np.int32(0)
    return torch.tensor([int(acc)], dtype=torch.int32, device=t.device)


@triton.jit
def _l2_prefetch_kernel(src_ptr, out_ptr, n_words, BLOCK: tl.constexpr,
                        EVICT_LAST: tl.constexpr, PDL: tl.constexpr = False):
    """Program p XORs blocks p, p + P, p + 2P, ... of the words, then XORs its result into
    out (XOR commutes: the same bits whatever the order)."""
    grid_dependency_sync(PDL)
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros((BLOCK,), tl.int32)
    r = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n_words, step):
        offs = start + r
        if EVICT_LAST:   # (ptxas refuses .evict_last with .cg)
            v = tl.load(src_ptr + offs, mask=offs < n_words, other=0,
                        eviction_policy="evict_last")
        else:
            v = tl.load(src_ptr + offs, mask=offs < n_words, other=0, cache_modifier=".cg")
        acc = acc ^ v
    tl.atomic_xor(out_ptr, tl.xor_sum(acc, axis=0))


def l2_prefetch(t: torch.Tensor, programs: int = 0, block: int = 4096,
                evict_last: bool = False) -> torch.Tensor:
    """Read ``t`` once through L2 with ``programs`` programs (0: one per SM); int32 [1] XOR of
    its words (see the module docstring)."""
    if not t.is_cuda and not _INTERPRET_HOST:
        return l2_prefetch_torch(t, programs)
    words = _words(t)
    out = torch.zeros(1, dtype=torch.int32, device=t.device)
    n = words.numel()
    if n == 0:
        return out
    if programs <= 0:
        programs = sm_count(t.device)
    programs = max(1, min(programs, triton.cdiv(n, block)))
    _l2_prefetch_kernel[(programs,)](words, out, n, BLOCK=block, EVICT_LAST=evict_last,
                                     num_warps=4, **pdl_args(words))
    return out


# ------------------------------------------------------------------------------ bulk prefetch
# $1: the 64-bit address, $2: the size (a multiple of 16; 0: nothing, the lane is predicated
# off); $0 = $2, so the kernels can count the bytes they asked for.
_BULK_PREFETCH = tl.constexpr("""{
.reg .pred p;
setp.ne.u32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, $2;
}""")
# The same with an evict-last L2 policy on the prefetched lines (they outlive the streams that
# read through L2 with evict-first hints in between).
_BULK_PREFETCH_EVICT_LAST = tl.constexpr("""{
.reg .pred p;
.reg .b64 pol;
setp.ne.u32 p, $2, 0;
createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
mov.u32 $0, $2;
}""")


@triton.jit
def l2_bulk_range(addr, lo, hi, CHUNK: tl.constexpr, LANES: tl.constexpr,
                  EVICT_LAST: tl.constexpr):
    """Ask for bytes [lo, hi) at the int64 address ``addr`` (16-byte aligned, hi - lo a multiple
    of 16) in CHUNK-byte pieces, LANES pieces per instruction wave; returns int32 [LANES]
    whose sum is the bytes asked for.  Under the interpreter (no inline assembly) it only
    computes the sizes."""
    r = tl.arange(0, LANES).to(tl.int64) * CHUNK
    got = tl.zeros((LANES,), tl.int32)
    for start in range(lo, hi, LANES * CHUNK):
        off = start + r
        size = tl.minimum(tl.maximum(hi - off, 0), CHUNK).to(tl.int32)
        if INTERPRET:
            got += size
        else:
            # A lane past the range keeps a valid address (its size is 0: predicated off).
            a = addr + tl.where(size > 0, off, lo)
            if EVICT_LAST:
                got += tl.inline_asm_elementwise(_BULK_PREFETCH_EVICT_LAST, "=r,l,r", [a, size],
                                                 dtype=tl.int32, is_pure=False, pack=1)
            else:
                got += tl.inline_asm_elementwise(_BULK_PREFETCH, "=r,l,r", [a, size],
                                                 dtype=tl.int32, is_pure=False, pack=1)
    return got


@triton.jit
def _l2_bulk_kernel(out_ptr, addr, nbytes, per_program, CHUNK: tl.constexpr,
                    LANES: tl.constexpr, EVICT_LAST: tl.constexpr, PDL: tl.constexpr = False):
    """Program p asks for bytes [p·per_program, (p+1)·per_program) of the range; out += the
    bytes asked for.  Launched without PDL: it must not wait for the kernel before it."""
    grid_dependency_sync(PDL)
    lo = tl.program_id(0).to(tl.int64) * per_program
    hi = tl.minimum(lo + per_program, nbytes)
    got = l2_bulk_range(addr, lo, hi, CHUNK, LANES, EVICT_LAST)
    tl.atomic_add(out_ptr, tl.sum(got, axis=0))


def _byte_range(t: torch.Tensor, name: str) -> tuple[int, int]:
    if not t.is_contiguous():
        raise ValueError(f"{name}: the tensor must be contiguous")
    nbytes = t.numel() * t.element_size()
    if nbytes % 16 or (t.is_cuda and t.data_ptr() % 16):
        raise ValueError(f"{name}: the bulk prefetch takes 16-byte aligned whole 16-byte "
                         f"pieces; found {nbytes} bytes at offset {t.data_ptr() % 16}")
    if nbytes >= 1 << 31:
        raise ValueError(f"{name}: {nbytes} bytes: at most 2 GiB per call (int32 count)")
    return t.data_ptr(), nbytes


def l2_bulk_prefetch_torch(t: torch.Tensor, programs: int = 0, chunk: int = 16384,
                           evict_last: bool = False) -> torch.Tensor:
    """Twin of :func:`l2_bulk_prefetch`: the bytes it asks for, int32 [1]."""
    _, nbytes = _byte_range(t, "l2_bulk_prefetch")
    return torch.tensor([nbytes], dtype=torch.int32, device=t.device)


def l2_bulk_prefetch(t: torch.Tensor, programs: int = 0, chunk: int = 16384,
                     evict_last: bool = False, lanes: int = 32) -> torch.Tensor:
    """Prefetch the bytes of ``t`` into L2 with ``programs`` one-warp programs (0: one per 4 MB,
    at least 1) asking for ``chunk``-byte pieces; returns the bytes asked for (int32 [1]).
    Returns before the bytes arrive."""
    addr, nbytes = _byte_range(t, "l2_bulk_prefetch")
    if chunk % 16 or chunk <= 0 or lanes & (lanes - 1):
        raise ValueError(f"l2_bulk_prefetch: chunk {chunk} must be a positive multiple of 16, "
                         f"lanes {lanes} a power of two")
    if not t.is_cuda and not _INTERPRET_HOST:
        return l2_bulk_prefetch_torch(t, programs, chunk, evict_last)
    out = torch.zeros(1, dtype=torch.int32, device=t.device)
    if nbytes == 0:
        return out
    if programs <= 0:
        programs = max(1, triton.cdiv(nbytes, 4 << 20))
    per = triton.cdiv(triton.cdiv(nbytes, programs), chunk) * chunk
    programs = triton.cdiv(nbytes, per)
    # (The interpreter never dereferences the address: a CPU tensor's is passed as it is, a
    # 64-bit value like a GPU's, so the offline sm_90 compile sees the GPU's signature.)
    _l2_bulk_kernel[(programs,)](out, addr, nbytes, per, CHUNK=chunk,
                                 LANES=lanes, EVICT_LAST=evict_last, num_warps=1,
                                 **pdl_args(out))
    return out


# The expert stacks a routed-expert prefetch can ask for, in the order of the kernel's axis 1.
_EXPERT_TENSORS = ("w1", "w3", "s1", "s3", "w2", "s2")


def _expert_ranges(experts: ExpertWeights, which: tuple[str, ...]) -> list[tuple[int, int, int]]:
    """(address, bytes per expert, byte stride between experts) of each stack in ``which``."""
    out = []
    for name in which:
        if name not in _EXPERT_TENSORS:
            raise ValueError(f"moe_l2_prefetch: unknown stack {name!r}; allowed: "
                             f"{_EXPERT_TENSORS}")
        t = getattr(experts, name)
        if t is None or not t.is_contiguous():
            raise ValueError(f"moe_l2_prefetch: {name} must be a contiguous stack")
        per = t[0].numel() * t.element_size()
        if per % 16 or (t.is_cuda and t.data_ptr() % 16):
            raise ValueError(f"moe_l2_prefetch: {name}'s per-expert bytes ({per}) and address "
                             "must be multiples of 16")
        out.append((t.data_ptr(), per, t.stride(0) * t.element_size()))
    return out


def moe_l2_prefetch_torch(topk_ids: torch.Tensor, experts: ExpertWeights,
                          which: tuple[str, ...] = ("w1", "w3", "s1", "s3"),
                          chunk: int = 16384, evict_last: bool = False) -> torch.Tensor:
    """Twin of :func:`moe_l2_prefetch`: the bytes asked for — every pick whose id is in
    0..E-1 asks for its expert's slice of each stack in ``which`` — int32 [1]."""
    per = sum(b for _, b, _ in _expert_ranges(experts, which))
    ids = topk_ids.reshape(-1)
    valid = int(((ids >= 0) & (ids < experts.num_experts)).sum())
    return torch.tensor([valid * per], dtype=torch.int32, device=topk_ids.device)


@triton.jit
def _moe_l2_kernel(out_ptr, ids_ptr, a0, a1, a2, a3, a4, a5, n0, n1, n2, n3, n4, n5,
                   st0, st1, st2, st3, st4, st5, E, per_program, CHUNK: tl.constexpr,
                   LANES: tl.constexpr, EVICT_LAST: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (pick p, stack j, piece q): the bytes [q·per_program, (q+1)·per_program) of stack j's
    slice of expert ids[p] (skipped when the id is outside 0..E-1).  PDL: waits for the
    routing that wrote the ids."""
    grid_dependency_sync(PDL)
    e = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    j = tl.program_id(1)
    # The stack's (address, bytes, stride) picked by j (scalars: a chain of selects).
    addr = tl.where(j == 0, a0, tl.where(j == 1, a1, tl.where(j == 2, a2,
                    tl.where(j == 3, a3, tl.where(j == 4, a4, a5)))))
    n = tl.where(j == 0, n0, tl.where(j == 1, n1, tl.where(j == 2, n2,
                 tl.where(j == 3, n3, tl.where(j == 4, n4, n5)))))
    st = tl.where(j == 0, st0, tl.where(j == 1, st1, tl.where(j == 2, st2,
                  tl.where(j == 3, st3, tl.where(j == 4, st4, st5)))))
    lo = tl.program_id(2).to(tl.int64) * per_program
    hi = tl.minimum(lo + per_program, n.to(tl.int64))
    if (e >= 0) & (e < E) & (lo < hi):
        got = l2_bulk_range(addr + e * st, lo, hi, CHUNK, LANES, EVICT_LAST)
        tl.atomic_add(out_ptr, tl.sum(got, axis=0))


def moe_l2_prefetch(topk_ids: torch.Tensor, experts: ExpertWeights,
                    which: tuple[str, ...] = ("w1", "w3", "s1", "s3"), chunk: int = 16384,
                    evict_last: bool = False, piece: int = 1 << 20, lanes: int = 32,
                    pdl: bool = True) -> torch.Tensor:
    """Prefetch into L2 the slices of the picked experts (``topk_ids`` on the device, read by
    the kernel) of the stacks in ``which`` (default: the up GEMM's codes and scales), one
    one-warp program per (pick, stack, ``piece`` bytes); returns the bytes asked for (int32
    [1]).  ``pdl``: launched as a dependent of the kernel that wrote the ids."""
    ranges = _expert_ranges(experts, which)
    if chunk % 16 or chunk <= 0 or piece % chunk or lanes & (lanes - 1):
        raise ValueError(f"moe_l2_prefetch: chunk {chunk} must be a positive multiple of 16 "
                         f"dividing piece {piece}; lanes {lanes} a power of two")
    if not topk_ids.is_cuda and not _INTERPRET_HOST:
        return moe_l2_prefetch_torch(topk_ids, experts, which, chunk, evict_last)
    out = torch.zeros(1, dtype=torch.int32, device=topk_ids.device)
    P = topk_ids.numel()
    if P == 0 or not ranges:
        return out
    ranges = ranges + [ranges[-1]] * (6 - len(ranges))
    a, n, st = zip(*ranges)
    pieces = triton.cdiv(max(n[:len(which)]), piece)
    _moe_l2_kernel[(P, len(which), pieces)](
        out, topk_ids.reshape(-1), *a, *n, *st, experts.num_experts, piece, CHUNK=chunk,
        LANES=lanes, EVICT_LAST=evict_last, num_warps=1,
        **(pdl_args(topk_ids) if pdl else {}))
    return out
