"""Linear, RMSNorm, RoPE tables (spec §3.1–3.2) and the RoPE op."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.model.layers import (Linear, RMSNorm, rope_cos_sin, rope_inv_freq,
                               yarn_correction_range)
from dsv4.ops.torch_attn import apply_rope, rms_norm
from test_attention_helpers import tiny_config


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------ RoPE tables
def test_yarn_range_of_v4_flash_constants() -> None:
    assert yarn_correction_range(64, 160000.0, 65536, 32, 1) == (15, 25)


def test_yarn_frequencies_follow_the_formula() -> None:
    cfg = tiny_config()  # orig 64, factor 16: YaRN changes some but not all frequencies
    rd, base = cfg.rope_head_dim, cfg.compress_rope_theta
    low, high = yarn_correction_range(rd, base, cfg.original_seq_len, cfg.beta_fast,
                                      cfg.beta_slow)
    freq = rope_inv_freq(cfg, 1)
    n_changed = 0
    for i in range(rd // 2):
        plain = base ** (-2 * i / rd)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        want = plain / cfg.rope_factor * ramp + plain * (1 - ramp)
        assert math.isclose(freq[i].item(), want, rel_tol=1e-5)
        n_changed += not math.isclose(want, plain, rel_tol=1e-6)
    assert 0 < n_changed < rd // 2


def test_layer_choice_of_base_and_yarn() -> None:
    cfg = tiny_config()
    rd = cfg.rope_head_dim
    plain = torch.tensor([cfg.rope_theta ** (-2 * i / rd) for i in range(rd // 2)])
    torch.testing.assert_close(rope_inv_freq(cfg, 0), plain.float(), rtol=1e-6, atol=0)
    # ratio-4 and ratio-128 layers share the compress table
    assert torch.equal(rope_inv_freq(cfg, 1), rope_inv_freq(cfg, 2))
    assert not torch.allclose(rope_inv_freq(cfg, 1), rope_inv_freq(cfg, 0))


def test_rope_matches_complex_multiplication() -> None:
    cfg = tiny_config()
    pos = torch.tensor([0, 1, 5, 77, 1000, 4095])
    x = torch.randn(len(pos), 3, cfg.head_dim, generator=_gen(0))
    for layer in (0, 1):
        cos, sin = rope_cos_sin(cfg, layer, pos)
        assert cos.shape == (len(pos), cfg.rope_head_dim // 2) and cos.dtype == torch.float32
        y = apply_rope(x, cos, sin)
        freq = rope_inv_freq(cfg, layer)
        rd = cfg.rope_head_dim
        for t, p in enumerate(pos.tolist()):
            # the angle is one fp32 product (as in the reference table); the rest in float64
            angle = (torch.tensor(float(p)) * freq).double()
            rot = torch.exp(1j * angle)                                      # [rd/2]
            z = torch.view_as_complex(x[t, :, -rd:].double().reshape(3, rd // 2, 2).contiguous())
            want = torch.view_as_real(z * rot).reshape(3, rd)
            torch.testing.assert_close(y[t, :, -rd:].double(), want, rtol=0, atol=1e-5)
        assert torch.equal(y[..., :-rd], x[..., :-rd])     # nope channels untouched


def test_rope_inverse_undoes_rotation() -> None:
    cfg = tiny_config()
    pos = torch.arange(0, 300, 13)
    cos, sin = rope_cos_sin(cfg, 2, pos)
    x = torch.randn(len(pos), 4, cfg.head_dim, generator=_gen(1))
    back = apply_rope(apply_rope(x, cos, sin), cos, sin, inverse=True)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-5)
    assert not torch.allclose(apply_rope(x, cos, sin), x)


def test_rope_rejects_bad_shapes() -> None:
    cfg = tiny_config()
    cos, sin = rope_cos_sin(cfg, 0, torch.arange(4))
    with pytest.raises(ValueError, match="apply_rope"):
        apply_rope(torch.randn(3, 128), cos, sin)
    with pytest.raises(ValueError, match="positions"):
        rope_cos_sin(cfg, 0, torch.zeros(2, 2, dtype=torch.long))


# ------------------------------------------------------------------------------ RMSNorm
def test_rms_norm_formula_and_dtype() -> None:
    x = torch.randn(5, 64, generator=_gen(2)).bfloat16()
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    y = norm(x)
    assert y.dtype == torch.bfloat16 and norm.weight.dtype == torch.float32
    xf = x.float()
    want = norm.weight * xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y, want.bfloat16(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="last dim"):
        norm(torch.randn(2, 63))
    unweighted = rms_norm(xf, None, 1e-6)
    torch.testing.assert_close((unweighted ** 2).mean(-1), torch.ones(5), rtol=1e-4, atol=0)


# ------------------------------------------------------------------------------ Linear
def test_linear_dense_and_shape_errors() -> None:
    lin = Linear(16, 8, dtype=torch.float32)
    w = torch.randn(8, 16, generator=_gen(3))
    lin.load_weight(w)
    x = torch.randn(3, 16, generator=_gen(4))
    torch.testing.assert_close(lin(x), x @ w.T)
    with pytest.raises(ValueError, match=r"\(8, 16\)"):
        lin.load_weight(torch.randn(16, 8))
    with pytest.raises(ValueError, match="fmt"):
        Linear(16, 8, fmt="int4")
    with pytest.raises(ValueError, match="numerics"):
        Linear(16, 8, numerics="fp8")
    with pytest.raises(ValueError, match="QuantWeight"):
        lin.load_weight([[1.0]])


def test_linear_rows_do_not_depend_on_batch_size() -> None:
    """Decode (1 row) gives bit-identical rows to prefill (many rows) on CPU."""
    lin = Linear(256, 128, dtype=torch.float32)
    lin.load_weight(torch.randn(128, 256, generator=_gen(5)))
    x = torch.randn(40, 256, generator=_gen(6))
    full = lin(x)
    for i in (0, 7, 39):
        assert torch.equal(lin(x[i:i + 1]), full[i:i + 1])
        assert torch.equal(lin(x[i]), full[i])


def test_linear_loads_quantized_weight_and_fake_quantizes_input() -> None:
    formats = pytest.importorskip("dsv4.formats")
    w = torch.randn(256, 256, generator=_gen(7)) * 0.05
    w8, scale = formats.quant_fp8_block(w, 128, "e8m0")
    qw = formats.QuantWeight(w8, scale, "fp8", 128, (256, 256))
    x = torch.randn(4, 256, generator=_gen(8))
    plain = Linear(256, 256, fmt="fp8", numerics="bf16", dtype=torch.float32)
    plain.load_weight(qw)
    assert plain.qweight is qw
    dense = qw.dequantize(torch.float32)
    assert torch.equal(plain.weight, dense)
    torch.testing.assert_close(plain(x), x @ dense.T)
    official = Linear(256, 256, fmt="fp8", numerics="official", dtype=torch.float32)
    official.load_weight(qw)
    xq = formats.fake_quant_fp8(x, 128)
    assert not torch.equal(xq, x)
    torch.testing.assert_close(official(x), xq @ dense.T)
    with pytest.raises(ValueError, match="logical shape"):
        Linear(128, 256, fmt="fp8").load_weight(qw)


def test_exact_fp8_copy_of_a_dequantized_weight() -> None:
    """wo_a's FP8 form for the decode GEMV: kept only when it dequantizes back to the same
    bits (e8m0 checkpoints), remade after a reload, absent for other values."""
    from dsv4.formats import dequant_fp8_block, quant_fp8_block
    from dsv4.model.layers import Linear, exact_fp8_copy

    gen = torch.Generator().manual_seed(3)
    lin = Linear(256, 384, fmt="bf16", block=128, dtype=torch.bfloat16)
    w8, s = quant_fp8_block(torch.randn(384, 256, generator=gen) * 0.05, 128, "e8m0")
    lin.load_weight(dequant_fp8_block(w8, s, 128, torch.bfloat16))
    copy = exact_fp8_copy(lin)
    assert copy is not None and exact_fp8_copy(lin) is copy            # made once
    assert torch.equal(dequant_fp8_block(copy[0], copy[1], 128, torch.bfloat16), lin.weight)
    # fp32 block scales (the *-Base checkpoints): the bf16 values are off the e8m0 grid.
    w8b, s32 = quant_fp8_block(torch.randn(384, 256, generator=gen) * 0.05, 128, "float32")
    lin.load_weight(dequant_fp8_block(w8b, s32, 128, torch.bfloat16))
    assert exact_fp8_copy(lin) is None
    lin.load_weight(dequant_fp8_block(w8, s, 128, torch.bfloat16))   # a reload: made again
    again = exact_fp8_copy(lin)
    assert again is not None and torch.equal(again[0].view(torch.uint8), copy[0].view(torch.uint8))


def test_prepare_decode_weights_is_a_no_op_off_the_gpu() -> None:
    """The decode-only weight forms (wo_a's FP8 copy) exist only for the GPU kernels."""
    from dsv4.config import ModelConfig
    from dsv4.model.transformer import Transformer
    from dsv4.tiny import tiny_config

    model = Transformer(ModelConfig.from_dict(tiny_config()), numerics="bf16", backend="torch", dtype=torch.bfloat16)
    assert model.prepare_decode_weights() == 0
    assert all("_exact_fp8" not in m.__dict__ for m in model.modules())
