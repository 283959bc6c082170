"""Programmatic dependent launch (PDL) of the Triton kernels on Hopper.

A decode step at small batch is a chain of ~35 latency-bound kernels per layer (a few µs each):
with plain stream order a kernel's blocks are only scheduled once the previous kernel has
finished and flushed, so every boundary pays the launch and ramp-up of the next grid.  With
PDL (sm_90+), a kernel launched with ``launch_pdl=True`` may be scheduled while its predecessor
still runs; its blocks park on ``griddepcontrol.wait`` until the predecessor has completed and
its memory is visible.  CUDA graphs capture the launch attribute as a programmatic edge.

The contract every kernel of ``dsv4.ops`` keeps (checked by ``tests/kernels/test_pdl.py``): it
takes a ``PDL: tl.constexpr = False`` parameter and calls :func:`grid_dependency_sync` with it
before its first global memory access — loads *and* stores, since the predecessor may still be
reading what this kernel overwrites.  The wait is unconditional (no early return before it): a
grid that finished without waiting would let its own successor start before the grid that came
before it had finished.  Launches pass ``**pdl_args(tensor)``, which turns both on together.

``DSV4_PDL=0`` launches everything in plain stream order (same results, bit for bit).  Off CUDA,
under the Triton interpreter (it has no inline assembly) and before sm_90 it is off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["pdl_args", "pdl_enabled", "grid_dependency_sync", "prefetch_rows_l2"]

# Set by the offline sm_90 compile tests (tests/kernels/sm90_cases.py): record the launches the
# H200 makes, with PDL, from CPU tensors.
_FORCE = False


def pdl_enabled() -> bool:
    """False when ``DSV4_PDL=0`` or under the Triton interpreter."""
    return (os.environ.get("DSV4_PDL", "1") != "0"
            and os.environ.get("TRITON_INTERPRET", "0") != "1")


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(t: torch.Tensor, prefetch: bool = False) -> dict[str, bool]:
    """Launch keywords for a kernel whose tensors live where ``t`` does:
    ``{"PDL": True, "launch_pdl": True}`` on a Hopper GPU with PDL enabled, else ``{}`` (the
    kernel's ``PDL`` default False: no wait is compiled in, the launch is plain).

    ``prefetch`` (kernels with a ``PREFETCH`` constexpr that streams weights): with PDL, also
    ``PREFETCH=True`` — the kernel asks L2 for its weight slice before the wait — unless
    ``DSV4_PDL_PREFETCH=0``."""
    if _FORCE and pdl_enabled():
        on = True
    else:
        dev = t.device
        if dev.type != "cuda" or not pdl_enabled():
            return {}
        on = _sm90_or_newer(dev.index if dev.index is not None else torch.cuda.current_device())
    if not on:
        return {}
    args = {"PDL": True, "launch_pdl": True}
    if prefetch and os.environ.get("DSV4_PDL_PREFETCH", "1") != "0":
        args["PREFETCH"] = True
    return args


@triton.jit
def grid_dependency_sync(PDL: tl.constexpr):
    """Wait for the previous grid of the stream to complete (its writes visible), then let the
    next grid be scheduled.  Call first, before any global load or store; no-op when PDL is
    False."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs):
    # One L2 prefetch per element (no register written; the dummy output keeps the asm).
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows_l2(base, rows, row_mask, stride_row, c_lo, c_hi,
                     ELEM_BYTES: tl.constexpr, BC: tl.constexpr):
    """Ask L2 for columns ``[c_lo, c_hi)`` of ``rows`` of a row-major matrix at ``base``, one
    request per 128-byte line, BC columns per step.  For weights only (never written), so it
    may run before :func:`grid_dependency_sync`: the bytes then stream in while the previous
    kernel runs."""
    LINE: tl.constexpr = 128 // ELEM_BYTES
    NL: tl.constexpr = BC // LINE
    row_ptr = base + rows.to(tl.int64)[:, None] * stride_row
    lines = tl.arange(0, NL)[None, :] * LINE
    for c0 in range(c_lo, c_hi, BC):
        ok = row_mask[:, None] & ((c0 + lines) < c_hi)
        _prefetch_l2(tl.where(ok, row_ptr + c0 + lines, base))
