"""Fixtures of the tensor / expert parallel tests: tiny V4 and V4.1 checkpoints."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from dsv4.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("dist-tiny")
    return {v: str(make_tiny_checkpoint(root / v, variant=v, seed=0)) for v in ("v4", "v41")}


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny shapes gain nothing from intra-op threads; on a busy 2-core machine they only spin.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
