"""Helpers shared by the Triton-interpreter kernel tests of this folder."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 (b the reference)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def random_indices(T: int, K: int, n_rows: int, gen: torch.Generator,
                   p_skip: float) -> torch.Tensor:
    """[T, K] int32 row ids in [0, n_rows), each −1 (no entry) with probability ``p_skip``."""
    idx = torch.randint(0, n_rows, (T, K), generator=gen, dtype=torch.int32)
    skip = torch.rand(T, K, generator=gen) < p_skip
    return torch.where(skip, torch.full_like(idx, -1), idx)


def record_grids(monkeypatch, module, name: str) -> list:
    """Replace the Triton kernel ``module.name`` (for the test) by a wrapper that launches it
    as before and appends each launch's grid to the returned list."""
    real = getattr(module, name)
    grids: list = []

    class _Recording:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(module, name, _Recording())
    return grids
