"""CUDA graphs of the engine on a GPU (skipped without CUDA): the tiny V4 model in bf16, the same
greedy workload with graphs and with the static-shape steps run eagerly (the same kernels and
shapes: equal bit for bit), both leaving the cache idle.  (Against the dynamic eager path bf16
kernels of other widths may round differently: bench/engine_graphs.py reports that agreement.)"""

from __future__ import annotations

import random

import pytest
import torch

from test_cuda_graphs import run as _run  # the greedy run-to-completion helper

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_graph_decode_matches_static_eager_on_gpu(tmp_path) -> None:
    from dsv4.engine.cuda_graphs import DecodeGraphs
    from dsv4.engine.llm_engine import LLMEngine
    from dsv4.model.context import StaticShape, pages_needed
    from dsv4.model.transformer import load_model
    from dsv4.tiny import make_tiny_checkpoint
    from dsv4.tokenizer import load_tokenizer

    path = make_tiny_checkpoint(tmp_path / "v4", variant="v4", seed=0)
    model = load_model(path, device="cuda", dtype=torch.bfloat16, numerics="bf16",
                       backend="triton")
    tok = load_tokenizer(path)
    rng = random.Random(0)
    reqs = [([rng.randrange(20, 500) for _ in range(rng.randrange(5, 200))],
             rng.randrange(4, 24)) for _ in range(6)]
    kw = dict(model=model, tokenizer=tok, device="cuda", max_model_len=512, max_num_seqs=8,
              num_pages=64)
    # (Unpipelined: this compares graphs with eager steps of the same batches; pipelining is
    # checked by the next test.)
    graphs = LLMEngine(path, pipeline_decode=False, **kw)
    # cuda_graph_capture="startup" (default): every bucket is captured before any request.
    dg = graphs.runner.decode_graphs
    assert dg is not None and sorted(dg.graphs) == dg.buckets == [1, 2, 4, 8]
    capture_s = dg.stats["capture_s"]
    got = _run(graphs, reqs)
    assert dg.stats["capture_s"] == capture_s   # no capture while serving
    assert graphs.runner.decode_graphs is not None and graphs.runner.decode_graphs.stats["replays"]
    eager = LLMEngine(path, enforce_eager=True, **kw)
    assert eager.runner.decode_graphs is None
    static = StaticShape(pages_needed(512, 256), eager.manager.num_slots, eager.manager.num_pages)
    eager.runner.decode_graphs = DecodeGraphs(model, eager.runner.cache, static, 8,
                                              device=torch.device("cuda"), use_graphs=False)
    want_static = _run(eager, reqs)
    assert got == want_static
    assert eager.runner.decode_graphs.stats["eager_static_steps"] > 0


def test_pipelined_graph_decode_on_gpu(tmp_path) -> None:
    """Pipelined decode over real CUDA graphs (the default on a GPU): the tokens of the same
    engine with pipelining off, for greedy, seeded and stop-token requests; idle cache after."""
    from dsv4.engine.llm_engine import LLMEngine
    from dsv4.engine.sampling_params import SamplingParams
    from dsv4.model.transformer import load_model
    from dsv4.tiny import make_tiny_checkpoint
    from dsv4.tokenizer import load_tokenizer
    from test_pipeline_decode import drive

    path = make_tiny_checkpoint(tmp_path / "v4", variant="v4", seed=0)
    model = load_model(path, device="cuda", dtype=torch.bfloat16, numerics="bf16",
                       backend="triton")
    tok = load_tokenizer(path)
    rng = random.Random(1)
    ps = [[rng.randrange(20, 500) for _ in range(rng.randrange(5, 200))] for _ in range(5)]
    reqs = {f"g{i}": (p, SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True))
            for i, p in enumerate(ps[:3])}
    reqs["s"] = (ps[3], SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=16,
                                       ignore_eos=True))
    kw = dict(model=model, tokenizer=tok, device="cuda", max_model_len=512, max_num_seqs=8,
              num_pages=64)
    plain_eng = LLMEngine(path, pipeline_decode=False, **kw)
    plain = drive(plain_eng, reqs)
    stop = plain["g2"][0][7]
    reqs["t"] = (ps[4], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                       stop_token_ids=[stop]))
    plain = drive(LLMEngine(path, pipeline_decode=False, **kw), reqs)
    eng = LLMEngine(path, **kw)
    assert eng.pipeline_decode
    got = drive(eng, reqs)
    assert got == plain and eng._pipelined_launches > 0
