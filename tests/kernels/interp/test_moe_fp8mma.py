"""The FP8-MMA routed-expert path (dsv4.ops.triton_moe_fp8) in the Triton interpreter at tiny
widths: against the torch twin and the bf16 kernel of triton_moe (skipped picks, unused plan
blocks, several N tiles, act blocks 32/64/128, extreme codes / scales / row magnitudes), the
e2m1 -> e4m3 byte map over all 16 codes, the prep kernel's codes and scales, the errors.

Run with TRITON_INTERPRET=1 (tests/kernels/test_interpreter.py does that in a child process).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4 import formats  # noqa: E402
from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_moe as tri  # noqa: E402
from dsv4.ops import triton_moe_fp8 as f8  # noqa: E402
from interp_helpers import rel_err  # noqa: E402

E8M0 = torch.float8_e8m0fnu
E, D, INTER, TOPK = 8, 256, 128, 2
# bf16 intermediates (gate/up outputs, the activation): a one-ulp flip of one of them moves the
# output by ~4e-3 relative (the bound of the bf16 expert tests in test_moe_fast.py).
BF16_BOUND = 1e-2


def _fp4_experts(gen: torch.Generator, act_block: int | None, n_exp: int = E, dim: int = D,
                 inter: int = INTER, scale_lo: int = 118, scale_hi: int = 124
                 ) -> ref.ExpertWeights:
    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(0, 256, (n_exp, n, k // 2), generator=gen, dtype=torch.uint8)
        s = torch.randint(scale_lo, scale_hi, (n_exp, n, k // 32), generator=gen)
        return w.view(torch.int8), s.to(torch.uint8).view(E8M0)

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, dim), stack(inter, dim), stack(dim, inter)
    return ref.ExpertWeights(w1, w3, w2, act_block, "fp4", s1, s3, s2)


def _routing(T: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(T)])
    w = torch.rand(T, TOPK, generator=gen) + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 1.5


# ------------------------------------------------------------------------------ byte map
@triton.jit
def _byte_map_kernel(nib_ptr, out_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    nib = tl.load(nib_ptr + r)
    tl.store(out_ptr + r, f8._e2m1_to_e4m3_bits(nib).to(tl.uint8))


def test_e2m1_to_e4m3_byte_map_all_codes() -> None:
    """Each of the 16 e2m1 codes maps to the e4m3 byte of the same value (sign of zero too)."""
    codes = torch.arange(16, dtype=torch.int32)
    out = torch.empty(16, dtype=torch.uint8)
    _byte_map_kernel[(1,)](codes, out, N=16)
    got = out.view(torch.float8_e4m3fn).float()
    # One MXFP4 group of 32: the 16 codes twice, scale 2^0.
    packed = formats.pack_e2m1(codes.to(torch.uint8).repeat(2).reshape(1, 32))
    scale = torch.full((1, 1), 127, dtype=torch.uint8).view(E8M0)
    want = formats.dequant_mxfp4(packed, scale, torch.float32).reshape(32)[:16]
    assert torch.equal(got, want), (got, want)
    assert torch.equal(torch.signbit(got), codes >= 8)
    assert torch.equal(want, torch.tensor(formats.E2M1_VALUES))


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` default mode: output byte i = byte (sel nibble i & 7) of b:a (bit 3 of
    the nibble, sign replication, is never set by the decode)."""
    pool = a | (b << 32)
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        assert nib < 8
        out |= ((pool >> (8 * nib)) & 0xFF) << (8 * i)
    return out


def _asm_decode_word(word: int) -> tuple[int, int]:
    """The steps of triton_moe_fp8._E2M1_TO_E4M3_ASM on one 32-bit word, in Python (its tables
    read from the PTX text, its masks and shifts checked to be there)."""
    text = str(getattr(f8._E2M1_TO_E4M3_ASM, "value", f8._E2M1_TO_E4M3_ASM))
    movs = dict(re.findall(r"mov\.b32 (\w+), (0x[0-9A-Fa-f]+);", text))
    lo, hi, sg = (int(movs[r], 16) for r in ("lo", "hi", "sg"))
    for step in ("and.b32 sel, $2, 0x7777;", "shr.b32 s, $2, 3; and.b32 s, s, 0x1111;",
                 "shr.b32 sel, $2, 16; and.b32 sel, sel, 0x7777;",
                 "shr.b32 s, $2, 19; and.b32 s, s, 0x1111;", "prmt.b32 m, lo, hi, sel;",
                 "prmt.b32 s, sg, z, s;", "or.b32 $0, m, s;", "or.b32 $1, m, s;"):
        assert step in text, step
    first = _prmt(lo, hi, word & 0x7777) | _prmt(sg, 0, (word >> 3) & 0x1111)
    second = _prmt(lo, hi, (word >> 16) & 0x7777) | _prmt(sg, 0, (word >> 19) & 0x1111)
    return first, second


@triton.jit
def _tile_kernel(w_ptr, s_ptr, out_ptr, sw_ptr, BN: tl.constexpr):
    rn = tl.arange(0, BN)
    e = tl.program_id(0)     # expert 0 (a tensor, as in the GEMM kernels)
    w8, sw = f8._mxfp4_e4m3_tile(w_ptr, s_ptr, e, rn, rn < BN, 32, 0, 32, 0, 2, False, BN)
    r32 = tl.arange(0, 32)
    tl.store(out_ptr + rn[:, None] * 32 + r32[None, :], w8.to(tl.uint8, bitcast=True))
    tl.store(sw_ptr + rn, sw)


def test_weight_tile_order_matches_the_asm_layout() -> None:
    """The interpreter's decode of one K group (the second one of a row: k0 = 32) gives the
    bytes that the inline-PTX decode's steps give, in the same order (its two outputs joined),
    and those bytes in mma_k_position order are the weights' natural-order e4m3 values."""
    gen = torch.Generator().manual_seed(4)
    BN = 16
    w = torch.randint(0, 256, (BN, 32), generator=gen, dtype=torch.uint8)   # K = 64
    s = torch.randint(100, 140, (BN, 2), generator=gen, dtype=torch.uint8)
    out = torch.empty(BN, 32, dtype=torch.uint8)
    sw = torch.empty(BN)
    _tile_kernel[(1,)](w, s, out, sw, BN=BN)
    assert torch.equal(sw, torch.exp2(s[:, 1].double() - 127).float())
    words = w[:, 16:].contiguous().view(torch.int32)                       # [BN, 4]
    want = torch.empty(BN, 32, dtype=torch.uint8)
    for n in range(BN):
        for g in range(4):
            first, second = _asm_decode_word(int(words[n, g]) & 0xFFFFFFFF)
            for r in range(4):   # joined: position 2(4g + r) + h
                want[n, 8 * g + 2 * r] = (first >> (8 * r)) & 0xFF
                want[n, 8 * g + 2 * r + 1] = (second >> (8 * r)) & 0xFF
    assert torch.equal(out, want)
    k = torch.arange(32)
    pos = (k & -8) | ((k & 3) << 1) | ((k >> 2) & 1)
    natural = formats.dequant_mxfp4(w[:, 16:].view(torch.int8),
                                    torch.full((BN, 1), 127, dtype=torch.uint8).view(E8M0),
                                    torch.float32)
    assert torch.equal(out[:, pos].view(torch.float8_e4m3fn).float(), natural)


# ------------------------------------------------------------------------------ prep kernel
def test_prep_codes_and_scales_equal_the_twins_fake_quant() -> None:
    """The gathered e4m3 codes × scales are the twin's fake-quantized rows, bit for bit, with
    zero and tiny blocks (the 1e-4 amax floor) and rows above e4m3's range."""
    gen = torch.Generator().manual_seed(3)
    T, ab, bm = 5, 64, 16
    x = (torch.randn(T, D, generator=gen) * 3).to(torch.bfloat16)
    x[1, :64] = 0
    x[2, 64:128] *= 1e-6
    x[3] *= 1e4
    ids = torch.tensor([[0, 3], [3, 1], [1, -1], [0, 1], [7, 2]])
    pairs, bexp = tri.moe_plan(ids, E, bm)
    nb = bexp.shape[0]
    q = torch.zeros(nb * bm, D, dtype=torch.float8_e4m3fn)
    s = torch.zeros(nb * bm, D // ab)
    f8._fp8_prep_kernel[(nb, D // ab)](x, pairs, bexp, q, s, ids.numel(), E, TOPK, x.stride(0),
                                       q.stride(0), s.stride(0), GATHER=True, BM=bm, AB=ab)
    want = ref.fake_act_quant(x, ab).float()
    real = pairs < ids.numel()
    rows = pairs[real].long()
    k = torch.arange(D)
    pos = (k & -8) | ((k & 3) << 1) | ((k >> 2) & 1)    # stored in the MMA K order
    assert torch.equal(pos.sort().values, k)           # a permutation ...
    assert torch.equal(pos // 8, k // 8)               # ... within each 8 columns
    deq = (q.float()[:, pos].reshape(-1, D // ab, ab) * s[:, :, None]).reshape(-1, D)
    assert torch.equal(deq[real], want[rows // TOPK])
    assert (s[real] > 0).all() and torch.equal(s[real], torch.exp2(torch.log2(s[real]).round()))


# ------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("T,cfg", [(1, None), (7, f8.MoeFp8Config(BM=16, BN_up=64, BN_down=64)),
                                   (23, f8.MoeFp8Config(BM=16, BN_up=128, BN_down=64)),
                                   (40, f8.MoeFp8Config(BM=64, BN_up=64, BN_down=128))])
def test_matches_twin_and_bf16_kernel(T: int, cfg: f8.MoeFp8Config | None) -> None:
    """bf16 compute, official numerics (act block 128): the twin and triton_moe.moe_experts
    agree with it, with skipped picks (-1, ids of other shards) and unused plan blocks."""
    gen = torch.Generator().manual_seed(T)
    ex = _fp4_experts(gen, 128)
    x = (torch.randn(T, D, generator=gen) * 3).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    if T > 1:
        ids[0, 1] = -1
        ids[T - 1, 0] = E + 3
    y = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, cfg)
    assert y.shape == (T, D) and y.dtype == torch.float32 and torch.isfinite(y).all()
    y_ref = ref.moe_experts(x, ids, w, ex, 10.0)
    y_bf16 = tri.moe_experts(x, ids, w, ex, 10.0)
    assert y_ref.norm() > 0
    assert rel_err(y, y_ref) < BF16_BOUND
    assert rel_err(y, y_bf16) < BF16_BOUND
    if T > 1:   # the skipped pick adds nothing: token 0 is its other pick alone
        only = ref.moe_experts(x[:1], ids[:1, :1], w[:1, :1], ex, 10.0)
        assert rel_err(y[:1], only) < BF16_BOUND


@pytest.mark.parametrize("act_block", [32, 64])
def test_smaller_act_blocks(act_block: int) -> None:
    """Act blocks of 32 and 64 (V4.1 uses 32): the row scale changes every 1 or 2 K groups."""
    gen = torch.Generator().manual_seed(act_block)
    ex = _fp4_experts(gen, act_block)
    T = 9
    x = (torch.randn(T, D, generator=gen) * 2).to(torch.bfloat16)
    x[:, 32:64] *= 50        # blocks of very different amax within a row
    ids, w = _routing(T, gen)
    y = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, f8.MoeFp8Config(BM=16, BN_up=128, BN_down=128))
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 10.0)) < BF16_BOUND


def test_every_code_scale_and_row_magnitude() -> None:
    """All 256 byte values, weight scales 2^-27..2^12, rows of magnitude 1e-3 .. 1e3, a block
    much smaller than its row, no SwiGLU limit."""
    gen = torch.Generator().manual_seed(0)
    dim, inter, rows = 512, 128, 6
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    w1 = codes.repeat(inter, 1).view(1, inter, dim // 2)
    s1 = torch.randint(100, 140, (1, inter, dim // 32), generator=gen).to(torch.uint8).view(E8M0)
    base = _fp4_experts(gen, 128, n_exp=1, dim=dim, inter=inter)
    ex = ref.ExpertWeights(w1, w1.roll(1, dims=2), base.w2, 128, "fp4", s1,
                           s1.roll(3, dims=2), base.s2)
    x = torch.randn(rows, dim, generator=gen) * torch.logspace(-3, 3, rows)[:, None]
    x[2, 100:200] *= 1e-4
    x = x.to(torch.bfloat16)
    ids = torch.zeros(rows, 1, dtype=torch.int64)
    w = torch.ones(rows, 1)
    y = f8.moe_experts_fp8mma(x, ids, w, ex, 0.0, f8.MoeFp8Config(BM=16, BN_up=128, BN_down=128))
    y_ref = ref.moe_experts(x, ids, w, ex, 0.0)
    for t in range(rows):   # per row: a global norm would hide the small rows
        assert rel_err(y[t], y_ref[t]) < BF16_BOUND, t


def test_no_tokens_or_no_picks() -> None:
    gen = torch.Generator().manual_seed(1)
    ex = _fp4_experts(gen, 128)
    x = torch.zeros(0, D, dtype=torch.bfloat16)
    y = f8.moe_experts_fp8mma(x, torch.zeros(0, TOPK, dtype=torch.int64), torch.zeros(0, TOPK),
                              ex, 10.0)
    assert y.shape == (0, D)
    x = torch.randn(3, D, generator=gen).to(torch.bfloat16)
    y = f8.moe_experts_fp8mma(x, torch.full((3, TOPK), -1), torch.ones(3, TOPK), ex, 10.0)
    assert torch.equal(y, torch.zeros(3, D))


# ------------------------------------------------------------------------------ errors, plans
def test_rejects_what_it_does_not_cover() -> None:
    gen = torch.Generator().manual_seed(2)
    ex = _fp4_experts(gen, 128)
    x = torch.randn(2, D, generator=gen).to(torch.bfloat16)
    ids, w = _routing(2, gen)
    with pytest.raises(ValueError, match="MXFP4"):
        dense = ref.ExpertWeights(torch.zeros(E, INTER, D), torch.zeros(E, INTER, D),
                                  torch.zeros(E, D, INTER), 128)
        f8.moe_experts_fp8mma(x, ids, w, dense, 10.0)
    with pytest.raises(ValueError, match="act_block"):
        no_quant = ref.ExpertWeights(ex.w1, ex.w3, ex.w2, None, "fp4", ex.s1, ex.s3, ex.s2)
        f8.moe_experts_fp8mma(x, ids, w, no_quant, 10.0)
    with pytest.raises(ValueError, match="bf16"):
        f8.moe_experts_fp8mma(x.float(), ids, w, ex, 10.0)
    with pytest.raises(ValueError, match="act_block a multiple of 32"):
        odd = ref.ExpertWeights(ex.w1, ex.w3, ex.w2, 48, "fp4", ex.s1, ex.s3, ex.s2)
        f8.moe_experts_fp8mma(x, ids, w, odd, 10.0)
    with pytest.raises(ValueError, match="e8m0"):
        fp32_scales = ref.ExpertWeights(ex.w1, ex.w3, ex.w2, 128, "fp4", ex.s1.float(),
                                        ex.s3.float(), ex.s2.float())
        f8.moe_experts_fp8mma(x, ids, w, fp32_scales, 10.0)
    with pytest.raises(ValueError, match="w1 has shape"):
        f8.moe_experts_fp8mma(x[:, :128], ids, w, ex, 10.0)


def test_config_validation_and_pick() -> None:
    for name in ("BM", "BN_up", "BN_down"):
        for bad in (8, 48, 0, True, 64.0):
            with pytest.raises(ValueError, match=name):
                f8.MoeFp8Config(**{name: bad})
    for name in ("warps_up", "warps_down"):
        with pytest.raises(ValueError, match=name):
            f8.MoeFp8Config(**{name: 2})
    with pytest.raises(ValueError, match="stages"):
        f8.MoeFp8Config(stages=0)
    # V4-Flash prefill: 2K tokens ~48 rows per expert, 8K ~190.
    small, large = f8.pick_fp8mma_config(2048 * 6, 256), f8.pick_fp8mma_config(8192 * 6, 256)
    assert (small.BM, large.BM) == (64, 128)
    # The up kernel's tiles stay at <= 8192 elements (no register spills on sm_90).
    assert small.BM * small.BN_up <= 8192 and large.BM * large.BN_up <= 8192
    assert f8.pick_fp8mma_config(1, 256).BM == 64


def test_bench_tiny_smoke(tmp_path) -> None:
    """bench/moe_prefill_fp8.py --tiny: one row per token count, both paths agreeing, JSON."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "bench" / "moe_prefill_fp8.py"
    spec = importlib.util.spec_from_file_location("moe_prefill_fp8_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    res = bench.main(["--tiny", "--tokens", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    (row,) = res["rows"]
    assert row["tokens"] == 3 and row["finite"] and row["rel_diff"] < BF16_BOUND
    assert row["fp8_us"] > 0 and row["bf16_us"] > 0
