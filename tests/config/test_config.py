"""ModelConfig: official configs parse, derived schedules, clear validation errors."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from dsv4.config import ModelConfig

# One source for the official configs: tests/checkpoint/ckpt_real_configs.py (not a package,
# so it is loaded by path).
_REAL_CONFIGS_PATH = Path(__file__).resolve().parents[1] / "checkpoint" / "ckpt_real_configs.py"


def _real_configs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ckpt_real_configs_config", _REAL_CONFIGS_PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_REAL = _real_configs()
FLASH = _REAL.V4_FLASH
V41 = {**_REAL.V41_FLASH, "vision_config": {"model_type": "deepseek_v41_vision"}}


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
