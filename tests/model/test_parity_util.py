"""Helpers shared by the model tests (small ModelConfigs, the matching transformers config),
plus tests of those helpers themselves."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4.config import ModelConfig


def small_config_dict(**overrides: Any) -> dict:
    """A tiny, unquantized V4 ``config.json`` content (HF keys)."""
    d = dict(
        model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"],
        vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8, q_lora_rank=16, o_groups=2,
        o_lora_rank=8, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, num_hash_layers=1, scoring_func="sqrtsoftplus",
        norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0, sliding_window=8,
        index_n_heads=4, index_head_dim=16, index_topk=4, hc_mult=4, hc_sinkhorn_iters=20,
        hc_eps=1e-6, rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=65536,
                          beta_fast=32, beta_slow=1),
        compress_ratios=[0, 4, 128], num_nextn_predict_layers=0, max_position_embeddings=4096,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )
    d.update(overrides)
    return d


def small_config(**overrides: Any) -> ModelConfig:
    return ModelConfig.from_dict(small_config_dict(**overrides))


def hf_config(cfg: ModelConfig) -> Any:
    """The transformers ``DeepseekV4Config`` of our ModelConfig (eager attention and experts).

    Built from the ModelConfig fields rather than from config.json so that keys transformers
    reads under other names (layer_types, mlp_layer_types, rope_parameters) are explicit.
    """
    from transformers import DeepseekV4Config

    n = cfg.n_layers
    rope_scaling = None
    if cfg.original_seq_len > 0:
        rope_scaling = dict(type="yarn", factor=cfg.rope_factor,
                            original_max_position_embeddings=cfg.original_seq_len,
                            beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow)
    c = DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.moe_inter_dim,
        num_hidden_layers=n, num_attention_heads=cfg.n_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, qk_rope_head_dim=cfg.rope_head_dim, q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        n_routed_experts=cfg.n_routed_experts, n_shared_experts=cfg.n_shared_experts,
        num_experts_per_tok=cfg.n_activated_experts, num_hash_layers=cfg.n_hash_layers,
        scoring_func=cfg.score_func, norm_topk_prob=True, routed_scaling_factor=cfg.route_scale,
        swiglu_limit=cfg.swiglu_limit, sliding_window=cfg.window_size,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
        hc_eps=cfg.hc_eps, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta, rope_scaling=rope_scaling,
        compress_ratios=list(cfg.compress_ratios[:n]),
        num_nextn_predict_layers=cfg.n_mtp_layers,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, tie_word_embeddings=False,
    )
    c._attn_implementation = "eager"
    c._experts_implementation = "eager"
    return c


def hf_modeling() -> Any:
    """The transformers DeepSeek-V4 modeling module, or skip when this transformers lacks it."""
    return pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


# ------------------------------------------------------------------------------------ tests
def test_hf_config_follows_our_schedule() -> None:
    hf_modeling()
    cfg = small_config()
    c = hf_config(cfg)
    assert c.layer_types == ["sliding_attention", "compressed_sparse_attention",
                             "heavily_compressed_attention"]
    assert c.mlp_layer_types == ["hash_moe", "moe", "moe"]
    assert c.qk_rope_head_dim == cfg.rope_head_dim
    assert c.rope_parameters["main"]["rope_theta"] == cfg.rope_theta
    assert c.rope_parameters["compress"]["rope_type"] == "yarn"
    assert c.rope_parameters["compress"]["attention_factor"] == 1.0


def test_hf_rope_tables_match_ours() -> None:
    """Both RoPE families (plain θ and compress θ + YaRN) give the same angles as ours."""
    mod = hf_modeling()
    from dsv4.model.layers import rope_cos_sin

    cfg = small_config()
    rot = mod.DeepseekV4RotaryEmbedding(hf_config(cfg))
    pos = torch.arange(0, 300, 7)
    for layer, label in ((0, "main"), (1, "compress"), (2, "compress")):
        cos_hf, sin_hf = rot(torch.zeros(1, dtype=torch.float32), pos[None], layer_type=label)
        cos, sin = rope_cos_sin(cfg, layer, pos)
        torch.testing.assert_close(cos, cos_hf[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, sin_hf[0], rtol=0, atol=1e-6)
