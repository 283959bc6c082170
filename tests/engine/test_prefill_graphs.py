"""Piecewise steps (``dsv4.engine.prefill_graphs``) against ``Transformer.forward``.

On a CPU the segments run eagerly over the same persistent buffers a CUDA-graph replay uses,
padded to the bucket: the logits of every step and the caches after a schedule of prefill
chunks, mixed prefill + decode steps and decode-only steps must match the model's own forward
(V4 and V4.1), and the engine with the option the un-batched forward.  The GPU tests replay
the captured graphs against the eager forward (V4-Flash's layer kinds at toy widths) and
against the same segments run eagerly (the engine; V4.1).
"""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.tensors import HybridCache
from dsv4.engine.prefill_graphs import PrefillGraphs, prefill_buckets, run_step
from dsv4.model.context import StepContext
from test_engine_tiny import tiny_v41  # noqa: F401  (the V4.1 engine fixture)

PAGE = 256


_MODELS: dict[str, object] = {}


def _tiny(tmp_path_factory: pytest.TempPathFactory, variant: str):
    from dsv4.model.transformer import load_model
    from dsv4.tiny import make_tiny_checkpoint

    if variant not in _MODELS:
        path = make_tiny_checkpoint(tmp_path_factory.mktemp("pg") / variant, variant=variant,
                                    seed=0)
        _MODELS[variant] = load_model(path, device="cpu", dtype=torch.float32,
                                      numerics="official")
    return _MODELS[variant]


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory):
    return _tiny(tmp_path_factory, "v4")


@pytest.fixture(scope="module", params=["v4", "v41"])
def tiny_any(request, tmp_path_factory: pytest.TempPathFactory):
    return _tiny(tmp_path_factory, request.param)


def _cache(model, records: bool = False) -> HybridCache:
    from dsv4.cache.formats import RECORD_DTYPE

    return HybridCache.allocate(model.cfg, num_pages=8, num_slots=3, page_size=PAGE,
                                dtype=RECORD_DTYPE if records else torch.float32)


def _tensors(cache: HybridCache) -> dict[str, torch.Tensor]:
    out = {f"window{k}": v for k, v in cache.window.items()}
    out.update({f"comp{k}": v for k, v in cache.compressed.items()})
    out.update({f"keys{k}": v for k, v in cache.index_keys.items()})
    for k, s in cache.states.items():
        out[f"kv{k}"], out[f"score{k}"] = s.kv, s.score
    if cache.engram_lookback is not None:
        out["engram"] = cache.engram_lookback
    return out


# Steps of (request slot, tokens this step) with each request's pages 2·slot, 2·slot + 1: a
# 40-token prefill (bucket 64, 24 padding rows), a mixed step (the next 64-token chunk of
# request 0 + a 1-token step of request 1 after its 9-token prefill), decode-only steps, a
# chunk of exactly a bucket (32 tokens), and a step past a compressor group (ratio 4 / 128).
SCHEDULE = [[(0, 40)], [(1, 9)], [(0, 64), (1, 1)], [(0, 1), (1, 1)], [(2, 32)],
            [(0, 100), (2, 1), (1, 3)]]


def _run(model, step_fn, seed: int = 0, records: bool = False
         ) -> tuple[list[torch.Tensor], HybridCache]:
    cache = _cache(model, records)
    gen = torch.Generator().manual_seed(seed)
    pos = {0: 0, 1: 0, 2: 0}
    out = []
    for k, step in enumerate(SCHEDULE):
        seqlens = [n for _, n in step]
        ids = torch.randint(0, model.cfg.vocab_size, (sum(seqlens),), generator=gen)
        types = None
        if model.cfg.is_v41 and k == 4:   # V4.1: an image span in one step
            types = torch.full((sum(seqlens),), -1, dtype=torch.int64)
            types[5:20] = 0
        ctx = StepContext.build(ids, seqlens, [pos[s] for s, _ in step], [s for s, _ in step],
                                [[2 * s, 2 * s + 1] for s, _ in step], token_types=types)
        out.append(model.compute_logits(step_fn(ctx, cache)))
        for s, n in step:
            pos[s] += n
    return out, cache


def test_buckets() -> None:
    assert prefill_buckets(2048)[-1] == 2048 and prefill_buckets(100) == [32, 64]
    with pytest.raises(ValueError, match="max_tokens"):
        prefill_buckets(16)


@pytest.mark.parametrize("prework", ["none", "rows", "records"])
def test_piecewise_steps_match_forward(tiny_any, prework: str) -> None:
    """V4 and V4.1 (its Engram, single-pass blocks and an image span included): every step's
    logits and the final caches: the piecewise path (padding rows included)
    equals the model's forward to fp32 rounding (a CPU GEMM of the bucket's rows may round a
    real row differently than one of the step's rows; with no padding the bits are equal).
    ``prework``: the segments also make the cache part's token-local inputs
    (``Attention.prework``) for a cache of fp32 rows or of fp8 records (the cache the steps
    run on); "none": the cache part makes them."""
    model = tiny_any
    records = prework == "records"
    want, want_cache = _run(model, model.forward, records=records)
    graphs = PrefillGraphs(model, max_tokens=256, use_graphs=False,
                           cache=None if prework == "none" else _cache(model, records))
    got, got_cache = _run(model, run_step(model, graphs), records=records)
    if prework != "none":
        # Every layer's window inputs, and the compressor rows and index queries where it has
        # them, came from the segments.
        made = graphs._state[64].prework
        assert sorted(made) == list(range(len(model.layers)))
        assert all({"window_kv", "window_rows"} <= set(m) for m in made.values())
        assert any("index_q" in m for m in made.values())
        if model.cfg.is_v41:   # KV sources of ratio 2 and 1 (its finished latents)
            assert any("attn_kv" in m for m in made.values())
            assert any("attn_latent" in m for m in made.values())
        else:
            assert any("attn_kv" in m and "index_q" not in m for m in made.values())
    assert graphs.stats["steps"] == len(SCHEDULE)
    assert graphs.stats["padded_tokens"] > 0
    # Every bucket's buffers are the first rows of one shared buffer per name.
    used = [st for st in graphs._state.values() if st.bufs]
    assert len(used) >= 2
    for st in used:
        for name, buf in st.bufs.items():
            assert buf.data_ptr() == graphs._shared[name].data_ptr(), name
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, i
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {i}")
    got_t = _tensors(got_cache)
    for name, t in _tensors(want_cache).items():   # padding rows wrote nothing of a request
        torch.testing.assert_close(got_t[name], t, rtol=1e-5, atol=1e-5, equal_nan=True,
                                   msg=name)


def test_exact_bucket_same_bits(tiny_v4) -> None:
    """A step of exactly a bucket's tokens has no padding: the same bits as forward."""
    model = tiny_v4
    ids = torch.randint(0, model.cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(3))

    def logits(fn) -> torch.Tensor:
        ctx = StepContext.build(ids, [64], [0], [0], [[0]], logits_indices=list(range(64)))
        return model.compute_logits(fn(ctx, _cache(model)))

    graphs = PrefillGraphs(model, max_tokens=64, use_graphs=False)
    assert torch.equal(logits(graphs.forward), logits(model.forward))
    graphs = PrefillGraphs(model, max_tokens=64, use_graphs=False, cache=_cache(model))
    assert torch.equal(logits(graphs.forward), logits(model.forward))


def test_refusals(tiny_v4) -> None:
    model = tiny_v4
    graphs = PrefillGraphs(model, max_tokens=32, use_graphs=False)
    big = StepContext.build(torch.zeros(33, dtype=torch.int64), [33], [0], [0], [[0]])
    assert not graphs.serves(big)
    with pytest.raises(ValueError, match="at most 32"):
        graphs.forward(big, _cache(model))
    with pytest.raises(ValueError, match="CUDA"):
        PrefillGraphs(model, use_graphs=True)
    # Segments made for one cache's formats refuse a cache of others.
    graphs = PrefillGraphs(model, max_tokens=32, use_graphs=False, cache=_cache(model))
    small = StepContext.build(torch.zeros(8, dtype=torch.int64), [8], [0], [0], [[0]])
    with pytest.raises(ValueError, match="formats"):
        graphs.forward(small, _cache(model, records=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("prework", [False, True])
def test_gpu_graph_replays_match_eager(prework: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """V4-Flash's layer kinds at toy widths on the GPU (bench/flash_bench.py --tiny: FP8
    Linears, MXFP4 experts, fp8 records): captured replays against the eager forward over a
    schedule of prefill and mixed steps, and (``prework``: the cache part's token-local inputs
    made in the graphs) bit for bit against the same segments run eagerly.

    The one-token experts on FP8 wgmma are off here: the graphs pad a step into its bucket, so
    their expert calls never have one token and take the grouped kernels, and the eager
    forward's would not — another FP8 class of rounding that the random model's routing
    amplifies (bench/wgmma_model_check.py: ~1e-3 a call, 1e-1 in the logits)."""
    from bench.flash_bench import build_model
    from dsv4.cache.formats import RECORD_DTYPE
    from dsv4.ops import gluon_moe_decode as gm

    monkeypatch.setattr(gm, "WGMMA_DECODE", False)

    model = build_model(5, tiny=True)

    def new_cache() -> HybridCache:
        return HybridCache.allocate(model.cfg, num_pages=8, num_slots=3, page_size=PAGE,
                                    dtype=RECORD_DTYPE, device="cuda")

    def run(step_fn) -> tuple[list[torch.Tensor], HybridCache]:
        cache = new_cache()
        gen = torch.Generator(device="cuda").manual_seed(0)
        pos = {0: 0, 1: 0, 2: 0}
        out = []
        for step in SCHEDULE:
            seqlens = [n for _, n in step]
            ids = torch.randint(0, model.cfg.vocab_size, (sum(seqlens),), generator=gen,
                                device="cuda")
            ctx = StepContext.build(ids, seqlens, [pos[s] for s, _ in step],
                                    [s for s, _ in step], [[2 * s, 2 * s + 1] for s, _ in step],
                                    device="cuda")
            out.append(model.compute_logits(step_fn(ctx, cache)).float())
            for s, n in step:
                pos[s] += n
        return out, cache

    want, _ = run(model.forward)
    cache = new_cache() if prework else None
    graphs = PrefillGraphs(model, max_tokens=256, use_graphs=True, cache=cache)
    got, _ = run(run_step(model, graphs))
    again, _ = run(run_step(model, graphs))   # replays of captured graphs only
    assert graphs.stats["graphs"] > 0
    if prework:
        assert all(st.prework for st in graphs._state.values() if st.graphs)
        segments, _ = run(run_step(model, PrefillGraphs(model, max_tokens=256, use_graphs=False,
                                                          cache=cache)))
        for i, (a, b) in enumerate(zip(got, segments)):
            assert torch.equal(a, b), f"step {i}: replays differ from the eager segments"
    for i, (a, b, c) in enumerate(zip(got, want, again)):
        assert torch.isfinite(a).all(), i
        assert torch.equal(a, c), f"step {i}: replays differ"
        err = float((a - b).norm() / b.norm())
        assert err < 2e-2, f"step {i}: relative error {err:.2e} against the eager forward"


def test_engine_with_prefill_graphs(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer) -> None:
    """The engine with ``prefill_graphs`` (its piecewise path runs eagerly on a CPU): greedy
    tokens and logprobs of mixed, chunked and decode steps equal the un-batched forward's."""
    import random

    from test_engine_tiny import assert_matches_reference, engine, greedy, rand_prompt, run

    rng = random.Random(7)
    eng = engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, prefill_graphs=True,
                 max_num_batched_tokens=48)
    assert eng.runner.prefill_graphs is not None
    assert eng.runner.prefill_graphs.buckets == [32]
    prompts = {f"r{i}": rand_prompt(rng, rng.randrange(1, 70)) for i in range(8)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, greedy(rng.randrange(2, 6), logprobs=1))
    outs = run(eng)
    assert eng.runner.prefill_graphs.stats["steps"] > 0
    for rid, p in prompts.items():
        assert_matches_reference(tiny_v4_model, p, outs[rid])


def test_engine_option_checked(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer) -> None:
    from test_engine_tiny import engine

    with pytest.raises(ValueError, match="prefill_graphs"):
        engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, prefill_graphs="yes")
    # The default follows the decode graphs: none on a CPU, so no piecewise steps either.
    assert engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer).runner.prefill_graphs is None
    # The default's rule: on with decode graphs on one GPU, off under parallelism; explicit
    # values win.
    from dsv4.engine.llm_engine import prefill_graphs_on
    assert prefill_graphs_on(None, True, False)
    assert not prefill_graphs_on(None, True, True) and not prefill_graphs_on(None, False, False)
    assert prefill_graphs_on(True, True, True) and not prefill_graphs_on(False, True, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_prefill_graphs(tmp_path) -> None:
    """The engine with ``prefill_graphs`` on a GPU: every bucket captured at start, no capture
    while serving, and the greedy tokens and logprobs of chunked, mixed and decode steps equal
    to the same engine running the segments eagerly (same kernels and shapes: bit for bit)."""
    import random

    from dsv4.engine.llm_engine import LLMEngine
    from dsv4.model.transformer import load_model
    from dsv4.tiny import make_tiny_checkpoint
    from dsv4.tokenizer import load_tokenizer
    from test_cuda_graphs import run as run_greedy

    path = make_tiny_checkpoint(tmp_path / "v4", variant="v4", seed=0)
    model = load_model(path, device="cuda", dtype=torch.bfloat16, numerics="bf16",
                       backend="triton")
    tok = load_tokenizer(path)
    rng = random.Random(0)
    reqs = [([rng.randrange(20, 500) for _ in range(rng.randrange(5, 300))],
             rng.randrange(4, 16)) for _ in range(6)]
    kw = dict(model=model, tokenizer=tok, device="cuda", max_model_len=512, max_num_seqs=8,
              num_pages=64, max_num_batched_tokens=128, pipeline_decode=False)
    eng = LLMEngine(path, **kw)   # on by default with CUDA graphs on one GPU
    pg = eng.runner.prefill_graphs
    assert pg is not None and pg.use_graphs and pg.buckets == [32, 64, 128]
    assert all(pg.captured(b) for b in pg.buckets)
    capture_s = pg.stats["capture_s"]
    got = run_greedy(eng, reqs)
    assert pg.stats["capture_s"] == capture_s and pg.stats["steps"] > 0
    eager = LLMEngine(path, prefill_graphs=False, **kw)
    assert eager.runner.prefill_graphs is None
    eager.runner.prefill_graphs = PrefillGraphs(model, 128, use_graphs=False,
                                                cache=eager.runner.cache)
    assert got == run_greedy(eager, reqs)


def test_engine_v41_with_prefill_graphs(tiny_v41) -> None:
    """V4.1 through the engine's piecewise steps (Engram lookback across chunks, single-pass
    blocks): the un-batched forward's greedy tokens and logprobs."""
    import random

    from dsv4.engine.llm_engine import LLMEngine
    from test_engine_tiny import assert_matches_reference, greedy, rand_prompt, run

    path, model = tiny_v41
    rng = random.Random(13)
    eng = LLMEngine(path, device="cpu", model=model, max_model_len=128, page_size=16,
                    max_num_batched_tokens=40, prefill_graphs=True)
    assert eng.runner.prefill_graphs is not None
    prompts = {f"v{i}": rand_prompt(rng, n) for i, n in enumerate((70, 3, 17))}
    for rid, p in prompts.items():
        eng.add_request(rid, p, greedy(5, logprobs=0))
    outs = run(eng)
    assert eng.runner.prefill_graphs.stats["steps"] > 0
    for rid, p in prompts.items():
        assert_matches_reference(model, p, outs[rid])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_v41_graph_replays_match_eager_segments(tmp_path) -> None:
    """The tiny V4.1 model on the GPU (Engram, single-pass blocks, an image span): captured
    replays give the bits of the same segments run eagerly, step after step."""
    from dsv4.model.transformer import load_model
    from dsv4.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "v41", variant="v41", seed=0)
    model = load_model(path, device="cuda", dtype=torch.bfloat16, numerics="bf16",
                       backend="triton")

    def new_cache() -> HybridCache:
        return HybridCache.allocate(model.cfg, num_pages=8, num_slots=3, page_size=PAGE,
                                    dtype=torch.bfloat16, device="cuda")

    def run(graphs: PrefillGraphs) -> list[torch.Tensor]:
        cache = new_cache()
        gen = torch.Generator(device="cuda").manual_seed(0)
        pos = {0: 0, 1: 0, 2: 0}
        out = []
        for k, step in enumerate(SCHEDULE):
            seqlens = [n for _, n in step]
            ids = torch.randint(0, model.cfg.vocab_size, (sum(seqlens),), generator=gen,
                                device="cuda")
            types = None
            if k == 4:
                types = torch.full((sum(seqlens),), -1, dtype=torch.int64)
                types[5:20] = 0
            ctx = StepContext.build(ids, seqlens, [pos[s] for s, _ in step],
                                    [s for s, _ in step], [[2 * s, 2 * s + 1] for s, _ in step],
                                    token_types=types, device="cuda")
            out.append(model.compute_logits(graphs.forward(ctx, cache)).float())
            for s, n in step:
                pos[s] += n
        return out

    # With the cache part's token-local inputs made in the segments (Attention.prework).
    replayed = run(PrefillGraphs(model, max_tokens=256, use_graphs=True, cache=new_cache()))
    eager = run(PrefillGraphs(model, max_tokens=256, use_graphs=False, cache=new_cache()))
    for i, (a, b) in enumerate(zip(replayed, eager)):
        assert torch.isfinite(a).all(), i
        assert torch.equal(a, b), f"step {i}"
