"""Fixtures of the tensor / expert parallel tests: tiny V4 and V4.1 checkpoints."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from dsv4.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("dist-tiny")
    return {v: str(make_tiny_checkpoint(root / v, variant=v, seed=0)) for v in ("v4", "v41")}


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test here runs on one intra-op thread (see tests/conftest.py)."""
