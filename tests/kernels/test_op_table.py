"""The op table: Triton kernels not yet checked on a GPU stay out of the engine's "triton" table
unless DSV4_UNVERIFIED_KERNELS=1 (the tests set it: tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import dsv4.ops as ops


@pytest.fixture(params=["as_shipped", "two_unverified"])
def unverified(request: pytest.FixtureRequest,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The shipped set (empty once every kernel has run on the H200), and a set with a plain op
    and the fused mHC op, so the switch itself stays tested."""
    if request.param == "two_unverified":
        monkeypatch.setattr(ops, "UNVERIFIED_ON_GPU", frozenset({"rms_norm", "hc_post_pre"}))
    ops._cache.clear()
    yield
    ops._cache.clear()


@pytest.mark.usefixtures("unverified")
def test_unverified_kernels_are_twins_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    torch_ops = ops.get_ops("torch")
    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "0")
    off = ops.get_ops("triton")
    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "1")
    on = ops.get_ops("triton")
    assert ops.UNVERIFIED_ON_GPU <= set(ops.OP_NAMES)
    composed = ops._COMPOSED_TWINS
    for name in ops.UNVERIFIED_ON_GPU - composed:
        assert getattr(off, name) is getattr(torch_ops, name), name
    for name in ops.UNVERIFIED_ON_GPU & composed:
        # A fused op (mHC post + pre, gate + routing, experts + shared) is dropped instead: the
        # model then runs the checked kernels of its parts one by one rather than twins.
        assert not hasattr(off, name) and hasattr(torch_ops, name), name
    for name in set(ops.OP_NAMES) - ops.UNVERIFIED_ON_GPU:   # verified: the same either way
        assert getattr(off, name, None) is getattr(on, name, None), name
    for name in ops.UNVERIFIED_ON_GPU:
        assert getattr(on, name) is not getattr(torch_ops, name), name  # a kernel exists
    for name in ("sparse_attn", "fp8_linear", "moe_experts", "hc_pre"):  # checked on the H200
        assert getattr(off, name) is getattr(on, name) is not getattr(torch_ops, name), name


def test_bad_backend() -> None:
    with pytest.raises(ValueError, match="unknown op backend"):
        ops.get_ops("cuda")
