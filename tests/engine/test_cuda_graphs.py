"""Decode steps of the engine in static-shape mode (the CUDA-graph path, run eagerly on the CPU)
against the dynamic path; the decode-graph buffers, the runner's choice of path, the options,
and the GPU memory sizing arithmetic."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4.cache.tensors import HybridCache
from dsv4.engine.cuda_graphs import DecodeGraphs
from dsv4.engine.llm_engine import EngineOptions, LLMEngine
from dsv4.engine.runner import size_cache
from dsv4.engine.sampling_params import SamplingParams
from dsv4.model.context import StaticShape


def make_engine(path, model, tok, static: bool, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 512)
    eng = LLMEngine(path, device="cpu", model=model, tokenizer=tok, **kw)
    assert eng.runner.decode_graphs is None            # CPU default: dynamic decode
    if static:
        # Force the static-shape decode steps (what a CUDA run replays from graphs).
        from dsv4.engine.runner import ModelRunner
        runner = eng.runner
        eng.runner = ModelRunner(model, eng.config, device=eng.device,
                                 cache_dtype=runner.cache.dtype, num_pages=eng.manager.num_pages,
                                 num_slots=eng.manager.num_slots, page_size=runner.page_size,
                                 max_model_len=eng.max_model_len, static_decode=True,
                                 cuda_graph_max_batch=kw.get("max_num_seqs", 64))
    return eng


def run(eng: LLMEngine, requests: list[tuple[list[int], int]]
        ) -> dict[str, tuple[list[int], list[float]]]:
    for i, (prompt, n) in enumerate(requests):
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                        ignore_eos=True, logprobs=1))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, [c.logprobs[k][t].logprob
                                                      for k, t in enumerate(c.token_ids)])
    eng.check_idle()
    return done


def prompts(seed: int, lens: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(20, 500) for _ in range(n)] for n in lens]


def test_static_decode_equals_dynamic_exactly(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer):
    """Four requests prefilled in one step, then decode steps of exactly 4 (a bucket: no padding
    row): tokens and logprobs equal bit for bit, across window / compression boundaries."""
    reqs = [(p, 14) for p in prompts(0, [37, 130, 9, 124])]
    dyn = run(make_engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, False), reqs)
    eng = make_engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, True)
    sta = run(eng, reqs)
    assert sta == dyn
    stats = eng.runner.decode_graphs.stats
    assert stats["eager_static_steps"] == 13 and stats["padded_rows"] == 0


def test_static_decode_with_padding_rows(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer):
    """Requests that start and finish at different steps (batches of 1..5 padded to 2/4/8), a
    chunked prompt and a slot reused: the same greedy tokens, logprobs within fp32 rounding."""
    lens, outs = [40, 300, 12, 7, 90], [9, 5, 16, 3, 11]
    reqs = list(zip(prompts(1, lens), outs))
    kw = dict(max_num_batched_tokens=128, max_num_seqs=8)
    dyn = run(make_engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, False, **kw), reqs)
    eng = make_engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, True, **kw)
    eng.add_request("late", prompts(2, [20])[0],
                    SamplingParams(temperature=0.0, max_tokens=4, logprobs=1))
    sta = run(eng, reqs)
    sta.pop("late")
    assert sorted(sta) == sorted(dyn)
    for rid, (toks, lps) in dyn.items():
        assert sta[rid][0] == toks, rid
        assert sta[rid][1] == pytest.approx(lps, abs=2e-5), rid
    stats = eng.runner.decode_graphs.stats
    assert stats["eager_static_steps"] > 5 and stats["padded_rows"] > 0


def test_runner_picks_static_steps_only_for_plain_decode(tiny_v4_path, tiny_v4_model,
                                                          tiny_v4_tokenizer):
    eng = make_engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, True, max_num_seqs=4)
    runner = eng.runner
    from dsv4.engine.runner import StepPlan

    def plan(seqlens, rows):
        n = sum(seqlens)
        return StepPlan([1] * n, seqlens, [5] * len(seqlens), list(range(len(seqlens))),
                        [[0]] * len(seqlens), rows)

    assert runner.static_bucket(plan([1, 1, 1], [0, 1, 2]), [0, 1, 2], [[], [], []]) == 4
    assert runner.static_bucket(plan([1], [0]), [0], [[]]) == 1
    assert runner.static_bucket(plan([2, 1], [1, 2]), [0, 1], [[], []]) is None     # prefill
    assert runner.static_bucket(plan([1, 1], [1]), [-1, 0], [[], []]) is None        # no sample
    assert runner.static_bucket(plan([1], [0]), [0], [[4]]) is None                   # prompt lp
    assert runner.static_bucket(plan([1] * 5, list(range(5))), list(range(5)),
                                [[]] * 5) is None                                     # > bucket
    # The cache holds the scratch slot and page beyond the manager's ids.
    assert runner.cache.num_slots == eng.manager.num_slots + 1
    assert runner.cache.num_pages == eng.manager.num_pages + 1


def test_decode_graphs_refuse_bad_input(tiny_v4_model) -> None:
    cfg = tiny_v4_model.cfg
    cache = HybridCache.allocate(cfg, num_pages=3, num_slots=3, page_size=256,
                                 dtype=torch.float32)
    static = StaticShape(max_pages=2, scratch_slot=2, scratch_page=2)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(tiny_v4_model, cache, static, 4, device=torch.device("cpu"), use_graphs=True)
    with pytest.raises(ValueError, match="scratch slot 5"):
        DecodeGraphs(tiny_v4_model, cache, StaticShape(2, 5, 2), 4, device=torch.device("cpu"),
                     use_graphs=False)
    g = DecodeGraphs(tiny_v4_model, cache, static, 3, device=torch.device("cpu"),
                     use_graphs=False)
    assert g.buckets == [1, 2, 3]
    with pytest.raises(ValueError, match="expected 1..3"):
        g.run([1] * 4, [0] * 4, [0, 1, 0, 1], [[0]] * 4)
    with pytest.raises(ValueError, match="max_pages=2"):
        g.run([1], [0], [0], [[0, 1, 0]])
    with pytest.raises(ValueError, match="one entry per request"):
        g.run([1, 2], [0], [0, 1], [[0], [1]])
    with pytest.raises(RuntimeError, match="graphs are off"):
        g.capture(1)
    # A step through the buffers equals a fresh static context of the same values.
    from dsv4.model.context import StepContext
    logits = g.run([5, 6], [0, 0], [0, 1], [[0], [1]]).clone()
    cache2 = HybridCache.allocate(cfg, num_pages=3, num_slots=3, page_size=256,
                                  dtype=torch.float32)
    ctx = StepContext.static_decode([5, 6], [0, 0], [0, 1], [[0], [1]], 2, static)
    ref = tiny_v4_model.compute_logits(tiny_v4_model.forward(ctx, cache2))[:2]
    assert torch.equal(logits, ref)


def test_engine_graph_options() -> None:
    assert EngineOptions().enforce_eager is False and EngineOptions().cuda_graph_max_batch is None
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineOptions(enforce_eager="yes")
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        EngineOptions(cuda_graph_max_batch=0)
    assert EngineOptions().cuda_graph_capture == "startup"
    with pytest.raises(ValueError, match="cuda_graph_capture='eager'.*'startup', 'lazy'"):
        EngineOptions(cuda_graph_capture="eager")


def test_capture_graphs_at_start_captures_every_bucket_largest_first(
        tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, monkeypatch) -> None:
    """capture_graphs (what the engine runs at start) captures every bucket, largest first,
    so that no request waits for a capture; a failure turns graphs off and decode still gives
    the dynamic results."""
    eng = make_engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, True, max_num_seqs=5)
    graphs = eng.runner.decode_graphs
    assert graphs.buckets == [1, 2, 4, 5]
    eng.runner.capture_graphs()        # graphs off (CPU): nothing to capture
    assert eng.runner.decode_graphs is graphs
    graphs.use_graphs = True
    order: list[int] = []
    monkeypatch.setattr(graphs, "capture", order.append)
    eng.runner.capture_graphs()
    assert order == [5, 4, 2, 1] and eng.runner.decode_graphs is graphs

    reqs = [(p, 5) for p in prompts(5, [21, 8])]
    dyn = run(make_engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, False), reqs)

    def capture(B: int) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (capture)")

    monkeypatch.setattr(graphs, "capture", capture)
    eng.runner.capture_graphs()
    assert eng.runner.decode_graphs is None
    assert "out of memory" in eng.runner.graphs_disabled_reason
    assert run(eng, reqs) == dyn


def test_gpu_memory_sizing_arithmetic(tiny_v4_model, monkeypatch) -> None:
    """pages = (total·util − in use − peak activations − graph pool − slot state) / page
    − 1 (the scratch page), with the profiles run before the free memory is read."""
    cfg = tiny_v4_model.cfg
    calls = []
    GiB = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: calls.append("mem") or (30 * GiB, 40 * GiB))
    per_page = HybridCache.bytes_per_page(cfg, 256, torch.bfloat16)
    per_slot = HybridCache.bytes_per_slot(cfg, torch.bfloat16)
    pages = size_cache(cfg, device=torch.device("cuda"), cache_dtype=torch.bfloat16,
                       page_size=256, num_slots=7, max_model_len=4096, max_num_seqs=7,
                       num_pages=None, kv_cache_memory=None, gpu_memory_utilization=0.5,
                       profile=lambda: calls.append("peak") or 2 * GiB,
                       graph_pool=lambda: calls.append("graphs") or GiB)
    assert calls == ["peak", "graphs", "mem"]
    want = (20 * GiB - 10 * GiB - 2 * GiB - GiB - 8 * per_slot) // per_page - 1
    assert pages == want
    with pytest.raises(ValueError, match="too small"):
        size_cache(cfg, device=torch.device("cuda"), cache_dtype=torch.bfloat16, page_size=256,
                   num_slots=7, max_model_len=4096, max_num_seqs=7, num_pages=None,
                   kv_cache_memory=None, gpu_memory_utilization=0.25,
                   profile=lambda: 0, graph_pool=lambda: 0)


def test_failed_capture_falls_back_to_eager(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer,
                                            monkeypatch) -> None:
    """A graph that cannot be captured turns graphs off for good; the step and the later ones
    run eagerly with the same results."""
    reqs = [(p, 6) for p in prompts(4, [30, 11])]
    dyn = run(make_engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, False), reqs)
    eng = make_engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, True)
    graphs = eng.runner.decode_graphs
    graphs.use_graphs = True           # pretend CUDA: the first decode step captures

    def capture(B: int) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "capture", capture)
    assert run(eng, reqs) == dyn
    assert eng.runner.decode_graphs is None
    assert "not permitted" in eng.runner.graphs_disabled_reason
