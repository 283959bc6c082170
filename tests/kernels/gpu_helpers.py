"""Helpers shared by the GPU tests of the kernels (skipped without CUDA)."""

from __future__ import annotations

import torch


def poison_allocator() -> None:
    """Fill the caching allocator's free blocks with NaN so unwritten outputs are caught."""
    torch.cuda.synchronize()
    for mb in (1, 8, 64, 512):
        t = torch.full((mb << 18,), float("nan"), dtype=torch.float32, device="cuda")
        del t
    torch.cuda.synchronize()
