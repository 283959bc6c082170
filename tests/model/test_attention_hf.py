"""One attention layer against transformers' ``DeepseekV4Attention`` (an independent
implementation) with the same weights, fp32, "bf16" numerics, full-sequence prefill."""

from __future__ import annotations

import pytest
import torch

from dsv4.config import ModelConfig
from test_attention_helpers import (LAYER_CSA, LAYER_HCA, LAYER_SWA, make_attention, new_cache,
                                    run_chunks)

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

# our name -> transformers' name (under self_attn.)
_NAMES = {
    "wq_a.weight": "q_a_proj.weight", "q_norm.weight": "q_a_norm.weight",
    "wq_b.weight": "q_b_proj.weight", "wkv.weight": "kv_proj.weight",
    "kv_norm.weight": "kv_norm.weight", "wo_a.weight": "o_a_proj.weight",
    "wo_b.weight": "o_b_proj.weight", "attn_sink": "sinks",
    "compressor.wkv.weight": "compressor.kv_proj.weight",
    "compressor.wgate.weight": "compressor.gate_proj.weight",
    "compressor.ape": "compressor.position_bias",
    "compressor.norm.weight": "compressor.kv_norm.weight",
    "indexer.wq_b.weight": "compressor.indexer.q_b_proj.weight",
    "indexer.weights_proj.weight": "compressor.indexer.scorer.weights_proj.weight",
    "indexer.compressor.wkv.weight": "compressor.indexer.kv_proj.weight",
    "indexer.compressor.wgate.weight": "compressor.indexer.gate_proj.weight",
    "indexer.compressor.ape": "compressor.indexer.position_bias",
    "indexer.compressor.norm.weight": "compressor.indexer.kv_norm.weight",
}


def _hf_config(cfg: ModelConfig):
    from transformers import DeepseekV4Config

    c = DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.moe_inter_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, qk_rope_head_dim=cfg.rope_head_dim, q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.n_activated_experts, sliding_window=cfg.window_size,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta,
        rope_scaling=dict(type="yarn", factor=cfg.rope_factor,
                          original_max_position_embeddings=cfg.original_seq_len,
                          beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow),
        compress_ratios=list(cfg.compress_ratios[:cfg.n_layers]), num_nextn_predict_layers=0,
        max_position_embeddings=cfg.max_position_embeddings)
    c._attn_implementation = "eager"
    return c


def _hf_forward(att, x: torch.Tensor) -> torch.Tensor:
    cfg = att.cfg
    hcfg = _hf_config(cfg)
    layer = hf.DeepseekV4Attention(hcfg, att.layer_id).float().eval()
    ours = dict(att.named_parameters())
    with torch.no_grad():
        theirs = dict(layer.named_parameters())
        assert set(theirs) == {_NAMES[n] for n in ours}
        for n, p in ours.items():
            theirs[_NAMES[n]].copy_(p)
    S = x.shape[0]
    pos = torch.arange(S)[None]
    rot = hf.DeepseekV4RotaryEmbedding(hcfg)
    emb = {k: rot(x[None], pos, layer_type=k) for k in ("main", "compress")}
    t, s = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (s <= t) & (t - s < cfg.window_size)
    mask = torch.zeros(1, 1, S, S).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        out, _ = layer(x[None], emb, pos, mask, cache=None)
    return out[0]


@pytest.mark.parametrize("layer", [LAYER_SWA, LAYER_CSA, LAYER_HCA])
def test_attention_layer_matches_transformers(layer: int) -> None:
    att = make_attention(layer, seed=40 + layer)
    x = torch.randn(270, att.cfg.dim, generator=torch.Generator().manual_seed(layer))
    ours = run_chunks(att, x, [270], new_cache(att))
    theirs = _hf_forward(att, x)
    assert ours.abs().mean() > 0.1
    torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-5)
