"""Shared fixtures of the V4.1 tests: a tiny V4.1 config (structure of spec §1.6/§1.7)."""

from __future__ import annotations

import pytest

from dsv4.config import ModelConfig
from dsv4.model.engram import engram_primes

ENGRAM_LAYERS = (1, 3)
ENGRAM_NGRAM, ENGRAM_HEADS, ENGRAM_VOCAB = 3, 2, 1000


QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
         "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


def tiny_v41_dict(quantized: bool = True, **text_changes: object) -> dict:
    """An official-layout V4.1 config.json of 6 layers: SWA, SWA+Engram, r=2 source, r=2 reuse
    (+Engram), r=1 source (candidates), r=1 reindex."""
    rows = [sum(sum(h) for h in layer) for layer in
            engram_primes(ENGRAM_LAYERS, ENGRAM_NGRAM, ENGRAM_HEADS, ENGRAM_VOCAB)]
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": 96, "hidden_size": 64,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2,
        "o_lora_rank": 16, "moe_intermediate_size": 32, "n_routed_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "norm_topk_prob": True, "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20, "sliding_window": 8, "compress_ratios": [0, 0, 2, 2, 1, 1],
        "kv_source_layer_ids": [2, 4], "index_source_layer_ids": [2, 4, 5],
        "index_n_heads": 4, "index_head_dim": 16, "index_topk": 4,
        "candidate_source_layer_id": 4, "candidate_topk_blocks": 2, "candidate_block_size": 2,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": list(ENGRAM_LAYERS), "engram_num_embeddings": rows,
        "engram_max_ngram_size": ENGRAM_NGRAM, "engram_n_heads": ENGRAM_HEADS,
        "engram_head_dim": 32, "engram_vocab_size": ENGRAM_VOCAB, "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 40, "num_nextn_predict_layers": 0,
    }
    text.update(text_changes)
    top = {"model_type": "deepseek_v41", "bos_token_id": 0, "eos_token_id": 1,
           "pad_token_id": 2, "image_token_id": 95, "text_config": text}
    if quantized:
        top["quantization_config"] = dict(QUANT)
    return top


@pytest.fixture
def tiny_v41_cfg() -> ModelConfig:
    """Quantized (FP8 block 32, e4m3 Engram tables), like the release."""
    return ModelConfig.from_dict(tiny_v41_dict())


@pytest.fixture
def tiny_v41_bf16_cfg() -> ModelConfig:
    """An unquantized (bf16) checkpoint's config: dense Engram tables."""
    return ModelConfig.from_dict(tiny_v41_dict(quantized=False))
