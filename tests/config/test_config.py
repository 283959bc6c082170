"""ModelConfig: official configs parse, derived schedules, clear validation errors."""

from __future__ import annotations

import copy
import json

import pytest

from dsv4.config import ModelConfig

FLASH = {
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
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "expert_dtype": "fp4", "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}

V41_TEXT = {
    "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120,
    "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8,
    "o_lora_rank": 1024, "moe_intermediate_size": 2304, "n_routed_experts": 384,
    "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
    "max_position_embeddings": 1048576, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
    "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_n_heads": 8, "engram_head_dim": 256, "engram_vocab_size": 16000000,
    "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
}
V41 = {
    "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
    "dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    "image_token_id": 129264,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                            "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                            "expert_dtype": "fp4"},
    "text_config": V41_TEXT, "vision_config": {"model_type": "deepseek_v41_vision"},
}


def test_flash_parses_and_schedules():
    cfg = ModelConfig.from_dict(FLASH)
    assert cfg.variant == "v4" and cfg.dim == 4096 and cfg.n_layers == 43
    assert cfg.weight_block_size == 128 and cfg.scale_dtype == "e8m0" and cfg.expert_dtype == "fp4"
    assert cfg.original_seq_len == 65536 and cfg.rope_factor == 16
    assert [cfg.attn_mode(i) for i in range(5)] == ["swa", "swa", "csa", "hca", "csa"]
    assert cfg.attn_mode(42) == "csa" and cfg.ratio(43) == 0
    assert cfg.is_hash_layer(2) and not cfg.is_hash_layer(3)
    assert cfg.all_ratios == (4, 128)


def test_flash_base_has_fp32_scales():
    d = copy.deepcopy(FLASH)
    d["expert_dtype"] = "fp8"
    cfg = ModelConfig.from_dict(d)
    assert cfg.expert_dtype == "fp8" and cfg.scale_dtype == "fp32"


def test_v41_parses_roles():
    cfg = ModelConfig.from_dict(V41)
    assert cfg.variant == "v41" and cfg.dim == 5120 and cfg.weight_block_size == 32
    assert cfg.norm_eps == 1e-20 and cfg.image_token_id == 129264 and cfg.n_mtp_layers == 3
    modes = {i: cfg.attn_mode(i) for i in (0, 1, 2, 3, 8, 19, 20, 21, 24, 25, 36, 39)}
    assert modes == {0: "swa", 1: "swa", 2: "full", 3: "reuse", 8: "full", 19: "reuse",
                     20: "full", 21: "reuse", 24: "reindex", 25: "reuse", 36: "reindex",
                     39: "reuse"}
    assert cfg.kv_source_of(27) == 20 and cfg.index_source_of(27) == 24
    assert cfg.kv_source_of(13) == 8 and cfg.index_source_of(13) == 8
    assert cfg.uses_candidates(24) and not cfg.uses_candidates(20) and not cfg.uses_candidates(8)
    assert cfg.compressor_ratio(2) == 2 and cfg.compressor_ratio(20) == 1
    assert cfg.compressor_ratio(21) == 0
    assert cfg.dspark_n_activated_experts == 3 and cfg.engram_pad_id == 2


def test_from_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FLASH))
    assert ModelConfig.from_file(tmp_path).n_layers == 43
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(FileNotFoundError):
        ModelConfig.from_file(tmp_path / "nowhere")


@pytest.mark.parametrize("patch, match", [
    ({"model_type": "llama"}, r"model_type='llama'.*allowed"),
    ({"compress_ratios": [0, 4]}, r"compress_ratios has 2 entries; expected .* 44"),
    ({"compress_ratios": [0, 0] + [4, 64] * 20 + [4, 0]}, r"compress_ratios\[3\]=64"),
    ({"o_groups": 7}, r"o_groups=7.*divisor of num_attention_heads=64"),
    ({"qk_rope_head_dim": 63}, r"qk_rope_head_dim=63"),
    ({"scoring_func": "softmax"}, r"scoring_func='softmax'"),
    ({"expert_dtype": "int4"}, r"expert_dtype='int4'"),
    ({"num_hash_layers": 99}, r"num_hash_layers=99"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
     r"weight_block_size=\[64, 64\]"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, r"rope_scaling.type='linear'"),
])
def test_v4_validation_errors(patch, match):
    d = copy.deepcopy(FLASH)
    d.update(patch)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(d)


def test_missing_key_is_named():
    d = copy.deepcopy(FLASH)
    del d["head_dim"]
    with pytest.raises(ValueError, match="missing required key 'head_dim'"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("patch, match", [
    ({"compress_ratios": [0, 0] + [4] * 18 + [1] * 20 + [0, 0, 0]}, r"compress_ratios\[2\]=4"),
    ({"kv_source_layer_ids": [2, 8, 14]}, r"kv_source_layer_ids.*ratio 1 at or before layer 20"),
    ({"index_source_layer_ids": [8, 14, 20, 24]}, r"missing 2"),
    ({"kv_source_layer_ids": [1, 2, 8, 14, 20]}, r"layer 1 has ratio 0"),
    ({"candidate_source_layer_id": 24}, r"candidate_source_layer_id=24"),
    ({"engram_num_embeddings": [1]}, r"engram_num_embeddings"),
])
def test_v41_validation_errors(patch, match):
    d = copy.deepcopy(V41)
    d["text_config"].update(patch)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(d)
