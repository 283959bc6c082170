"""Programmatic dependent launch (PDL) of the Triton kernels on Hopper.

A decode step at small batch is a chain of ~35 latency-bound kernels per layer (a few µs each):
with plain stream order a kernel's blocks are only scheduled once the previous kernel has
finished and flushed, so every boundary pays the launch and ramp-up of the next grid.  With
PDL (sm_90+), a kernel launched with ``launch_pdl=True`` may be scheduled while its predecessor
still runs; its blocks park on ``griddepcontrol.wait`` until the predecessor has completed and
its memory is visible.  CUDA graphs capture the launch attribute as a programmatic edge.

The contract every kernel of ``dsv4.ops`` keeps (checked on the source by
``tests/kernels/test_pdl.py``): it takes a ``PDL: tl.constexpr = False`` parameter and its first
statement is :func:`grid_dependency_sync` — before any load (the predecessor's output) or store
(the predecessor may still read what it overwrites), and unconditional (a grid that finished
without waiting would let its own successor start before the grid before it had finished).
Launches pass ``**pdl_args(tensor)``, which turns both on together.

Measured on the H200 (4 V4-Flash layers, graph replays interleaved in one process,
docs/PERFORMANCE.md, eighth session): decode B=1 1,119 → 1,047 µs, B=2 1,289 → 1,232,
B=16 2,864 → 2,796, but B=64 5,499 → 5,677 (slower).  So it is on for model steps of up to
:data:`PDL_MAX_TOKENS` tokens (:func:`model_step`), and outside model steps (single ops).
Reading weights before the wait (into L2 or registers, so they stream during the predecessor)
measured slower at every batch and is not done.

``DSV4_PDL=0`` launches everything in plain stream order (same results, bit for bit).  Off CUDA,
under the Triton interpreter (it has no inline assembly) and before sm_90 it is off.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

try:  # the model imports model_step on machines without Triton too
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - CPU installs without the test extras
    triton = None

__all__ = ["pdl_args", "pdl_enabled", "model_step", "grid_dependency_sync", "PDL_MAX_TOKENS"]

# Model steps of more tokens launch plainly (B=16 gained 2.4%, B=64 lost 3.2%);
# ``DSV4_PDL_MAX_TOKENS`` overrides it (read at each step).
PDL_MAX_TOKENS = 16

# Set by the offline sm_90 compile tests (tests/kernels/sm90_cases.py): record the launches the
# H200 makes, with PDL, from CPU tensors.
_FORCE = False
# Inside a model step: whether its launches use PDL (None outside one); see model_step.
_step_pdl: bool | None = None


def pdl_enabled() -> bool:
    """False when ``DSV4_PDL=0`` or under the Triton interpreter."""
    return (os.environ.get("DSV4_PDL", "1") != "0"
            and os.environ.get("TRITON_INTERPRET", "0") != "1")


@contextlib.contextmanager
def model_step(tokens: int, distributed: bool = False) -> Iterator[None]:
    """Kernels launched inside use PDL only if the step has at most :data:`PDL_MAX_TOKENS`
    tokens (the model's forward wraps each step; a CUDA-graph capture sees the same choice).
    ``distributed`` (tensor / expert parallel): off unless ``DSV4_PDL=1`` is set explicitly —
    NCCL kernels between ours have not been run with PDL on GPUs yet.  The environment is read
    here once per step, not at every launch."""
    global _step_pdl
    before = _step_pdl
    limit = int(os.environ.get("DSV4_PDL_MAX_TOKENS", PDL_MAX_TOKENS))
    _step_pdl = (pdl_enabled() and tokens <= limit
                 and (not distributed or os.environ.get("DSV4_PDL") == "1"))
    try:
        yield
    finally:
        _step_pdl = before


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(t: torch.Tensor) -> dict[str, bool]:
    """Launch keywords for a kernel whose tensors live where ``t`` does:
    ``{"PDL": True, "launch_pdl": True}`` on a Hopper GPU with PDL enabled (and a small enough
    model step), else ``{}`` (the kernel's ``PDL`` default False: no wait is compiled in, the
    launch is plain)."""
    if not (pdl_enabled() if _step_pdl is None else _step_pdl):
        return {}
    if not _FORCE:
        dev = t.device
        if dev.type != "cuda" or not _sm90_or_newer(
                dev.index if dev.index is not None else torch.cuda.current_device()):
            return {}
    return {"PDL": True, "launch_pdl": True}


if triton is not None:
    @triton.jit
    def grid_dependency_sync(PDL: tl.constexpr):
        """Wait for the previous grid of the stream to complete (its writes visible), then let
        the next grid be scheduled.  The kernel's first statement; a no-op when PDL is False."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
