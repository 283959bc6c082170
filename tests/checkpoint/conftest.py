"""Tiny checkpoints shared by the checkpoint tests (generated once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4.tiny import VARIANTS, make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per variant (seed 0, three shards).  Tests must not modify them:
    copy first."""
    root = tmp_path_factory.mktemp("tiny_ckpts")
    return {v: Path(make_tiny_checkpoint(root / v, v, seed=0, num_shards=3)) for v in VARIANTS}
