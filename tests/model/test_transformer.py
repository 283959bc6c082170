"""Transformer / load_model: name-for-name loading and its errors, every tiny checkpoint format,
numerics modes, and the step forward (chunked prefill) against the un-batched forward."""

from __future__ import annotations

import logging

import pytest
import torch

from dsv4.cache.tensors import HybridCache
from dsv4.checkpoint import expected_tensors, load_checkpoint
from dsv4.config import ModelConfig
from dsv4.model.context import StepContext
from dsv4.model.transformer import Transformer, load_model
from dsv4.tiny import make_tiny_checkpoint, tiny_config


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_ckpts")
    return {v: make_tiny_checkpoint(root / v, variant=v, seed=1) for v in ("v4", "v4-base",
                                                                           "v4-bf16")}


@pytest.mark.parametrize("variant", ["v4", "v4-base", "v4-bf16"])
def test_model_names_equal_the_checkpoint_inventory(variant: str) -> None:
    """Every official tensor (MTP included) has exactly one place in the module tree."""
    cfg = ModelConfig.from_dict(tiny_config(variant))
    model = Transformer(cfg, dtype=torch.float32)
    assert set(model.load_targets()) == set(expected_tensors(cfg))


@pytest.mark.parametrize("variant", ["v4", "v4-base", "v4-bf16"])
def test_every_format_loads_and_runs(tiny_paths: dict[str, str], variant: str,
                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dsv4"):
        model = load_model(tiny_paths[variant])
    assert sum("MTP" in r.getMessage() for r in caplog.records) == 1
    assert model.dtype == torch.float32 and model.head.weight.dtype == torch.float32
    # Loaded weights are the checkpoint's (dequantized) values, row e of the stacked experts.
    tensors = load_checkpoint(tiny_paths[variant], dtype=torch.float32, progress=False)
    torch.testing.assert_close(model.layers[1].ffn.experts.w2[3],
                               tensors["layers.1.ffn.experts.3.w2.weight"])
    torch.testing.assert_close(model.layers[2].hc_ffn.fn, tensors["layers.2.hc_ffn_fn"])
    assert torch.equal(model.layers[0].ffn.gate.tid2eid, tensors["layers.0.ffn.gate.tid2eid"])
    logits = model.forward_full(torch.arange(3, 40))
    assert logits.shape == (37, model.cfg.vocab_size) and torch.isfinite(logits).all()
    assert 0.3 < float(logits.std()) < 3.0


def test_official_numerics_is_close_to_bf16_numerics(tiny_paths: dict[str, str]) -> None:
    """Run-time fake quantization perturbs the logits a little, never wholesale (a flip of an
    indexer pick can move a row more, spec §6.13: so judge the bulk, and bound the worst)."""
    ids = torch.randint(2, 400, (40,), generator=torch.Generator().manual_seed(0))
    plain = load_model(tiny_paths["v4"], numerics="bf16").forward_full(ids)
    official = load_model(tiny_paths["v4"], numerics="official").forward_full(ids)
    diff = (official - plain).abs()
    assert diff.max() > 0  # the quantization sites are active
    cos = torch.nn.functional.cosine_similarity(official, plain, dim=-1)
    assert cos.median() > 0.98 and cos.min() > 0.7, cos


def test_blocks_start_the_experts_prework_for_their_call(tiny_paths: dict[str, str]) -> None:
    """Each block calls ``ops.moe_encode_ahead`` once as it starts (the step's token count, the
    gate's top-k, the compute dtype); what it returns reaches that block's expert call as
    ``ExpertWeights.fp8_codes`` (MXFP4 stacks kept quantized, as on a GPU) and is dropped after
    it; the logits stay the same."""
    from types import SimpleNamespace

    from dsv4.model.layers import quantized_storage

    ids = torch.arange(3, 40)
    path = tiny_paths["v4"]
    cfg = ModelConfig.from_file(path)
    with quantized_storage(True):
        model = Transformer(cfg, dtype=torch.float32)
    model.load_tensors(load_checkpoint(path, cfg, dtype=torch.float32, keep_quantized=True,
                                       progress=False), consume=True)
    assert model.layers[0].ffn.experts.fmt == "fp4"
    want = model.forward_full(ids)
    started: list[tuple] = []
    seen: list[object] = []
    markers = {}
    for layer in model.layers:
        ffn, table = layer.ffn, dict(vars(layer.ffn.ops))
        real = dict(table)
        markers[ffn.layer_id] = marker = object()

        def start(experts, tokens, topk, dtype, lid=ffn.layer_id, marker=marker):
            started.append((lid, tokens, topk, dtype))
            return marker

        def spy(name):
            def call(x, ids, weights, experts, *args, **kwargs):
                seen.append(experts.fp8_codes)
                return real[name](x, ids, weights, experts, *args, **kwargs)
            return call

        table.update(moe_encode_ahead=start,
                     **{n: spy(n) for n in ("moe_experts", "moe_experts_shared") if n in table})
        ffn.ops = SimpleNamespace(**table)
    torch.testing.assert_close(model.forward_full(ids), want, rtol=0, atol=0)
    k = model.cfg.n_activated_experts
    assert started == [(i, 37, k, torch.float32) for i in range(model.cfg.n_layers)]
    assert seen == [markers[i] for i in range(model.cfg.n_layers)]
    assert all(layer.ffn.experts.ahead is None for layer in model.layers)


def test_chunked_prefill_equals_full_forward(tiny_paths: dict[str, str]) -> None:
    """Prefill in chunks at odd split points, then decode, on one cache = forward_full."""
    model = load_model(tiny_paths["v4-bf16"])
    ids = torch.randint(2, model.cfg.vocab_size, (270,), generator=torch.Generator().manual_seed(1))
    full = model.forward_full(ids)
    cache = HybridCache.allocate(model.cfg, num_pages=2, num_slots=1, page_size=256,
                                 dtype=torch.float32, device="cpu")
    rows, start = [], 0
    for end in (3, 130, 131, 258, 266, 267, 268, 269, 270):
        ctx = StepContext.single(ids[start:end], start_pos=start, all_logits=True)
        rows.append(model.compute_logits(model.forward(ctx, cache)))
        start = end
    torch.testing.assert_close(torch.cat(rows), full, rtol=0, atol=1e-4)


def test_forward_returns_requested_rows_only(tiny_paths: dict[str, str]) -> None:
    model = load_model(tiny_paths["v4-bf16"])
    ids = torch.arange(5, 25)
    full = model.forward_full(ids)
    cache = HybridCache.allocate(model.cfg, 1, 1, 256, torch.float32, "cpu")
    ctx = StepContext.single(ids, all_logits=False)
    hidden = model.forward(ctx, cache)
    assert hidden.shape == (1, model.cfg.dim)
    torch.testing.assert_close(model.compute_logits(hidden)[0], full[-1], rtol=0, atol=1e-5)


def test_bf16_compute_dtype_runs(tiny_paths: dict[str, str]) -> None:
    model = load_model(tiny_paths["v4-bf16"], dtype=torch.bfloat16)
    ref = load_model(tiny_paths["v4-bf16"]).forward_full(torch.arange(2, 30))
    logits = model.forward_full(torch.arange(2, 30))
    assert logits.dtype == torch.float32 and model.embed.weight.dtype == torch.bfloat16
    # bf16 rounding can flip an indexer pick (spec §6.13): judge the bulk, bound the worst.
    cos = torch.nn.functional.cosine_similarity(logits, ref, dim=-1)
    assert cos.median() > 0.99 and cos.min() > 0.7, cos


def test_load_errors_name_the_tensor(tiny_paths: dict[str, str]) -> None:
    path = tiny_paths["v4-bf16"]
    cfg = ModelConfig.from_file(path)
    good = load_checkpoint(path, cfg, dtype=torch.float32, progress=False)
    model = Transformer(cfg, dtype=torch.float32)

    missing = dict(good)
    del missing["layers.2.attn.wkv.weight"]
    with pytest.raises(ValueError, match=r"1 missing \(layers\.2\.attn\.wkv\.weight\)"):
        model.load_tensors(missing)
    extra = dict(good, **{"layers.9.ffn.gate.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"1 unexpected \(layers\.9\.ffn\.gate\.weight\)"):
        model.load_tensors(extra)
    bad_shape = dict(good, **{"hc_head_base": torch.zeros(cfg.hc_mult + 1)})
    with pytest.raises(ValueError, match=r"hc_head_base: expected shape \(4,\)"):
        model.load_tensors(bad_shape)
    bad_hash = dict(good)
    bad_hash["layers.0.ffn.gate.tid2eid"] = good["layers.0.ffn.gate.tid2eid"].clone()
    bad_hash["layers.0.ffn.gate.tid2eid"][5, 0] = cfg.n_routed_experts
    with pytest.raises(ValueError, match="tid2eid: expert ids must be in"):
        model.load_tensors(bad_hash)


def test_bad_inputs_and_unsupported_variants(tiny_paths: dict[str, str]) -> None:
    model = load_model(tiny_paths["v4-bf16"])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        model.forward_full([])
    with pytest.raises(ValueError, match="token ids must be in"):
        model.forward_full([1, model.cfg.vocab_size])
    with pytest.raises(ValueError, match="token_types"):
        model.forward_full([1, 2], token_types=[-1, -1])
    with pytest.raises(ValueError, match="numerics"):
        Transformer(model.cfg, numerics="fp8")


def test_logits_all_flag_marks_every_row_in_order() -> None:
    """``logits_all`` (the model then skips its row gather) holds exactly when the wanted rows
    are every token in order."""
    decode = StepContext.build([5, 6], [1, 1], [3, 7], [0, 1], [[0], [1]])
    assert decode.logits_all                                  # one token per request
    prefill = StepContext.build([5, 6, 7], [3], [0], [0], [[0]])
    assert not prefill.logits_all                             # the last token only
    every = StepContext.build([5, 6, 7], [3], [0], [0], [[0]], logits_indices=[0, 1, 2])
    assert every.logits_all
    shuffled = StepContext.build([5, 6, 7], [3], [0], [0], [[0]], logits_indices=[1, 0, 2])
    assert not shuffled.logits_all
    with pytest.raises(ValueError, match="logits_all"):
        StepContext(input_ids=prefill.input_ids, positions=prefill.positions,
                    cu_seqlens=prefill.cu_seqlens, start_pos=prefill.start_pos,
                    slots=prefill.slots, block_tables=prefill.block_tables,
                    logits_indices=prefill.logits_indices, seqlens_host=[3],
                    start_pos_host=[0], logits_all=True)
