"""Quantized weight storage (the GPU path's memory layout) checked on CPU through the torch twins:
``Linear`` keeping FP8 weights, the routed experts keeping MXFP4 / FP8 stacks, and a whole tiny
model built under ``quantized_storage()`` against the dense model."""

from __future__ import annotations

import pytest
import torch

from dsv4 import formats
from dsv4.config import ModelConfig
from dsv4.model.layers import Linear, keeps_quantized, quantized_storage
from dsv4.model.moe import Experts
from dsv4.ops import torch_dense
from dsv4.tiny import make_tiny_checkpoint, tiny_config


def _fp8_qweight(n: int, k: int, block: int, gen: torch.Generator) -> formats.QuantWeight:
    w8, s = formats.quant_fp8_block(torch.randn(n, k, generator=gen), block)
    return formats.QuantWeight(w8, s, "fp8", block, (n, k))


def test_storage_choice_follows_flag_context_and_device() -> None:
    assert keeps_quantized(True) and not keeps_quantized(False)
    assert not keeps_quantized()  # CPU default device
    with quantized_storage():
        assert keeps_quantized() and not keeps_quantized(False)
        with quantized_storage(False):
            assert not keeps_quantized()
        assert keeps_quantized()
    assert not keeps_quantized()


def test_linear_keeps_fp8_and_runs_the_fp8_op() -> None:
    gen = torch.Generator().manual_seed(0)
    qw = _fp8_qweight(96, 256, 128, gen)
    lin = Linear(256, 96, fmt="fp8", block=128, numerics="official", dtype=torch.float32,
                 keep_quantized=True)
    assert lin.weight.shape == (0, 256)
    lin.load_weight(qw)
    assert lin.holds_quantized and lin.qweight is qw and lin.weight.numel() == 0
    x = torch.randn(5, 256, generator=gen)
    y = lin(x)
    assert torch.equal(y, torch_dense.fp8_linear(x, qw.weight, qw.scale, 128, torch.float32))
    dense = Linear(256, 96, fmt="fp8", block=128, numerics="official", dtype=torch.float32)
    dense.load_weight(qw)
    assert dense.weight.shape == (96, 256) and not dense.holds_quantized
    torch.testing.assert_close(y, dense(x), rtol=1e-5, atol=1e-5)


def test_linear_quantized_storage_errors_and_dense_fallback() -> None:
    gen = torch.Generator().manual_seed(1)
    lin = Linear(256, 64, fmt="fp8", block=128, dtype=torch.float32, keep_quantized=True)
    with pytest.raises(ValueError, match="no weight loaded"):
        lin(torch.randn(2, 256))
    with pytest.raises(ValueError, match="block 64"):
        lin.load_weight(_fp8_qweight(64, 256, 64, gen))
    w = torch.randn(64, 256, generator=gen)
    lin.load_weight(w)  # a dense checkpoint tensor still works: held dense
    assert not lin.holds_quantized
    torch.testing.assert_close(lin(torch.ones(1, 256)), torch.ones(1, 256) @ w.T)
    bf16 = Linear(256, 64, fmt="bf16", dtype=torch.float32, keep_quantized=True)
    assert bf16.weight.shape == (64, 256)  # only FP8 Linears hold quantized weights


def _expert_cfg(expert_dtype: str) -> ModelConfig:
    over = dict(hidden_size=128, moe_intermediate_size=128, n_routed_experts=4,
                num_experts_per_tok=2, expert_dtype=expert_dtype)
    if expert_dtype == "fp8":
        over["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                       "activation_scheme": "dynamic",
                                       "weight_block_size": [128, 128]}
    return ModelConfig.from_dict(tiny_config("v4", **over))


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_experts_quantized_stacks_match_dense(expert_dtype: str) -> None:
    cfg = _expert_cfg(expert_dtype)
    gen = torch.Generator().manual_seed(2)
    quant = Experts(cfg, None, torch.float32, keep_quantized=True)
    dense = Experts(cfg, None, torch.float32, keep_quantized=False)
    assert quant.fmt == expert_dtype and dense.fmt == "dense"
    packed = 2 if expert_dtype == "fp4" else 1
    assert quant.w1.shape == (4, 128, 128 // packed)
    for name, load in quant.official_targets("").items():
        n, k = (128, 128)
        w = torch.randn(n, k, generator=gen) * 0.1
        if expert_dtype == "fp4":
            q, s = formats.quant_mxfp4(w)
            qw = formats.QuantWeight(q, s, "fp4", 32, (n, k))
        else:
            q, s = formats.quant_fp8_block(w, 128, cfg.scale_dtype)
            qw = formats.QuantWeight(q, s, "fp8", 128, (n, k))
        load(qw)
        dense.official_targets("")[name](qw)
    x = torch.randn(6, 128, generator=gen)
    ids = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 0], [2, 2], [0, 3]])
    w = torch.rand(6, 2, generator=gen)
    y_q = torch_dense.moe_experts(x, ids, w, quant.weights(), cfg.swiglu_limit)
    y_d = torch_dense.moe_experts(x, ids, w, dense.weights(), cfg.swiglu_limit)
    assert torch.equal(y_q, y_d) and y_q.abs().sum() > 0


def test_experts_kchunk_relayout_keeps_the_output() -> None:
    """MXFP4 stacks re-stored K-chunk-major (the GPU layout, Experts.relayout_kchunk): other
    bytes, the same expert outputs; a CPU load keeps the row-major layout."""
    cfg = ModelConfig.from_dict(tiny_config("v4", hidden_size=256, moe_intermediate_size=128,
                                            n_routed_experts=4, num_experts_per_tok=2,
                                            expert_dtype="fp4"))
    ex = Experts(cfg, None, torch.float32, keep_quantized=True)
    assert ex.k_step == 128 and ex.kchunk == 0
    gen = torch.Generator().manual_seed(4)
    for name, load in ex.official_targets("").items():
        n, k = (256, 128) if name.endswith("w2.weight") else (128, 256)
        q, s = formats.quant_mxfp4(torch.randn(n, k, generator=gen) * 0.1)
        load(formats.QuantWeight(q, s, "fp4", 32, (n, k)))
    assert ex.kchunk == 0                       # loaded on the CPU: row-major
    x = torch.randn(5, 256, generator=gen)
    ids = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 0], [2, 2]])
    w = torch.rand(5, 2, generator=gen)
    before = torch_dense.moe_experts(x, ids, w, ex.weights(), cfg.swiglu_limit)
    rows = ex.w1.clone()
    ex.relayout_kchunk()
    assert ex.kchunk == 128 and ex.weights().kchunk == 128 and not torch.equal(ex.w1, rows)
    assert torch.equal(torch_dense.kchunk_rows(ex.w1, 64), rows)
    assert torch.equal(torch_dense.moe_experts(x, ids, w, ex.weights(), cfg.swiglu_limit),
                       before)
    ex.relayout_kchunk()                        # already chunked: a no-op
    assert torch.equal(torch_dense.kchunk_rows(ex.w1, 64), rows)


def test_experts_keep_fp8_codes_on_cpu_and_reset_by_loads() -> None:
    """Experts.keep_fp8_codes (the engine option moe_fp8_codes) keeps nothing off CUDA (0
    bytes); codes kept earlier are dropped when an expert is loaded or the stacks re-laid, and
    weights() hands the kept codes to the expert ops."""
    cfg = ModelConfig.from_dict(tiny_config("v4", hidden_size=256, moe_intermediate_size=128,
                                            n_routed_experts=4, num_experts_per_tok=2,
                                            expert_dtype="fp4"))
    ex = Experts(cfg, None, torch.float32, keep_quantized=True)
    assert ex.keep_fp8_codes() == 0 and ex.fp8_codes is None
    marker = object()
    ex.fp8_codes = marker
    assert ex.weights().fp8_codes is marker
    gen = torch.Generator().manual_seed(5)
    q, s = formats.quant_mxfp4(torch.randn(128, 256, generator=gen) * 0.1)
    ex.official_targets("")["0.w1.weight"](formats.QuantWeight(q, s, "fp4", 32, (128, 256)))
    assert ex.fp8_codes is None
    ex.fp8_codes = marker
    ex.relayout_kchunk()
    assert ex.fp8_codes is None


def test_experts_quantized_storage_rejects_other_formats() -> None:
    cfg = _expert_cfg("fp4")
    ex = Experts(cfg, None, torch.float32, keep_quantized=True)
    with pytest.raises(ValueError, match="a dense tensor"):
        ex.load_expert(0, "w1", torch.zeros(128, 128))
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match="found fp8"):
        ex.load_expert(0, "w1", _fp8_qweight(128, 128, 128, gen))
    with pytest.raises(ValueError, match="logical shape"):
        q, s = formats.quant_mxfp4(torch.randn(128, 64, generator=gen))
        ex.load_expert(0, "w2", formats.QuantWeight(q, s, "fp4", 32, (128, 64)))


def test_tiny_model_with_quantized_storage_matches_dense(tmp_path) -> None:
    """A whole tiny V4 model built under quantized_storage() keeps FP8/MXFP4 weights and gives
    the dense model's logits (official numerics: both quantize the activations the same way)."""
    from dsv4.checkpoint import load_checkpoint
    from dsv4.model.transformer import Transformer

    path = make_tiny_checkpoint(tmp_path / "ckpt", variant="v4", seed=3)
    cfg = ModelConfig.from_file(path)
    with quantized_storage():
        quant = Transformer(cfg, numerics="official", dtype=torch.float32)
    quant.load_tensors(load_checkpoint(path, cfg, dtype=torch.float32, keep_quantized=True),
                       consume=True)
    dense = Transformer(cfg, numerics="official", dtype=torch.float32)
    dense.load_tensors(load_checkpoint(path, cfg, dtype=torch.float32), consume=True)
    lin = quant.layers[0].attn.wq_b
    assert lin.holds_quantized and lin.weight.numel() == 0
    assert quant.layers[1].ffn.experts.fmt == "fp4"
    assert quant.layers[1].ffn.experts.w1.dtype == torch.int8
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    got = quant.forward_full(ids)
    want = dense.forward_full(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
