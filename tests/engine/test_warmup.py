"""The start-up warm-up (``dsv4.engine.warmup``): which steps it plans, that the engine is idle
and unchanged after it (same outputs as an engine without it, sampled ones included), and
the Triton kernel counter."""

from __future__ import annotations

import pytest
import torch

from dsv4.engine.llm_engine import EngineOptions, LLMEngine
from dsv4.engine.prefill_graphs import PREFILL_BUCKETS
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.warmup import kernels_loaded, warmup_phases

FLASH = dict(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=65536,
             num_pages=20000, page_size=256, index_topk=512, min_ratio=4)


def test_phases_cover_chunks_top_k_buckets_and_a_batch() -> None:
    phases = warmup_phases(**FLASH)
    long_phase = phases[0]
    assert len(long_phase) == 2
    short, long_req = long_phase
    # Longer than a step (chunked, the short one decoding meanwhile) and past the indexer's
    # top-k at ratio 4 (512 entries x 4 tokens).
    assert long_req.prompt_len > FLASH["max_num_batched_tokens"]
    assert long_req.prompt_len > 512 * 4
    assert short.prompt_len < long_req.prompt_len and short.max_tokens > 1
    singles = [g[0].prompt_len for g in phases if len(g) == 1]
    assert singles == [n for b in PREFILL_BUCKETS for n in (b, b - 5)]
    assert any(n % 16 for n in singles) and any(n % 16 == 0 for n in singles)
    batch = phases[-1]
    assert len(batch) == 16 and all(r.max_tokens > 1 for r in batch)


def test_phases_fit_the_model_length_and_the_cache() -> None:
    for phases in (warmup_phases(**{**FLASH, "max_num_batched_tokens": 8192}),
                   warmup_phases(**{**FLASH, "max_model_len": 300}),
                   warmup_phases(**{**FLASH, "num_pages": 6, "page_size": 64})):
        assert phases
        for group in phases:
            assert all(r.prompt_len >= 1 and r.prompt_len + r.max_tokens <= FLASH["max_model_len"]
                       for r in group)
    # The topk span dominates a small step budget; the model length caps it.
    p = warmup_phases(**{**FLASH, "max_num_batched_tokens": 256})
    assert p[0][1].prompt_len == 512 * 4 + 64
    assert [g[0].prompt_len for g in p if len(g) == 1] == [32, 27, 64, 59, 128, 123, 256, 251]
    p = warmup_phases(**{**FLASH, "max_model_len": 300})
    assert all(r.prompt_len + r.max_tokens <= 300 for g in p for r in g)
    assert p[0][1].prompt_len == 297
    # A cache of 6 pages of 64 tokens: each group within its pages, the 16-request batch
    # (16 pages) left out.
    p = warmup_phases(**{**FLASH, "num_pages": 6, "page_size": 64})
    for g in p:
        assert sum(-(-(r.prompt_len + r.max_tokens) // 64) for r in g) <= 6
    assert all(len(g) < 16 for g in p)
    # No compressed layers: no top-k span; a one-sequence engine: no batch.
    p = warmup_phases(**{**FLASH, "min_ratio": 0, "max_num_seqs": 1})
    assert p[0][1].prompt_len == 2048 + 64 and all(len(g) <= 2 for g in p)


def _engine(path, model, tok, **kw) -> LLMEngine:
    return LLMEngine(path, device="cpu", model=model, tokenizer=tok, max_model_len=512,
                     max_num_batched_tokens=64, max_num_seqs=8, **kw)


def _generate(eng: LLMEngine) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(20, 500, (n,), generator=g).tolist() for n in (9, 150)]
    eng.add_request("greedy", prompts[0], SamplingParams(temperature=0.0, max_tokens=6,
                                                         ignore_eos=True))
    # Sampled without a seed: it draws from the engine's own generator, which the warm-up
    # (greedy) must leave where it was.
    eng.add_request("sampled", prompts[1], SamplingParams(temperature=1.0, max_tokens=6,
                                                          ignore_eos=True))
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    eng.check_idle()
    return done


def test_engine_after_warmup_is_idle_and_unchanged(tiny_v4_path, tiny_v4_model,
                                                   tiny_v4_tokenizer) -> None:
    cold = _engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer)
    assert cold.warmup_stats is None   # default: off on CPUs
    want = _generate(cold)
    warm = _engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, warmup=True)
    stats = warm.warmup_stats
    assert stats is not None and stats["aborted"] == 0
    # The long prompt's chunks, the buckets up to the 64-token step (32, 27, 64, 59) and the
    # batch, each with decode steps.
    assert stats["requests"] == 2 + 4 + 8 and stats["steps"] > stats["requests"]
    s = warm.get_stats()
    assert s["num_free_pages"] == s["num_pages"] and s["steps_total"] == 0
    assert s["prompt_tokens_total"] == s["generation_tokens_total"] == 0
    assert s["requests_finished_total"] == 0 and s["num_preemptions"] == 0
    assert isinstance(s["triton_kernels_loaded_total"], int)
    assert _generate(warm) == want


def test_warmup_option_is_checked() -> None:
    with pytest.raises(ValueError, match="warmup"):
        EngineOptions(warmup="yes")
    assert EngineOptions().warmup is None


def test_kernel_counter_counts_the_post_compile_hook() -> None:
    knobs = pytest.importorskip("triton").knobs
    before = kernels_loaded()   # installs the counter
    hook = knobs.runtime.jit_post_compile_hook
    assert callable(hook)
    hook(key="k", repr="kernel", fn=None, compile={}, is_manual_warmup=False,
         already_compiled=False)
    assert kernels_loaded() == before + 1
