"""expected_tensors against the real configs' tensor lists (spec §2.2, §2.3)."""

from __future__ import annotations

import torch
from ckpt_real_configs import V4_FLASH, V41_FLASH, v4_flash_base, v4_pro

from dsv4.checkpoint import checkpoint_entries, expected_tensors, is_ignored_tensor
from dsv4.config import ModelConfig

E8M0, F32 = torch.float8_e8m0fnu, torch.float32


def _specs(cfg_dict: dict):
    cfg = ModelConfig.from_dict(cfg_dict)
    return cfg, expected_tensors(cfg)


def test_v4_flash_layout() -> None:
    cfg, specs = _specs(V4_FLASH)
    entries = checkpoint_entries(specs)
    mtp = [n for n in entries if n.startswith("mtp.")]
    assert len(mtp) == 1575  # spec §2.2: 39 non-expert + 256 × 6 expert tensors
    assert len([n for n in mtp if ".experts." not in n]) == 39
    s = specs["layers.0.attn.wq_a.weight"]
    assert (s.fmt, s.shape, s.scale_shape, s.scale_dtype) == ("fp8", (1024, 4096), (8, 32), E8M0)
    assert specs["layers.5.attn.wq_b.weight"].scale_shape == (256, 8)
    wo_a = specs["layers.5.attn.wo_a.weight"]
    assert wo_a.shape == (8192, 4096) and wo_a.scale_shape == (64, 32)
    assert specs["layers.5.attn.wo_b.weight"].scale_shape == (32, 64)
    w1 = specs["layers.7.ffn.experts.255.w1.weight"]
    assert (w1.fmt, w1.dtype, w1.stored_shape, w1.scale_shape) == (
        "fp4", torch.int8, (2048, 2048), (2048, 128))
    w2 = specs["layers.7.ffn.experts.0.w2.weight"]
    assert (w2.stored_shape, w2.scale_shape) == ((4096, 1024), (4096, 64))
    assert specs["layers.7.ffn.shared_experts.w2.weight"].scale_shape == (32, 16)
    # hash layers 0..2 have tid2eid and no bias; the others the reverse
    for layer in range(43):
        has_hash = f"layers.{layer}.ffn.gate.tid2eid" in specs
        assert has_hash == (layer < 3)
        assert (f"layers.{layer}.ffn.gate.bias" in specs) == (layer >= 3)
    assert specs["layers.0.ffn.gate.tid2eid"].shape == (129280, 6)
    assert specs["mtp.0.ffn.gate.bias"].fmt == "f32"
    # CSA (even 2..42): overlapping compressor + indexer; HCA (odd 3..41): plain compressor
    assert specs["layers.2.attn.compressor.wkv.weight"].shape == (1024, 4096)
    assert specs["layers.2.attn.compressor.ape"].shape == (4, 1024)
    assert specs["layers.3.attn.compressor.wgate.weight"].shape == (512, 4096)
    assert specs["layers.3.attn.compressor.ape"].shape == (128, 512)
    assert specs["layers.2.attn.indexer.compressor.wkv.weight"].shape == (256, 4096)
    assert specs["layers.2.attn.indexer.compressor.ape"].shape == (4, 256)
    assert specs["layers.2.attn.indexer.wq_b.weight"].scale_shape == (64, 8)
    assert "layers.3.attn.indexer.wq_b.weight" not in specs
    assert "layers.1.attn.compressor.wkv.weight" not in specs
    count = lambda suffix: sum(n.endswith(suffix) for n in specs)  # noqa: E731
    assert count("attn.compressor.wkv.weight") == 41
    assert count("attn.indexer.wq_b.weight") == 21
    assert specs["hc_head_fn"].shape == (4, 16384) and specs["mtp.0.hc_head_fn"].fmt == "f32"
    assert specs["layers.0.hc_attn_fn"].shape == (24, 16384)
    assert specs["mtp.0.e_proj.weight"].fmt == "fp8"
    # f32 / i64 tensors carry no scale
    assert all(s.scale_shape is None for s in specs.values() if s.fmt in ("f32", "i64", "bf16"))


def test_v4_flash_base_uses_fp8_experts_and_fp32_scales() -> None:
    cfg, specs = _specs(v4_flash_base())
    assert cfg.scale_dtype == "fp32" and cfg.expert_dtype == "fp8"
    e = specs["layers.4.ffn.experts.3.w2.weight"]
    assert (e.fmt, e.dtype, e.stored_shape, e.scale_shape, e.scale_dtype) == (
        "fp8", torch.float8_e4m3fn, (4096, 2048), (32, 16), F32)
    assert specs["layers.4.attn.wq_a.weight"].scale_dtype == F32


def test_v4_pro_layout() -> None:
    cfg, specs = _specs(v4_pro())
    entries = checkpoint_entries(specs)
    assert sum(n.startswith("mtp.") for n in entries) == 39 + 384 * 6
    # layers 0-1 are HCA: plain compressor, no indexer; layer 60 is CSA
    assert specs["layers.0.attn.compressor.wkv.weight"].shape == (512, 7168)
    assert "layers.0.attn.indexer.wq_b.weight" not in specs
    assert specs["layers.60.attn.indexer.wq_b.weight"].shape == (8192, 1536)
    assert specs["layers.10.attn.wo_a.weight"].shape == (16 * 1024, 128 * 512 // 16)


def test_v41_layout_and_counts() -> None:
    cfg, specs = _specs(V41_FLASH)
    entries = checkpoint_entries(specs)
    count = lambda suffix: sum(n.endswith(suffix) for n in entries)  # noqa: E731
    assert count("attn.compressor.wkv.weight") == 4
    assert count("attn.compressor.wgate.weight") == 3
    assert count("attn.indexer.wq_b.weight") == 8
    assert count("attn.indexer.wk.weight") == 4
    # The release holds 96,085 tensors including the vision tower (spec §1.6, §2.3): 32 blocks
    # × 8 (norm1, norm2, wqkv w+b, wo w+b, mlp w1, w2) + patch_embed w+b + norm + aligner 2×(w+b)
    # + image_start/end/newline = 266.
    vision = 32 * 8 + 2 + 1 + 4 + 3
    assert len(entries) + vision == 96085
    assert not any("hc_head" in n for n in entries)
    s = specs["layers.0.attn.wq_a.weight"]
    assert (s.shape, s.scale_shape, s.block) == ((1280, 5120), (40, 160), 32)
    assert specs["layers.0.attn.wq_b.weight"].scale_shape == (1024, 40)
    assert specs["layers.0.attn.wo_a.weight"].scale_shape == (256, 128)
    assert specs["layers.0.attn.wo_b.weight"].scale_shape == (160, 256)
    e1 = specs["layers.9.ffn.experts.383.w1.weight"]
    assert (e1.stored_shape, e1.scale_shape) == ((2304, 2560), (2304, 160))
    e2 = specs["layers.9.ffn.experts.0.w2.weight"]
    assert (e2.stored_shape, e2.scale_shape) == ((5120, 1152), (5120, 72))
    assert specs["layers.9.ffn.shared_experts.w1.weight"].scale_shape == (72, 160)
    assert specs["layers.9.ffn.gate.bias_vl"].shape == (384,)
    assert "layers.9.ffn.gate.tid2eid" not in specs
    emb = specs["layers.14.engram.embed.weight"]
    assert (emb.fmt, emb.dtype, emb.shape, emb.scale_shape, emb.scale_dtype) == (
        "mxfp8", torch.float8_e4m3fn, (384016682, 256), (384016682, 8), E8M0)
    assert specs["layers.1.engram.embed.weight"].shape == (384006168, 256)
    ewkv = specs["layers.1.engram.wkv.weight"]
    assert (ewkv.shape, ewkv.scale_shape) == ((25600, 6144), (800, 192))
    assert specs["layers.1.engram.q_weight"].shape == (4, 5120)
    assert not any(".engram." in n for n in specs if not n.startswith(("layers.1.", "layers.14.")))
    assert specs["layers.20.attn.indexer.wq_b.weight"].scale_shape == (128, 40)
    assert specs["layers.20.attn.indexer.wk.weight"].shape == (128, 512)
    assert "layers.20.attn.compressor.wgate.weight" not in specs  # ratio 1: no gate
    assert "layers.24.attn.indexer.wk.weight" not in specs  # reindex: no keys of its own
    assert "layers.21.attn.indexer.wq_b.weight" not in specs  # reuse
    # DSpark stages: 128 experts, main_proj on stage 0, heads on the last stage only
    assert specs["mtp.1.ffn.gate.weight"].shape == (128, 5120)
    assert "mtp.0.ffn.experts.127.w1.weight" in specs
    assert "mtp.0.ffn.experts.128.w1.weight" not in specs
    mp = specs["mtp.0.main_proj.weight"]
    assert (mp.shape, mp.scale_shape) == ((5120, 15360), (160, 480))
    assert "mtp.1.main_proj.weight" not in specs and "mtp.0.markov_head.head.weight" not in specs
    assert specs["mtp.2.markov_head.embed.weight"].shape == (129280, 256)
    assert specs["mtp.2.confidence_head.proj.weight"].shape == (1, 5376)
    assert "mtp.2.norm.weight" in specs and "mtp.1.norm.weight" not in specs
    assert is_ignored_tensor("vision.blocks.0.attn.wqkv.weight", cfg)
    assert is_ignored_tensor("image_newline", cfg)


def test_bf16_checkpoint_has_no_scales() -> None:
    d = dict(V4_FLASH)
    del d["quantization_config"]
    del d["expert_dtype"]
    cfg, specs = _specs(d)
    assert not cfg.quantized
    assert all(s.scale_shape is None for s in specs.values())
    assert specs["layers.3.ffn.experts.0.w1.weight"].fmt == "bf16"
    assert specs["layers.3.ffn.experts.0.w1.weight"].stored_shape == (2048, 4096)
    assert specs["layers.3.attn.attn_sink"].fmt == "f32"
    assert not is_ignored_tensor("vision.norm.weight", cfg)  # V4 has no vision tower
