"""Parity with transformers on FP8 checkpoints, through a dequantizer independent of dsv4.

transformers' own FP8 loader needs ``accelerate`` and a GPU, so the test carries a small
dequantizer written from spec §2.4 (bit-level decoding of e4m3 / e8m0 / e2m1; it imports
nothing from ``dsv4.formats`` or ``dsv4.checkpoint``). It turns the quantized checkpoint into
a plain one (official names, dense float32 weights, config without ``quantization_config``)
that transformers loads; ours loads the quantized checkpoint itself. Two formats, one per V4
layout so that both layouts also meet each format:

* ``v4``      (Flash layout ``[0, 4, 128, 4, 128]``): FP8 e4m3 + e8m0 block scales, MXFP4 experts;
* ``v4-base`` (Pro layout ``[128, 128, 4, 128, 4]``): FP8 e4m3 + float32 block scales, FP8 experts.

In numerics="bf16" (no run-time activation quantization) the logits agree to fp32 rounding and
the argmax is identical everywhere. Incremental runs (chunked prefill at odd split points, then
decode steps) equal the full forward exactly in "bf16" numerics and statistically in "official"
numerics, where fake quantization makes the model discontinuous (spec §6.13).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from dsv4.cache.tensors import HybridCache
from dsv4.model.context import StepContext, pages_needed
from dsv4.model.transformer import Transformer, load_model
from test_parity_util import hf_modeling

ATOL = 1e-4  # logits have std ≈ 1; fp32 rounding differences are ~1e-5
FORMATS = {"v4": [0, 4, 128, 4, 128, 0], "v4-base": [128, 128, 4, 128, 4, 0]}
SEQ_LEN = 257  # crosses the window (8), ratio-4 groups and both ratio-128 group ends


# ------------------------------------------------------------- the dequantizer (spec §2.4)
def decode_e4m3fn(raw: Tensor) -> Tensor:
    """float8_e4m3fn bytes -> float32: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 is subnormal (m·2^-9); S.1111.111 is NaN; there is no infinity."""
    b = raw.view(torch.uint8).to(torch.int32)
    sign = torch.where(b >= 128, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).to(torch.float32)
    normal = (1.0 + man / 8.0) * torch.pow(2.0, (exp - 7).to(torch.float32))
    value = sign * torch.where(exp == 0, man * 2.0 ** -9, normal)
    return torch.where((exp == 15) & ((b & 0x7) == 7), float("nan"), value)


def decode_e8m0(raw: Tensor) -> Tensor:
    """E8M0 scale bytes -> float32: byte b is 2^(b − 127); 255 is NaN."""
    b = raw.view(torch.uint8).to(torch.int32)
    return torch.where(b == 255, float("nan"), torch.pow(2.0, (b - 127).to(torch.float32)))


E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def decode_scale(scale: Tensor) -> Tensor:
    if scale.dtype == torch.float32:  # *-Base block scales are stored as plain float32
        return scale
    if scale.dtype == torch.float8_e8m0fnu:
        return decode_e8m0(scale)
    raise ValueError(f"unexpected scale dtype {scale.dtype}")


def dequantize(weight: Tensor, scale: Tensor, block: int) -> Tensor:
    """One quantized weight and its ``.scale`` -> dense float32 [N, K] (spec §2.4)."""
    s = decode_scale(scale)
    if weight.dtype == torch.float8_e4m3fn:  # FP8 block: W[n,k] = w8[n,k] · s[n//B, k//B]
        n, k = weight.shape
        rows = torch.arange(n) // block
        cols = torch.arange(k) // block
        return decode_e4m3fn(weight) * s[rows[:, None], cols[None, :]]
    if weight.dtype == torch.int8:  # MXFP4: byte j holds k=2j (low nibble), k=2j+1 (high)
        b = weight.view(torch.uint8).to(torch.int64)
        codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)       # [N, K]
        k = codes.shape[1]
        return E2M1[codes] * s[:, torch.arange(k) // 32]
    raise ValueError(f"unexpected quantized weight dtype {weight.dtype}")


def read_dequantized(path: str) -> dict[str, Tensor]:
    """Every tensor of the checkpoint at ``path``: quantized weights dense float32, ``.scale``
    entries folded in, everything else as stored."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        block = json.load(f)["quantization_config"]["weight_block_size"][0]
    raw: dict[str, Tensor] = {}
    for fname in sorted(os.listdir(path)):
        if fname.endswith(".safetensors"):
            raw.update(load_file(os.path.join(path, fname)))
    out = {}
    for name, t in raw.items():
        if name.endswith(".scale"):
            continue
        scale_name = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
        out[name] = dequantize(t, raw[scale_name], block) if scale_name in raw else t
    return out


def write_plain_checkpoint(src: str, dst: str) -> str:
    """The dequantized twin of checkpoint ``src``: one model.safetensors + a config.json
    without quantization settings."""
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in read_dequantized(src).items()}
    save_file(tensors, os.path.join(dst, "model.safetensors"), {"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    cfg.pop("expert_dtype", None)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_decoders_follow_the_formats() -> None:
    """The bit decoders agree with torch's own float8 casts on every code, and the e2m1 table
    and nibble order with two hand-made bytes."""
    codes = torch.arange(256, dtype=torch.uint8)
    ours = decode_e4m3fn(codes)
    torch_value = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(torch_value))
    assert torch.equal(ours.nan_to_num(0.0), torch_value.nan_to_num(0.0))
    assert float(ours.nan_to_num(0).abs().max()) == 448.0
    finite = codes[:255]
    assert torch.equal(decode_e8m0(finite), finite.view(torch.float8_e8m0fnu).float())
    packed = torch.tensor([[0x3A, 0x0F]], dtype=torch.uint8).view(torch.int8)  # k0=A,k1=3,...
    one = torch.tensor([[127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)   # scale 2^0
    assert dequantize(packed, one, 128).tolist() == [[-1.0, 1.5, -6.0, 0.0]]


# ------------------------------------------------------------------------------- fixtures
@dataclass
class Quantized:
    path: str              # the quantized checkpoint
    ours: Transformer      # loaded from it, numerics "bf16", float32
    official: Transformer  # loaded from it, numerics "official", float32
    theirs: Any            # transformers on its independently dequantized twin
    ids: Tensor            # [SEQ_LEN]
    ref: Tensor            # transformers' logits of ids


@pytest.fixture(scope="module", params=sorted(FORMATS))
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Quantized:
    hf_modeling()
    from transformers import DeepseekV4ForCausalLM

    from dsv4.tiny import make_tiny_checkpoint

    variant = request.param
    root = tmp_path_factory.mktemp(f"fp8_{variant}")
    path = make_tiny_checkpoint(root / "quantized", variant=variant, seed=5,
                                compress_ratios=FORMATS[variant])
    plain = write_plain_checkpoint(path, os.fspath(root / "plain"))
    theirs, info = DeepseekV4ForCausalLM.from_pretrained(
        plain, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert getattr(theirs.config, "quantization_config", None) is None
    ours = load_model(path, device="cpu", dtype=torch.float32, numerics="bf16")
    assert ours.cfg.quantized
    ids = torch.randint(2, ours.cfg.vocab_size, (SEQ_LEN,),
                        generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        ref = theirs.eval()(ids[None], use_cache=False).logits[0]
    assert ref.std() > 0.5
    official = load_model(path, device="cpu", dtype=torch.float32, numerics="official")
    return Quantized(path, ours, official, theirs, ids, ref)


# ---------------------------------------------------------------------------------- tests
def test_checkpoint_really_is_quantized(quantized: Quantized) -> None:
    """The formats under test are in the file (not silently plain)."""
    from safetensors import safe_open

    dtypes: dict[str, str] = {}  # safetensors dtype names
    for fname in os.listdir(quantized.path):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(quantized.path, fname), "pt") as f:
                dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    expert = dtypes["layers.1.ffn.experts.0.w1.weight"]
    base = quantized.ours.cfg.expert_dtype == "fp8"
    assert dtypes["layers.1.attn.wq_b.weight"] == "F8_E4M3"
    assert dtypes["layers.1.attn.wq_b.scale"] == ("F32" if base else "F8_E8M0")
    assert expert == ("F8_E4M3" if base else "I8")


def test_project_weights_equal_the_spec_dequantization(quantized: Quantized) -> None:
    """dsv4's loader and the dequantizer above give bit-identical dense weights."""
    from dsv4.checkpoint import load_checkpoint

    mine = read_dequantized(quantized.path)
    theirs = load_checkpoint(quantized.path, dtype=torch.float32, progress=False)
    assert set(theirs) == set(mine)
    for name, value in theirs.items():
        assert torch.equal(value, mine[name].to(value.dtype)), name


# Odd prefill splits, then decode steps across the ratio-128 group ends (127, 255) and 256.
SPLITS = (3, 10, 65, 126, 127, 128, 129, 200, 254, 255, 256, 257)


def _incremental(model: Transformer, ids: Tensor) -> Tensor:
    cache = HybridCache.allocate(model.cfg, num_pages=pages_needed(ids.numel(), 256),
                                 num_slots=1, page_size=256, dtype=model.dtype, device="cpu")
    rows, start = [], 0
    for end in SPLITS:
        ctx = StepContext.single(ids[start:end], start_pos=start, all_logits=True)
        rows.append(model.compute_logits(model.forward(ctx, cache)))
        start = end
    return torch.cat(rows)


def _assert_same_logits(logits: Tensor, ref: Tensor) -> None:
    assert logits.shape == ref.shape and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, rtol=0, atol=ATOL)
    same = logits.argmax(-1) == ref.argmax(-1)
    assert bool(same.all()), f"argmax differs at positions {torch.nonzero(~same).flatten()}"


@pytest.mark.parametrize("length", [1, 9, SEQ_LEN])
def test_logits_match_transformers(quantized: Quantized, length: int) -> None:
    _assert_same_logits(quantized.ours.forward_full(quantized.ids[:length]),
                        quantized.ref[:length])


def test_incremental_equals_full_forward_in_bf16_numerics(quantized: Quantized) -> None:
    """Chunked prefill + decode on one cache: the full forward's logits, hence transformers'."""
    assert SPLITS[-1] == SEQ_LEN
    _assert_same_logits(_incremental(quantized.ours, quantized.ids), quantized.ref)


def test_incremental_equals_full_forward_in_official_numerics(quantized: Quantized) -> None:
    """With run-time fake quantization an ulp-level difference between the two cache paths
    (GEMM shapes, softmax order) can cross an FP8/FP4 rounding boundary and spread to later
    positions (spec §6.13; DeepSeek's reference disagrees with itself by up to ~3 logits). So
    judge six prompts together: the bulk barely moves, argmaxes almost all agree, and the
    worst row stays bounded.  How far the flips spread depends on the CPU's GEMM code paths:
    pooled over 3 prompts, 40 draws on one machine gave ≥ 96% equal argmaxes and medians
    ≤ 0.004; on an AVX-512 machine (2026-12-01) 24 draws per format gave 86–99% and medians up
    to 0.068 (pooled over 6: ≥ 89.6%), max 2.5 — the bounds below hold on both.  The exact
    check of the incremental path is the bf16-numerics test above."""
    model = quantized.official
    same, diffs = [], []
    for seed in (21, 22, 23, 24, 25, 26):
        ids = torch.randint(2, model.cfg.vocab_size, (SEQ_LEN,),
                            generator=torch.Generator().manual_seed(seed))
        full = model.forward_full(ids)
        inc = _incremental(model, ids)
        same.append(inc.argmax(-1) == full.argmax(-1))
        diffs.append((inc - full).abs())
    diff = torch.cat(diffs)
    agree = torch.cat(same).float().mean()
    assert agree >= 0.85, agree
    assert diff.median() < 0.1, diff.median()
    assert diff.max() < 3.0, diff.max()


def test_official_numerics_is_active(quantized: Quantized) -> None:
    """The statistical test above compares something that fake quantization really changes."""
    official = quantized.official.forward_full(quantized.ids[:40])
    plain = quantized.ours.forward_full(quantized.ids[:40])
    assert (official - plain).abs().median() > 1e-3
