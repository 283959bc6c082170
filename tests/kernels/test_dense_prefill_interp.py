"""Prefill over record caches through dense copies (dsv4/model/attention.py, issue #5), with the
Triton ``sparse_attn`` kernel in the interpreter: the tiny V4 and V4.1 models (bf16, official
numerics, ``kv_cache_dtype="fp8"`` records) run two steps (a chunked-prefill continuation next
to a new request) with the dense path on and off; every attention layer's output, the logits and
the cache bytes are identical.  The kernel dequantizes records into q's dtype (bf16) before
the same bf16 MMAs that it runs on the dense rows.

``test_interp_*`` run in a child process with ``TRITON_INTERPRET=1``
(:func:`test_kernels_in_interpreter`); the model-side tests (torch twins, the rule) are in
tests/model/test_dense_prefill_sources.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.interp_child import run_in_interpreter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(
    not INTERP, reason="interpreter test: run by test_kernels_in_interpreter in a child process")

# Fewer tokens than the twin test (the interpreter runs a program per token): the window source
# with A's ring rows, the CSA entries of A's first chunk (ratio 4), and the V4.1 ratio 1 / 2
# pools; the ratio-128 layers have no entry here (they read the records in both runs).
SMALL_STEPS = [
    [("A", 0, 0, 24, [0]), ("B", 1, 0, 12, [3])],
    [("A", 0, 24, 20, [0]), ("C", 2, 0, 6, [4])],
]


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from dsv4.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("dense_prefill_interp")
    return {v: make_tiny_checkpoint(root / v, variant=v, seed=0) for v in ("v4", "v41")}


@interp_only
@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_interp_dense_sources_equal_the_records_in_the_kernel(tiny_paths, variant,
                                                              monkeypatch) -> None:
    from dsv4.model.transformer import load_model
    from dsv4.ops import triton_attn
    from tests.model import test_dense_prefill_sources as t

    torch.set_num_threads(1)
    model = load_model(tiny_paths[variant], device="cpu", dtype=torch.bfloat16,
                       numerics="official")
    calls = []

    def kernel(*args, **kw):
        calls.append(1)
        return triton_attn.sparse_attn(*args, **kw)

    dense = t.run_steps(model, True, monkeypatch, SMALL_STEPS, sparse_attn=kernel)
    records = t.run_steps(model, False, monkeypatch, SMALL_STEPS, sparse_attn=kernel)
    assert len(calls) == 4 * len(dense[0].outputs)           # 2 steps × 2 runs per layer
    assert all(o.dtype == torch.bfloat16 for outs in dense[0].outputs.values() for o in outs)
    t.assert_same_runs(model, dense, records)
    for layer, kinds in dense[0].sources.items():
        if model.cfg.ratio(layer) in (1, 2, 4):
            assert kinds[1][1] == "dense", (layer, kinds)


# ---------------------------------------------------------------- interpreter (child process)
def test_kernels_in_interpreter() -> None:
    """Run this file's interpreter tests with ``TRITON_INTERPRET=1`` in a child."""
    if INTERP:
        pytest.skip("TRITON_INTERPRET is set: the interp tests run directly")
    run_in_interpreter(__file__, "interp_", min_passed=2)
