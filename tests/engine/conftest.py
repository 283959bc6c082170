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
def _one_thread():
    # Tiny shapes gain nothing from intra-op threads, and on a busy 2-core machine the thread
    # pool's spinning makes every op several times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
