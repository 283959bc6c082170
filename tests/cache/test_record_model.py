"""The model and the engine on record caches (kv_cache_dtype "fp8").

In numerics "official" the stored values ARE the fake-quantized values, so a record cache must
give exactly what a cache of rows gives (bf16 compute: bit for bit; V4 in fp32 differs only by
the record's bf16 RoPE tail).  In numerics "bf16" the records are a real quantization: one
attention layer stays within a few percent of the row cache.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dsv4.model.compressor as compressor_mod
from dsv4.cache.formats import RECORD_DTYPE
from dsv4.cache.tensors import HybridCache
from dsv4.config import ModelConfig
from dsv4.engine.llm_engine import LLMEngine
from dsv4.engine.sampling_params import SamplingParams
from dsv4.model.attention import Attention
from dsv4.model.context import StepContext, pages_needed
from dsv4.model.transformer import load_model
from dsv4.ops import get_ops
from dsv4.tiny import make_tiny_checkpoint, tiny_config
from dsv4.tokenizer import load_tokenizer

# The attention tests' deterministic initialization (one definition for both test folders).
_spec = importlib.util.spec_from_file_location(
    "attention_helpers_for_cache",
    Path(__file__).resolve().parents[1] / "model" / "test_attention_helpers.py")
_attention_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_attention_helpers)  # type: ignore[union-attr]


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes; a busy 2-core machine spins otherwise
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("records")
    return {v: make_tiny_checkpoint(root / v, variant=v, seed=0) for v in ("v4", "v41")}


def _forward(model, ids: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Un-batched forward of ``ids`` on a fresh cache of ``cache_dtype`` (as forward_full)."""
    ctx = StepContext.single(ids, start_pos=0, page_size=256, all_logits=True)
    cache = HybridCache.allocate(model.cfg, pages_needed(ids.numel(), 256), 1, 256, cache_dtype)
    return model.compute_logits(model.forward(ctx, cache))


def _generate(path: str, model, kv_cache_dtype: str, prompts: list[list[int]], n: int
              ) -> list[tuple[list[int], list[float]]]:
    """Greedy continuations through the engine (chunked prefill, mixed batches, decode)."""
    eng = LLMEngine(path, device="cpu", model=model, tokenizer=load_tokenizer(path),
                    dtype=model.dtype, numerics=model.numerics, kv_cache_dtype=kv_cache_dtype,
                    max_model_len=512, max_num_batched_tokens=48, max_num_seqs=4)
    assert eng.runner.cache.records == (kv_cache_dtype == "fp8")
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    eng.check_idle()
    res = []
    for i in range(len(prompts)):
        c = done[str(i)]
        res.append((c.token_ids, [c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)]))
    return res


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(20, 500) for _ in range(n)] for n in lengths]


def test_v4_official_engine_on_records_equals_the_bf16_cache(ckpt) -> None:
    """bf16 compute: every stored value is representable, so tokens AND logprobs are equal.
    140 tokens cross a ratio-128 group; 48-token chunks split prefills, 10 decode steps wrap
    the window ring (8) and close ratio-4 groups."""
    model = load_model(ckpt["v4"], dtype=torch.bfloat16, numerics="official")
    prompts = _prompts(0, (140, 37))
    records = _generate(ckpt["v4"], model, "fp8", prompts, 10)
    rows = _generate(ckpt["v4"], model, "bf16", prompts, 10)
    assert records == rows
    assert len(records[0][0]) == 10


def test_v41_official_engine_on_records_equals_the_row_cache(ckpt) -> None:
    """V4.1 stores no bf16 part: records equal the fp32 row cache exactly too."""
    model = load_model(ckpt["v41"], dtype=torch.float32, numerics="official")
    prompts = _prompts(1, (40, 23))
    assert _generate(ckpt["v41"], model, "fp8", prompts, 8) == \
        _generate(ckpt["v41"], model, "auto", prompts, 8)
    ids = torch.tensor(prompts[0])
    assert torch.equal(_forward(model, ids, RECORD_DTYPE), _forward(model, ids, torch.float32))


def test_v4_fp32_official_differs_only_by_the_bf16_rope_tail(ckpt, monkeypatch) -> None:
    """fp32 compute: the V4 record keeps the RoPE tail in bf16 (the official format).  A row
    cache whose stored RoPE tails are rounded to bf16 gives exactly the record cache's logits."""
    model = load_model(ckpt["v4"], dtype=torch.float32, numerics="official")
    ids = torch.tensor(_prompts(2, (40,))[0])
    got = _forward(model, ids, RECORD_DTYPE)
    plain = _forward(model, ids, torch.float32)
    rd = model.cfg.rope_head_dim
    stored = compressor_mod.Compressor._stored

    def bf16_tail(rows: torch.Tensor) -> torch.Tensor:
        return torch.cat((rows[:, :-rd], rows[:, -rd:].to(torch.bfloat16).to(rows.dtype)), -1)

    # The window ring is written by the attention's ops encode_records / write_records: wrap
    # those of each attention layer (its compressors and indexer keep their own op table, so
    # the fp4 index keys are not touched).
    for layer in model.layers:
        att = layer.attn
        table = dict(vars(att.ops))

        def encode_window(rows, fmt, dtype, _op=table["encode_records"]):
            return _op(bf16_tail(rows) if fmt is None else rows, fmt, dtype)

        def write_window(pool, dst, rows, src, fmt, _op=table["write_records"]):
            return _op(pool, dst, bf16_tail(rows) if fmt is None else rows, src, fmt)

        table.update(encode_records=encode_window, write_records=write_window)
        monkeypatch.setattr(att, "ops", SimpleNamespace(**table))

    def stored_entries(self, entries: torch.Tensor, store_quantizes: bool) -> torch.Tensor:
        entries = stored(self, entries, store_quantizes)
        return entries if self.rotate else bf16_tail(entries)  # not the (fp4) index keys

    monkeypatch.setattr(compressor_mod.Compressor, "_stored", stored_entries)
    tailed = _forward(model, ids, torch.float32)
    assert torch.equal(got, tailed)
    assert not torch.equal(got, plain)  # the tail rounding is visible in fp32


def _attention(cfg: ModelConfig, layer: int, seed: int) -> Attention:
    att = Attention(cfg, layer, "bf16", get_ops("torch"), torch.float32)
    _attention_helpers.init_attention(att, seed)
    return att


@pytest.mark.parametrize("variant, layer, tol", [("v4", 0, 0.05), ("v4", 2, 0.06),
                                                 ("v41", 0, 0.08)])
def test_bf16_numerics_records_stay_close(variant: str, layer: int, tol: float) -> None:
    """numerics "bf16": a window layer and an HCA layer (no top-k to flip) on records stay
    within a few percent of the row cache (e4m3 with power-of-two scales: ~2.5% per row)."""
    cfg = ModelConfig.from_dict(tiny_config(variant))
    att = _attention(cfg, layer, seed=layer)
    S = 300
    x = torch.randn(S, cfg.dim, generator=torch.Generator().manual_seed(1))
    outs = []
    for cache_dtype in (torch.float32, RECORD_DTYPE):
        cache = HybridCache.allocate(cfg, 2, 1, 256, cache_dtype)
        ctx = StepContext.build(torch.zeros(S, dtype=torch.long), [S], [0], [0], [[0, 1]])
        outs.append(att(x, ctx, cache))
    ref, got = outs
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(rel.max()) < tol
    assert float(rel.median()) > 1e-3  # the records did quantize
