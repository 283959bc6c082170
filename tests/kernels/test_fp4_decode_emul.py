"""The "asm" MXFP4 decode (``FP4_DECODE="asm"``: the group scales built four at a time by
``_fp4_scale_asm``, then the ``_fp4_decode_asm`` bit sequence) against the previous one
("asm_v1": one scale at a time) and the exact values, on CPU: its inline PTX executed by the
small PTX interpreter of ``test_fp4_asm`` for every scale byte of each scale lane and every
byte of each weight lane, both variants (one multiply, scales <= 128; two multiplies, <= 191).

Plus the offline sm_90 compile (no GPU): both decodes give the expert kernels the same MMA
structure (same dot operand layouts, kWidth 4: the same k grouping per MMA instruction, so the
same accumulation bits), and the "asm" scale sequence reaches the multiplies as half-register
operands (no per-group byte extract).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from dsv4.formats import E2M1_VALUES
from dsv4.ops import triton_moe as tm
from tests.kernels.test_fp4_asm import _bf16_bits, _bf16_to_float, run_asm

BENCH = Path(__file__).resolve().parents[2] / "bench" / "moe_sass_count.py"


def _v1_scale_bits(s: int, fold: bool) -> int:
    """The "asm_v1" scale operand: ((s + bias) << 7) as uint16 (``_mxfp4_planes_bf16``)."""
    return ((s + (126 if fold else 63)) << 7) & 0xFFFF


def _v2_scales(word: int, fold: bool) -> list[int]:
    """``_fp4_scale_asm`` on one register of four scale bytes: the four bf16 halves."""
    asm = (tm._FP4_SCALE_FOLD_ASM if fold else tm._FP4_SCALE_ASM).value
    r = run_asm(asm, {"$2": word})
    return [r["$0"] & 0xFFFF, r["$0"] >> 16, r["$1"] & 0xFFFF, r["$1"] >> 16]


@pytest.mark.parametrize("fold", [False, True])
def test_scale_asm_equals_v1_for_every_byte(fold: bool) -> None:
    """Every byte 0..255 in every lane of the register, with every neighbour pattern the
    rotation gives: the same bits as the "asm_v1" per-byte scale (no carry between lanes)."""
    for s in range(256):
        for rot in range(4):
            lanes = [(s + 85 * ((i + rot) % 4)) % 256 for i in range(4)]
            lanes[rot] = s
            word = sum(b << (8 * i) for i, b in enumerate(lanes))
            got = _v2_scales(word, fold)
            assert got == [_v1_scale_bits(b, fold) for b in lanes], (fold, lanes, got)
    # Extremes next to each other (largest sums, largest neighbours).
    for word in (0x00000000, 0xFFFFFFFF, 0xFF00FF00, 0x00FF00FF, 0x80808080, 0xBFBFBFBF):
        lanes = [(word >> (8 * i)) & 0xFF for i in range(4)]
        assert _v2_scales(word, fold) == [_v1_scale_bits(b, fold) for b in lanes]


def _decode(word: int, scale_half: int, fold: bool) -> tuple[list[int], list[int]]:
    """``_fp4_decode_asm`` on one weight register whose four bytes share one group scale (the
    multiplies read that half in both halves: bf16x2 {h, h}); (low-nibble, high-nibble)
    bf16 bits of bytes 0..3."""
    asm = (tm._FP4_TO_BF16_FOLD_ASM if fold else tm._FP4_TO_BF16_ASM).value
    sw = scale_half | (scale_half << 16)
    r = run_asm(asm, {"$4": word, "$5": sw, "$6": sw})
    lo = [r["$0"] & 0xFFFF, r["$0"] >> 16, r["$1"] & 0xFFFF, r["$1"] >> 16]
    hi = [r["$2"] & 0xFFFF, r["$2"] >> 16, r["$3"] & 0xFFFF, r["$3"] >> 16]
    return lo, hi


@pytest.mark.parametrize("fold", [False, True])
def test_v2_decode_exact_and_equal_to_v1(fold: bool) -> None:
    """Scale asm then decode asm, for every scale byte the variant supports (one multiply:
    0..128, two: 0..191) in each of the four group lanes and every weight byte in each of the
    four byte lanes: the exact e2m1 × 2^(s-127) in bf16, and the same bits as "asm_v1"."""
    top = tm.FOLD_MAX_SCALE_BYTE if fold else 191
    for s in range(top + 1):
        for g in range(4):                      # the group lane of the scale register
            lanes = [(s + 37 * i) % (top + 1) for i in range(4)]
            lanes[g] = s
            half = _v2_scales(sum(b << (8 * i) for i, b in enumerate(lanes)), fold)[g]
            assert half == _v1_scale_bits(s, fold)
            for w in range(64):
                b = [(4 * w + i + 64 * g) % 256 for i in range(4)]
                word = b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24)
                lo, hi = _decode(word, half, fold)
                lo1, hi1 = _decode(word, _v1_scale_bits(s, fold), fold)
                assert (lo, hi) == (lo1, hi1)
                for i in range(4):
                    want_lo = _bf16_bits(E2M1_VALUES[b[i] & 0xF] * 2.0 ** (s - 127))
                    want_hi = _bf16_bits(E2M1_VALUES[b[i] >> 4] * 2.0 ** (s - 127))
                    assert lo[i] == want_lo, (s, b[i], hex(lo[i]))
                    assert hi[i] == want_hi, (s, b[i], hex(hi[i]))
    # Signed zeros: codes 0 and 8 -> +0 and -0.
    lo, hi = _decode(0x80088008, _v2_scales(0x7F7F7F7F, fold)[0], fold)
    assert lo == [0x8000, 0x0000, 0x8000, 0x0000] and hi == [0x0000, 0x8000, 0x0000, 0x8000]
    # The multipliers: 2^(s-1) (one multiply), 2^(s-64) (two).
    assert _bf16_to_float(_v1_scale_bits(127, fold)) == 2.0 ** (126 if fold else 63)


def test_decode_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP4_DECODE "asm" / "asm_v1" / "alu" -> the kernels' FAST_FP4 2 / 1 / 0 (bf16 MXFP4 only)."""
    import torch

    from dsv4.ops.torch_dense import ExpertWeights
    w = torch.zeros(1, 8, 16, dtype=torch.uint8)
    s = torch.full((1, 8, 1), 127, dtype=torch.uint8)
    ex = ExpertWeights(w, w, w, None, "fp4", s, s, s, 128)
    for name, ver in (("asm", 2), ("asm_v1", 1), ("alu", 0)):
        monkeypatch.setattr(tm, "FP4_DECODE", name)
        assert tm._fast_fp4(ex, torch.bfloat16) == ver
        assert tm._fast_fp4(ex, torch.float32) == 0
    monkeypatch.setattr(tm, "FP4_DECODE", "fast")
    with pytest.raises(ValueError):
        tm._fast_fp4(ex, torch.bfloat16)


def _sass_module():
    spec = importlib.util.spec_from_file_location("moe_sass_count_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_DOT = re.compile(r"tt\.dot .*?: (tensor<[^>]*>>) \* (tensor<[^>]*>>) -> (tensor<[^>]*>)")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for sm_90")
@pytest.mark.parametrize("which,BN", [("up", 64), ("down", 128)])
def test_same_mma_structure_offline(which: str, BN: int) -> None:
    """sm_90 compile of the decode plan (BM 16, 4 warps, one multiply) under both decodes: the
    same dots with the same operand layouts (kWidth 4) and as many MMAs; the "asm" scales feed
    the multiplies as .H0_H0 / .H1_H1 halves of the registers the scale asm writes."""
    mod = _sass_module()
    k1 = mod.compile_kernel(which, 16, BN, 4, True, "asm_v1")
    k2 = mod.compile_kernel(which, 16, BN, 4, True, "asm")
    d1, d2 = _DOT.findall(k1.asm["ttgir"]), _DOT.findall(k2.asm["ttgir"])
    assert d1 and d1 == d2
    assert all("kWidth = 4" in a and "kWidth = 4" in b for a, b, _ in d2)
    n1, ops1, _ = mod.loop_counts(k1.asm["cubin"])
    n2, ops2, sass2 = mod.loop_counts(k2.asm["cubin"])
    assert ops1["HMMA"] == ops2["HMMA"] and ops1["HMUL2"] == ops2["HMUL2"]
    assert ops2["PRMT"] < ops1["PRMT"] and n2 <= n1
    assert "_H1_H1" in sass2 or ".H1_H1" in sass2
