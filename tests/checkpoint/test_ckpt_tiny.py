"""Tiny checkpoint generator: configs, official file formats, determinism, weight scales."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from dsv4.checkpoint import load_checkpoint, read_safetensors_header
from dsv4.config import ModelConfig
from dsv4.formats import e8m0_to_float
from dsv4.model.engram import build_compressed_token_map, engram_primes
from dsv4.tiny import VARIANTS, make_tiny_checkpoint, tiny_config
from dsv4.tokenizer import IMAGE_TOKEN, build_tiny_tokenizer


def _headers(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(read_safetensors_header(str(f)))
    return out


def _digest(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_tiny_v4_config_values() -> None:
    d = tiny_config("v4")
    cfg = ModelConfig.from_dict(d)
    assert d["model_type"] == "deepseek_v4" and d["architectures"] == ["DeepseekV4ForCausalLM"]
    assert cfg.vocab_size == build_tiny_tokenizer().get_vocab_size()
    assert (cfg.dim, cfg.n_heads, cfg.head_dim, cfg.rope_head_dim) == (256, 4, 128, 64)
    assert cfg.compress_ratios == (0, 4, 128, 4, 128, 0) and cfg.n_mtp_layers == 1
    assert (cfg.index_n_heads, cfg.index_topk, cfg.window_size) == (32, 4, 8)
    assert (cfg.original_seq_len, cfg.rope_factor, cfg.n_hash_layers) == (64, 16.0, 1)
    assert cfg.quantized and cfg.scale_dtype == "e8m0" and cfg.expert_dtype == "fp4"
    assert cfg.weight_block_size == 128
    base = ModelConfig.from_dict(tiny_config("v4-base"))
    assert base.scale_dtype == "fp32" and base.expert_dtype == "fp8"
    bf16 = ModelConfig.from_dict(tiny_config("v4-bf16"))
    assert not bf16.quantized and "quantization_config" not in tiny_config("v4-bf16")


def test_tiny_v41_config_derived_engram_sizes() -> None:
    d = tiny_config("v41")
    cfg = ModelConfig.from_dict(d)
    assert d["model_type"] == "deepseek_v41" and d["text_config"]["model_type"] == \
        "deepseek_v41_text"
    assert cfg.weight_block_size == 32 and cfg.norm_eps == 1e-20
    assert cfg.compress_ratios == (0, 0, 2, 2, 1, 1, 1, 1, 0, 0)
    primes = engram_primes([1, 3], 4, 2, 1000)
    assert list(cfg.engram_num_embeddings) == [sum(map(sum, layer)) for layer in primes]
    tok = build_tiny_tokenizer()
    assert cfg.engram_compressed_vocab_size == build_compressed_token_map(tok)[1]
    assert cfg.image_token_id == tok.token_to_id(IMAGE_TOKEN)
    assert cfg.pad_token_id == 2
    assert [cfg.attn_mode(i) for i in range(8)] == ["swa", "swa", "full", "reuse", "full",
                                                    "reuse", "reindex", "reuse"]
    # overrides land in text_config and re-derive the engram sizes
    d3 = tiny_config("v41", engram_n_heads=3, image_token_id=5)
    assert d3["image_token_id"] == 5 and d3["text_config"]["engram_n_heads"] == 3
    rows = [sum(map(sum, layer)) for layer in engram_primes([1, 3], 4, 3, 1000)]
    assert d3["text_config"]["engram_num_embeddings"] == rows


def test_tiny_config_overrides_and_errors(tmp_path: Path) -> None:
    d = tiny_config("v4", num_hidden_layers=3, compress_ratios=[0, 4, 128, 0], swiglu_limit=None)
    assert d["num_hidden_layers"] == 3 and "swiglu_limit" not in d
    assert ModelConfig.from_dict(d).n_layers == 3
    with pytest.raises(ValueError, match="variant 'v5'"):
        tiny_config("v5")
    with pytest.raises(ValueError, match="compress_ratios"):
        make_tiny_checkpoint(tmp_path / "bad", "v4", compress_ratios=[0, 4])
    assert not (tmp_path / "bad").exists()  # the config is checked before anything is written


def test_determinism(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    a = tiny_dirs["v41"]  # seed 0, 3 shards
    b = Path(make_tiny_checkpoint(tmp_path / "b", "v41", seed=0, num_shards=3))
    c = Path(make_tiny_checkpoint(tmp_path / "c", "v41", seed=4, num_shards=3))
    assert _digest(a) == _digest(b)
    da, dc = _digest(a), _digest(c)
    assert da["config.json"] == dc["config.json"]
    for shard in ("model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"):
        assert da[shard] != dc[shard]


@pytest.mark.parametrize("variant", VARIANTS)
def test_files_are_in_the_official_formats(tiny_dirs: dict[str, Path], variant: str) -> None:
    path = tiny_dirs[variant]
    files = sorted(p.name for p in path.iterdir())
    assert files == ["config.json", "generation_config.json", "model-00001-of-00003.safetensors",
                     "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                     "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    h = _headers(path)
    assert set(index["weight_map"]) == set(h)
    assert index["metadata"]["total_size"] == sum(
        torch.Size(e.shape).numel() * {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2,
                                       "F32": 4, "I64": 8}[e.dtype] for e in h.values())
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 0 and gen["eos_token_id"] == 1
    if variant == "v4-bf16":
        assert not any(n.endswith(".scale") for n in h)
        assert h["layers.1.attn.wq_a.weight"].dtype == "BF16"
        return
    block = 32 if variant == "v41" else 128
    wq_b = h["layers.2.attn.wq_b.weight"]
    assert wq_b.dtype == "F8_E4M3" and wq_b.shape == (512, 128)
    assert h["layers.2.attn.wq_b.scale"].shape == (512 // block, 128 // block)
    scale_dt = "F32" if variant == "v4-base" else "F8_E8M0"
    assert h["layers.2.attn.wq_b.scale"].dtype == scale_dt
    e1, e1s = h["layers.2.ffn.experts.7.w1.weight"], h["layers.2.ffn.experts.7.w1.scale"]
    if variant == "v4-base":
        assert (e1.dtype, e1.shape, e1s.dtype, e1s.shape) == ("F8_E4M3", (128, 256), "F32",
                                                              (1, 2))
    else:
        assert (e1.dtype, e1.shape, e1s.dtype, e1s.shape) == ("I8", (128, 128), "F8_E8M0",
                                                              (128, 8))
    assert h["layers.0.hc_attn_fn"].dtype == "F32" and h["layers.0.attn_norm.weight"].dtype \
        == "BF16"
    if variant == "v41":
        assert h["layers.1.engram.embed.weight"].dtype == "F8_E4M3"
        assert h["layers.1.engram.embed.scale"].shape[1] == 1
        assert "mtp.1.markov_head.embed.weight" in h and "hc_head_fn" not in h
    else:
        assert h["layers.0.ffn.gate.tid2eid"].dtype == "I64" and "mtp.0.e_proj.scale" in h


def test_weight_scales_are_sane(tiny_dirs: dict[str, Path]) -> None:
    sd = load_checkpoint(tiny_dirs["v4"], dtype=torch.float32, keep_quantized=True, progress=False)
    # power-of-two e8m0 scales, and dequantized projections with std ≈ 1/sqrt(fan_in)
    wq_b = sd["layers.1.attn.wq_b.weight"]
    s = e8m0_to_float(wq_b.scale)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))
    for name, fan_in in (("layers.1.attn.wq_b.weight", 128), ("layers.1.attn.wkv.weight", 256),
                         ("layers.3.ffn.experts.5.w2.weight", 128), ("head.weight", 256)):
        w = sd[name] if isinstance(sd[name], torch.Tensor) else sd[name].dequantize(torch.float32)
        assert w.std().item() == pytest.approx(fan_in ** -0.5, rel=0.1), name
    norm = sd["layers.2.ffn_norm.weight"]
    assert abs(norm.mean().item() - 1) < 0.05 and norm.std().item() < 0.1
    assert sd["layers.2.attn.attn_sink"].std().item() == pytest.approx(1.0, rel=0.8)
    tid = sd["layers.0.ffn.gate.tid2eid"]
    assert tid.shape == (512, 2) and int(tid.min()) >= 0 and int(tid.max()) < 8
    assert bool((tid[:, 0] != tid[:, 1]).all())  # distinct experts per token


def test_transformers_reads_the_tiny_bf16_checkpoint(tiny_dirs: dict[str, Path]) -> None:
    """An independent implementation (transformers' DeepseekV4) finds every official name and
    produces finite logits of std ≈ 1 from the tiny weights."""
    tf = pytest.importorskip("transformers")
    if not hasattr(tf, "DeepseekV4ForCausalLM"):
        pytest.skip("transformers without DeepseekV4")
    path = tiny_dirs["v4-bf16"]
    model, info = tf.DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    assert 0.5 < logits.std().item() < 2.0
