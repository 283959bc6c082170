"""The start-up warm-up (``dsv4.engine.warmup``): which steps it plans, that the engine is idle
and unchanged after it (same outputs as an engine without it, sampled ones included), and
the Triton kernel counter."""

from __future__ import annotations

import pytest
import torch

from dsv4.engine.llm_engine import EngineOptions, LLMEngine
from dsv4.engine.prefill_graphs import PREFILL_BUCKETS
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.warmup import kernels_loaded, kernels_loaded_since, warmup_phases

FLASH = dict(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=65536,
             num_pages=20000, page_size=256, index_topk=512, min_ratio=4)


def _reqs(phase) -> list:
    return [r for wave in phase for r in wave]


def _steps(phases) -> list[int]:
    """The step sizes of the one-wave phases (each one step's prompts)."""
    return [sum(r.prompt_len for r in p[0]) for p in phases
            if len(p) == 1 and p[0][0].max_tokens == 2]


def test_phases_cover_chunks_top_k_step_sizes_mixed_steps_and_a_batch() -> None:
    phases = warmup_phases(**FLASH)
    (short,), (long_req,) = phases[0]
    # Longer than a step (chunked; its first chunk meets the short one's decodes) and four
    # times past the indexer's top-k at ratio 4 (512 entries x 4 tokens).
    assert long_req.prompt_len > FLASH["max_num_batched_tokens"]
    assert long_req.prompt_len >= 4 * 512 * 4
    assert short.prompt_len < long_req.prompt_len and short.max_tokens > 1
    (alone,), = phases[1]   # the same prompt alone: chunks of the full budget
    assert alone.prompt_len == long_req.prompt_len
    want = [n for b in PREFILL_BUCKETS if b <= 2048 for n in (b, b - 5)]
    assert _steps(phases) == want
    assert any(n % 16 for n in want) and any(n % 16 == 0 for n in want)
    mixed = phases[-2]
    assert [len(w) for w in mixed] == [2, 1]
    assert sum(r.prompt_len for r in mixed[1]) + 2 == 2048   # + the two decode rows
    batch = phases[-1]
    assert len(batch) == 1 and len(batch[0]) == 16 and all(r.max_tokens > 1 for r in batch[0])


def test_phases_fit_the_model_length_and_the_cache() -> None:
    for kw in ({"max_num_batched_tokens": 8192}, {"max_model_len": 300},
               {"num_pages": 6, "page_size": 64}, {"max_num_seqs": 3}):
        phases = warmup_phases(**{**FLASH, **kw})
        assert phases
        mml = kw.get("max_model_len", FLASH["max_model_len"])
        for p in phases:
            assert all(1 <= r.prompt_len and r.prompt_len + r.max_tokens <= mml for r in _reqs(p))
            assert max(len(w) for w in p) <= kw.get("max_num_seqs", 64)
    # A short model length: steps of up to the budget made of several prompts; no long one.
    p = warmup_phases(**{**FLASH, "max_model_len": 300})
    assert _steps(p) == [n for b in PREFILL_BUCKETS if b <= 2048 for n in (b, b - 5)]
    assert max(len(ph[0]) for ph in p if len(ph) == 1 and ph[0][0].max_tokens == 2) == 7
    assert all(len(ph) == 1 or len(ph[0]) == 2 for ph in p)      # the mixed phase only
    # A cache of 6 pages of 64 tokens: each phase within its pages.
    p = warmup_phases(**{**FLASH, "num_pages": 6, "page_size": 64})
    for ph in p:
        assert sum(-(-(r.prompt_len + r.max_tokens) // 64) for r in _reqs(ph)) <= 6
    assert p and all(len(_reqs(ph)) < 16 for ph in p)
    # No compressed layers: the long prompt covers two steps; one sequence: no batch.
    p = warmup_phases(**{**FLASH, "min_ratio": 0, "max_num_seqs": 1})
    assert p[0][1][0].prompt_len == 2 * 2048 + 64 and all(len(w) == 1 for ph in p for w in ph)
    # A cache too small for the long prompt's spare pages: no long phase.
    p = warmup_phases(**{**FLASH, "num_pages": 3, "page_size": 1024})
    assert all(r.prompt_len <= 2048 for ph in p for r in _reqs(ph))


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
    # The long prompt next to a short one and alone, the step sizes up to the 64-token budget
    # (32, 27, 64, 59), the mixed step (2 + 1) and the batch of 8, each with decode steps.
    assert stats["requests"] == 2 + 1 + 4 + 3 + 8 and stats["steps"] > 4 * 2
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


def test_kernel_counter_counts_kernel_loads() -> None:
    knobs = pytest.importorskip("triton").knobs
    before = kernels_loaded()   # installs the counter
    hook = knobs.runtime.kernel_load_end_hook
    assert callable(hook)
    hook(None, None, "my_kernel", None, "hash")
    assert kernels_loaded() == before + 1
    assert kernels_loaded_since(before) == ["my_kernel"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_workloads_after_the_warmup_compile_nothing(tmp_path) -> None:
    """On a GPU (default options: decode and prefill graphs, warm-up on), workloads within the
    warm-up's envelope — many short prompts filling whole steps, chunked prompts of several
    lengths with decodes mixed in, a lone prompt of an odd length — load no Triton kernel."""
    from dsv4.engine.warmup import kernels_loaded_since
    from dsv4.model.transformer import load_model
    from dsv4.tiny import make_tiny_checkpoint
    from dsv4.tokenizer import load_tokenizer

    path = make_tiny_checkpoint(tmp_path / "v4", variant="v4", seed=0)
    model = load_model(path, device="cuda", dtype=torch.bfloat16, numerics="official",
                       backend="triton")
    eng = LLMEngine(path, model=model, tokenizer=load_tokenizer(path), device="cuda",
                    kv_cache_dtype="fp8", max_model_len=1024, max_num_batched_tokens=256,
                    max_num_seqs=16)
    assert eng.warmup_stats is not None and eng.warmup_stats["aborted"] == 0
    before = eng.get_stats()["triton_kernels_loaded_total"]
    g = torch.Generator().manual_seed(5)
    for wave in ([40] * 16, [700, 333, 517, 901], [97]):
        for i, n in enumerate(wave):
            eng.add_request(f"{len(wave)}-{i}", torch.randint(20, 500, (n,), generator=g).tolist(),
                            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
    eng.check_idle()
    # What the warm-up cannot promise: the kernels specialized on run-time lengths (those
    # decorated with dsv4.ops.specialize.lengths: top-k, sparse attention, compressor entries)
    # may meet a chunk length or entry count of a divisibility class it did not (run s26e: 7
    # such loads here).  Any other kernel loaded now is a gap in the warm-up's phases.
    loaded = kernels_loaded_since(before)
    assert [k for k in loaded if k not in _length_specialized_kernels()] == [], loaded


def _length_specialized_kernels() -> set[str]:
    """The kernels whose run-time lengths Triton may specialize on (dsv4.ops.specialize)."""
    import re
    from pathlib import Path

    import dsv4.ops

    names = set()
    for f in Path(dsv4.ops.__file__).parent.glob("triton_*.py"):
        names |= set(re.findall(r"@triton\.jit\(\*\*lengths\([^)]*\)\)\s*\ndef (\w+)",
                                f.read_text()))
    return names


def test_length_specialized_kernels_are_found() -> None:
    assert {"_sparse_attn_kernel", "_topk_rows_kernel",
            "_compress_entries_split_kernel"} <= _length_specialized_kernels()


def test_a_failing_warmup_says_so_and_leaves_nothing(tiny_v4_path, tiny_v4_model,
                                                     tiny_v4_tokenizer, monkeypatch) -> None:
    from dsv4.engine import warmup as W

    eng = _engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer)
    calls = {"n": 0}
    real_step = LLMEngine.step

    def failing_step(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", failing_step)
    with pytest.raises(RuntimeError, match=r"warm-up failed in phase 1 .*boom.*--no-warmup"):
        W.run_warmup(eng)
    monkeypatch.setattr(LLMEngine, "step", real_step)
    eng.check_idle()
    assert _generate(eng) == _generate(_engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer))
