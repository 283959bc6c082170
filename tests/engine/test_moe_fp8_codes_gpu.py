"""The engine option ``moe_fp8_codes`` on a GPU (skipped without CUDA): the tiny V4 model (MXFP4
experts, official numerics) keeps its experts' FP8 re-encoding, and the greedy tokens and
logprobs equal those of the same engine re-encoding the experts at every step — the FP8-MMA
expert path forced on for every step (its pair thresholds set to 1), so both engines run it:
the kept codes change where the FP8 bytes come from, not the bits."""

from __future__ import annotations

import random

import pytest
import torch

from test_cuda_graphs import run as _run  # the greedy run-to-completion helper

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _setup(tmp_path, monkeypatch, seed: int) -> tuple[str, list, dict]:
    """The tiny V4 checkpoint, the FP8-MMA path forced on for every step (pair thresholds 1),
    five random requests and the engine options both engines of a test share."""
    from dsv4.ops import triton_moe_fp8 as f8
    from dsv4.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "v4", variant="v4", seed=0)
    monkeypatch.setattr(f8, "FP8MMA_PREFILL", True)
    monkeypatch.setattr(f8, "MIN_PAIRS_PER_EXPERT", 1)
    monkeypatch.setattr(f8, "MIN_PAIRS_KEPT", 1)
    rng = random.Random(seed)
    reqs = [([rng.randrange(20, 500) for _ in range(rng.randrange(5, 200))],
             rng.randrange(4, 16)) for _ in range(5)]
    kw = dict(device="cuda", numerics="official", max_model_len=512, max_num_seqs=8,
              num_pages=64, enforce_eager=True)
    return path, reqs, kw


def test_engine_moe_fp8_codes_same_tokens_gpu(tmp_path, monkeypatch) -> None:
    from dsv4.engine.llm_engine import LLMEngine

    path, reqs, kw = _setup(tmp_path, monkeypatch, 1)
    want = _run(LLMEngine(path, **kw), reqs)
    kept = LLMEngine(path, moe_fp8_codes=True, **kw)
    codes = [m.fp8_codes for m in kept.model.modules() if getattr(m, "fp8_codes", None)]
    assert codes and all(c.nbytes() > 0 for c in codes)
    assert _run(kept, reqs) == want


def test_engine_moe_fp8_ahead_same_tokens_gpu(tmp_path, monkeypatch) -> None:
    """``DSV4_FP8MMA_AHEAD`` (``triton_moe_fp8.encode_ahead``): each block starts its experts'
    re-encoding on a stream of its own before its attention and the expert call reads those
    codes; the greedy tokens and logprobs equal those of the engine re-encoding in the call
    (the FP8-MMA path forced on for every step, as above), and the codes did come ahead."""
    from dsv4.engine.llm_engine import LLMEngine
    from dsv4.ops import triton_moe_fp8 as f8

    path, reqs, kw = _setup(tmp_path, monkeypatch, 2)
    want = _run(LLMEngine(path, **kw), reqs)
    monkeypatch.setattr(f8, "AHEAD", True)
    started = []
    real = f8.encode_ahead

    def counted(experts, tokens, topk, *args, **kwargs):
        codes = real(experts, tokens, topk, *args, **kwargs)
        # (the call takes the path: pairs >= 1 per expert, the codes with their event)
        started.append((tokens * topk >= experts.num_experts,
                        codes is not None and codes.ready is not None))
        return codes

    monkeypatch.setattr(f8, "encode_ahead", counted)
    assert _run(LLMEngine(path, **kw), reqs) == want
    assert any(takes for takes, _ in started) and all(takes == got for takes, got in started)
