"""The inline-PTX MXFP4 decodes of ``dsv4.ops.triton_moe`` (``_FP4_TO_BF16_ASM``: two multiplies,
and ``_FP4_TO_BF16_FOLD_ASM``: one), executed on CPU by a small interpreter of the PTX
instructions they use (mov, prmt, shl, shr, and, or, mul.rn.bf16x2), against the exact value
e2m1 × 2^(s-127) for every byte and every scale byte each decode supports (0..191; the one-
multiply decode 0..128), and the host check that picks the one-multiply decode.

The Triton interpreter cannot run inline assembly, so this is the CPU check of the asm's logic;
``tests/kernels/test_sm90_compile.py`` checks that ptxas accepts it, and the GPU tests
(``test_gpu_kernels.py``) compare the kernels that use it with the torch twin.
"""

from __future__ import annotations

import random
import struct

import pytest
import torch

from dsv4.formats import E2M1_VALUES
from dsv4.ops import triton_moe as tm
from dsv4.ops.triton_moe import _FP4_TO_BF16_ASM, _FP4_TO_BF16_FOLD_ASM

MASK32 = 0xFFFFFFFF


def _bf16_to_float(h: int) -> float:
    return struct.unpack("<f", struct.pack("<I", h << 16))[0]


def _bf16_bits(x: float) -> int:
    """x (a Python float) rounded to bf16, nearest-even (via fp32; exact for the values here)."""
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def _bf16x2_mul(a: int, b: int) -> int:
    """mul.rn.bf16x2 on two 32-bit words (each 16-bit half a bf16; product rounded to bf16)."""
    lo = _bf16_bits(_bf16_to_float(a & 0xFFFF) * _bf16_to_float(b & 0xFFFF))
    hi = _bf16_bits(_bf16_to_float(a >> 16) * _bf16_to_float(b >> 16))
    return lo | (hi << 16)


def _prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 (default mode): byte i of d is byte sel[4i+2:4i] of the 8-byte {b, a}."""
    src = a | (b << 32)
    out = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (n & 7))) & 0xFF
        if n & 8:  # sign-replicate mode bit: not used by the decode
            raise AssertionError("prmt sign replication is not expected")
        out |= byte << (8 * i)
    return out


def run_asm(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Execute the decode's PTX on 32-bit Python ints; returns every register."""
    regs = dict(inputs)

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok.startswith("0x"):
            return int(tok, 16)
        if tok.isdigit():
            return int(tok)
        return regs[tok]

    body = asm.strip().strip("{}")
    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        d, *src = (t.strip() for t in args.split(","))
        if op == "mov.b32":
            regs[d] = val(src[0])
        elif op == "prmt.b32":
            regs[d] = _prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op == "shl.b32":
            regs[d] = (val(src[0]) << val(src[1])) & MASK32
        elif op == "shr.b32":
            regs[d] = val(src[0]) >> val(src[1])
        elif op == "and.b32":
            regs[d] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[d] = val(src[0]) | val(src[1])
        elif op == "mul.rn.bf16x2":
            regs[d] = _bf16x2_mul(val(src[0]), val(src[1]))
        else:
            raise AssertionError(f"unexpected PTX instruction {op!r}")
    return regs


@pytest.mark.parametrize("fold", [False, True])
def test_decode_is_exact_for_every_code_and_scale(fold: bool) -> None:
    asm = (_FP4_TO_BF16_FOLD_ASM if fold else _FP4_TO_BF16_ASM).value
    values = E2M1_VALUES
    rng = random.Random(0)
    # The scale operand the kernels build: bf16 2^(s-1) (one multiply, s <= 128) or 2^(s-64).
    top, bias = (tm.FOLD_MAX_SCALE_BYTE, 1) if fold else (191, 64)
    for s in range(top + 1):
        scale = _bf16_bits(2.0 ** (s - bias))
        assert _bf16_to_float(scale) == 2.0 ** (s - bias)        # a bf16 normal: exact
        word_scale = scale | (scale << 16)
        # Every byte value appears in every lane position across the 64 words.
        perm = rng.sample(range(256), 256)
        for w in range(64):
            b = [perm[(4 * w + i) % 256] for i in range(4)]
            word = b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24)
            r = run_asm(asm, {"$4": word, "$5": word_scale, "$6": word_scale})
            got_lo = [r["$0"] & 0xFFFF, r["$0"] >> 16, r["$1"] & 0xFFFF, r["$1"] >> 16]
            got_hi = [r["$2"] & 0xFFFF, r["$2"] >> 16, r["$3"] & 0xFFFF, r["$3"] >> 16]
            for i in range(4):
                want_lo = values[b[i] & 0xF] * 2.0 ** (s - 127)
                want_hi = values[b[i] >> 4] * 2.0 ** (s - 127)
                # bf16 holds every e2m1 × 2^(s-127) exactly (1 mantissa bit, in range).
                assert got_lo[i] == _bf16_bits(want_lo), (s, b[i], hex(got_lo[i]))
                assert got_hi[i] == _bf16_bits(want_hi), (s, b[i], hex(got_hi[i]))


def test_decode_sign_of_zero() -> None:
    """Codes 0 and 8 decode to +0 and -0 under both decodes (the fp32 decode's signs)."""
    for asm in (_FP4_TO_BF16_ASM.value, _FP4_TO_BF16_FOLD_ASM.value):
        one = _bf16_bits(1.0)
        r = run_asm(asm, {"$4": 0x80088008, "$5": one | one << 16, "$6": one | one << 16})
        assert r["$0"] == 0x00008000 and r["$2"] == 0x80000000        # bytes 0x08, 0x80
        assert r["$1"] == 0x00008000 and r["$3"] == 0x80000000


def _stacks(max_byte: int) -> object:
    from dsv4.ops.torch_dense import ExpertWeights
    E, n, k = 2, 8, 64
    w = [torch.zeros(E, n, k // 2, dtype=torch.uint8) for _ in range(3)]
    s = [torch.full((E, n, k // 32), 120, dtype=torch.uint8) for _ in range(3)]
    s[2][1, 3, 1] = max_byte
    s = [t.view(torch.float8_e8m0fnu) for t in s]
    return ExpertWeights(w[0], w[1], w[2], None, "fp4", s[0], s[1], s[2], 128)


def test_fold_check_per_tensor_and_version() -> None:
    """The one-multiply decode is picked only when every scale byte of the three stacks is <=
    128; the answer is cached per tensor and recomputed after an in-place change."""
    ex = _stacks(128)
    assert tm._fold_ok(ex)
    ex2 = _stacks(129)
    assert not tm._fold_ok(ex2)
    ex.s2.view(torch.uint8)[0, 0, 0] = 200          # bumps the version counter of the view base
    assert tm._scale_max(ex.s2) == 200 and not tm._fold_ok(ex)
    ex.s2.view(torch.uint8)[0, 0, 0] = 1
    assert tm._fold_ok(ex)
    with torch.inference_mode():                     # no version counter: cached for good
        ex3 = _stacks(7)
    assert tm._fold_ok(ex3) and tm._scale_max(ex3.s1) == 120
