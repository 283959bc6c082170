"""Shared fixtures of the engine tests: one tiny V4 checkpoint and its model per session."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_v4_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from dsv4.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "v4", variant="v4", seed=0)


@pytest.fixture(scope="session")
def tiny_v4_model(tiny_v4_path: str):
    from dsv4.model.transformer import load_model

    return load_model(tiny_v4_path, device="cpu", dtype=torch.float32, numerics="bf16")


@pytest.fixture(scope="session")
def tiny_v4_tokenizer(tiny_v4_path: str):
    from dsv4.tokenizer import load_tokenizer

    return load_tokenizer(tiny_v4_path)


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test here runs on one intra-op thread (see tests/conftest.py)."""
