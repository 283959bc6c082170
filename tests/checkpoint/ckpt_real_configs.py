"""Official HF config.json contents of the real checkpoints, from the values in spec §1."""

from __future__ import annotations

import copy

_YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
         "beta_fast": 32, "beta_slow": 1}

V4_FLASH: dict = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": _YARN, "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "expert_dtype": "fp4", "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}


def v4_flash_base() -> dict:
    """Flash-Base: FP8 experts and float32 scales (spec §1.3; exact config unpublished)."""
    c = copy.deepcopy(V4_FLASH)
    c["expert_dtype"] = "fp8"
    return c


def v4_pro() -> dict:
    c = copy.deepcopy(V4_FLASH)
    c.update(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
             o_groups=16, o_lora_rank=1024, moe_intermediate_size=3072, n_routed_experts=384,
             routed_scaling_factor=2.5, index_topk=1024,
             compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0])
    return c


V41_FLASH: dict = {
    "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
    "dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    "image_token_id": 129264,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                            "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                            "expert_dtype": "fp4"},
    "text_config": {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120,
        "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 1,
        "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8,
        "o_lora_rank": 1024, "moe_intermediate_size": 2304, "n_routed_experts": 384,
        "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "max_position_embeddings": 1048576,
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048,
        "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_vocab_size": 16000000, "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3,
        "dspark_block_size": 5, "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
    },
}
