"""Warm the GPU's L2 with a tensor ahead of its use (an experiment of the thirteenth session,
not called by the model: ``bench/l2_prefetch.py`` measures whether a decode GEMV reads its
weight faster from a warmed L2, and whether a prefetch on a side stream hides behind the
latency-bound kernels before it).

``l2_prefetch(t, programs)`` reads every 32-bit word of ``t`` (through L2 only, ``.cg``, or
with an evict-last hint) with a few programs and returns their XOR (int32 [1]): the result
keeps the loads from being optimized away and gives the test something exact to check against
the twin, :func:`l2_prefetch_torch`.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.triton_dense import _INTERPRET_HOST, sm_count

__all__ = ["l2_prefetch", "l2_prefetch_torch"]


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
