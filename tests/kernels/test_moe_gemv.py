"""The GEMV expert path for 1-4 tokens (``dsv4/ops/triton_moe_gemv.py``), MXFP4 stacks.

* plain CPU: plan / qualification rules, argument errors, the dispatch flag of
  ``triton_moe.moe_experts`` (off by default);
* ``test_interp_*``: the kernels in the Triton interpreter at tiny widths (E 8, D 256, I 128),
  re-run in a child process with ``TRITON_INTERPRET=1`` by :func:`test_kernels_in_interpreter`:
  against the torch twin and the grouped MMA kernels of ``triton_moe``, T 1..4, k 2..6, ids
  repeated across tokens, skipped ids (-1, >= E), random scales with large / small exponents,
  official (act block 128 / 32) and bf16 numerics, unsplit and split-K plans;
* ``test_gpu_*``: V4-Flash widths on the GPU (skipped without CUDA), NaN-poisoned allocator,
  T 1 / 2 / 4, run-to-run bits, and a CUDA-graph capture replayed on changed routing: the
  eager bits.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.interp_child import run_in_interpreter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(
    not INTERP, reason="interpreter test: run by test_kernels_in_interpreter in a child process")
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERP, reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")

E8M0 = torch.float8_e8m0fnu
# bf16 intermediates (gate/up outputs, the activation): one flipped bf16 rounding moves the output
# by ~4e-3 relative (the bound of the other bf16 expert tests); fp32 compute: fp32 rounding.
BF16_BOUND = 1e-2
FP32_BOUND = 1e-5


def _load_bench(name: str):
    """bench/<name>.py as a module (its plan lists)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _fp4_experts(gen: torch.Generator, E: int, D: int, inter: int, act_block: int | None,
                 scale_lo: int = 118, scale_hi: int = 124, device: str = "cpu"):
    from dsv4.ops.torch_dense import ExpertWeights

    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(0, 256, (E, n, k // 2), generator=gen, dtype=torch.uint8,
                          device=device)
        s = torch.randint(scale_lo, scale_hi, (E, n, k // 32), generator=gen, device=device)
        return w.view(torch.int8), s.to(torch.uint8).view(E8M0)

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, D), stack(inter, D), stack(D, inter)
    return ExpertWeights(w1, w3, w2, act_block, "fp4", s1, s3, s2, 128)


# ------------------------------------------------------------------------------ plain CPU
def test_config_and_qualification_rules() -> None:
    pytest.importorskip("triton")
    from dsv4.ops import triton_moe_gemv as gv
    assert gv.MOE_GEMV_MAX_TOKENS == 4
    assert gv.gemv_block_k(4096, 2048, 128) == 256
    assert gv.gemv_block_k(5120, 2304, 32) == 256
    assert gv.gemv_block_k(4096, 2048, 512) is None
    assert gv.gemv_block_k(96, 96, None) == 32
    assert gv.gemv_block_k(4096, 2048, 16) is None          # act blocks are whole 32-groups
    cfg = gv.pick_gemv_config(1, 6, 4096, 2048, 128)
    assert cfg.BK == 256 and cfg.split_up >= 1 and cfg.split_down >= 1
    for bad in ({"BN_up": 24}, {"BK": 16}, {"split_up": 0}, {"warps_down": True}):
        with pytest.raises(ValueError):
            gv.GemvConfig(**bad)
    gen = torch.Generator().manual_seed(0)
    ex = _fp4_experts(gen, 4, 256, 128, 128)
    ids = torch.zeros(2, 2, dtype=torch.int64)
    assert gv.gemv_qualifies(torch.zeros(2, 256, dtype=torch.bfloat16), ids, ex)
    assert not gv.gemv_qualifies(torch.zeros(5, 256, dtype=torch.bfloat16), ids, ex)
    assert not gv.gemv_qualifies(torch.zeros(2, 256), ids, ex)     # fp32 x: the MMA kernels


def test_dispatch_flag_is_off_by_default() -> None:
    """The lead turns the path on after timing it: off unless DSV4_MOE_GEMV=1."""
    pytest.importorskip("triton")
    from dsv4.ops import triton_moe_gemv as gv
    assert gv.MOE_GEMV is (os.environ.get("DSV4_MOE_GEMV", "0") == "1")


def test_kernels_in_interpreter() -> None:
    if INTERP:
        pytest.skip("already in the interpreter")
    run_in_interpreter(__file__, "interp_", min_passed=6)


# ------------------------------------------------------------------------------ interpreter
try:
    import triton
    import triton.language as tl

    from dsv4.ops.triton_moe_gemv import _act_slice

    @triton.jit
    def _act_slice_probe(x_ptr, ev_ptr, od_ptr, QB: tl.constexpr, BK: tl.constexpr):
        ev, od = _act_slice(x_ptr, 0, QB, BK)
        o = tl.arange(0, BK // 32)[:, None] * 16 + tl.arange(0, 16)[None, :]
        tl.store(ev_ptr + o, ev)
        tl.store(od_ptr + o, od)

    from dsv4.ops.triton_moe_gemv import _fake_quant_tile

    @triton.jit
    def _fake_quant_probe(x_ptr, y_ptr, BN: tl.constexpr, QA: tl.constexpr):
        o = tl.arange(0, BN)
        tl.store(y_ptr + o, _fake_quant_tile(tl.load(x_ptr + o), BN, QA))
except ImportError:                 # no triton: the plain CPU tests still run
    _act_slice_probe = _fake_quant_probe = None

E, D, INTER = 8, 256, 128


def _routing(T: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids with repeats across tokens (8 experts, up to 4 tokens × 6 picks), one -1 and one
    out-of-range id (T >= 2), weights summing to 1.5 per token."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    if T >= 2:
        ids[1, 0] = ids[0, 0]                   # two tokens on one expert
        ids[1, k - 1] = E + 3                   # another shard's expert: skipped
        ids[T - 1, 1] = -1                      # no expert
    w = torch.rand(T, k, generator=gen) + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 1.5


@interp_only
@pytest.mark.parametrize("T,k,act_block,dtype,plan", [
    (1, 6, 128, torch.bfloat16, "pick"), (2, 2, 128, torch.bfloat16, "split"),
    (3, 4, None, torch.bfloat16, "split"), (4, 6, 32, torch.bfloat16, "pick"),
    (4, 3, 128, torch.float32, "split"), (2, 5, None, torch.float32, "unsplit"),
    (1, 2, 32, torch.bfloat16, "unsplit")])
def test_interp_gemv_against_twin_and_mma(T: int, k: int, act_block, dtype, plan: str) -> None:
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    from dsv4.ops import triton_moe_gemv as gv
    gen = torch.Generator().manual_seed(T * 10 + k)
    ex = _fp4_experts(gen, E, D, INTER, act_block, scale_lo=112, scale_hi=132)
    x = (torch.randn(T, D, generator=gen) * 3).to(dtype)
    ids, w = _routing(T, k, gen)
    cfg = {"pick": None,
           "split": gv.GemvConfig(BN_up=32, BN_down=64, BK=max(64, act_block or 0), split_up=2,
                                  split_down=4),
           "unsplit": gv.GemvConfig(BN_up=64, BN_down=128, BK=128)}[plan]
    # (Run-to-run bits are a GPU property, checked by the GPU tests below: the interpreter
    # runs the programs one after another.)
    y = gv.moe_experts_gemv(x, ids, w, ex, 10.0, cfg)
    assert y.shape == (T, D) and y.dtype == torch.float32 and bool(torch.isfinite(y).all())
    bound = BF16_BOUND if dtype == torch.bfloat16 else FP32_BOUND
    assert _rel(y, ref.moe_experts(x, ids, w, ex, 10.0)) < bound
    assert _rel(y, tri.moe_experts_with_config(x, ids, w, ex, 10.0, None)) < bound


@interp_only
@pytest.mark.parametrize("bk,act_block,split_up,split_down", [
    (256, 128, 1, 4), (512, 128, 2, 8), (256, 32, 4, 8), (512, 256, 1, 1)])
def test_interp_k_step_spans_several_act_blocks(bk: int, act_block: int, split_up: int,
                                                split_down: int) -> None:
    """Issue #5 regression (the H200 failures were all K steps of 256 / 512 with act block 128):
    a K step covering several act-quant blocks quantizes each block with its own scale; the
    twin's bits to the bf16 bound, skipped ids, split and unsplit plans, one loud act block
    per row (the per-block scales themselves: test_interp_act_slice_per_block; run-to-run bits
    are a GPU property, checked there)."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe_gemv as gv
    E_, D_, I_ = 4, 1024, 512
    gen = torch.Generator().manual_seed(bk + act_block + split_up)
    ex = _fp4_experts(gen, E_, D_, I_, act_block, scale_lo=112, scale_hi=132)
    x = (torch.randn(3, D_, generator=gen) * 3)
    x[:, :act_block] *= 4096.0                      # one loud block per K step's first block
    x = x.to(torch.bfloat16)
    ids = torch.tensor([[0, 3, 1], [2, -1, 0], [E_ + 1, 1, 3]])
    w = torch.rand(3, 3, generator=gen) + 0.2
    cfg = gv.GemvConfig(BN_up=32, BN_down=64, BK=bk, split_up=split_up, split_down=split_down)
    y = gv.moe_experts_gemv(x, ids, w, ex, 10.0, cfg)
    assert bool(torch.isfinite(y).all())
    assert _rel(y, ref.moe_experts(x, ids, w, ex, 10.0)) < BF16_BOUND


@interp_only
@pytest.mark.parametrize("bk,qb", [(256, 128), (512, 128), (256, 32), (128, 128), (256, 0)])
def test_interp_act_slice_per_block(bk: int, qb: int) -> None:
    """``_act_slice`` alone: the (even, odd) columns of one K step, fake-quantized with one
    ue8m0 scale per act block even when the step spans several blocks (blocks 2^12 apart in
    magnitude: a scale shared across the step would flush the quiet ones): the exact bits of a
    torch reference."""
    gen = torch.Generator().manual_seed(bk + qb)
    x = torch.randn(bk, generator=gen) * 3
    if qb:
        x.view(-1, qb)[::2] *= 4096.0
    x = x.to(torch.bfloat16)
    ev, od = torch.empty(bk // 2), torch.empty(bk // 2)
    _act_slice_probe[(1,)](x, ev, od, QB=qb, BK=bk)
    want = x.float()
    if qb:
        blk = want.view(-1, qb)
        t = blk.abs().amax(-1).clamp_min(1e-4) * torch.tensor(1 / 448, dtype=torch.float32)
        m, e = torch.frexp(t)
        s = torch.ldexp(torch.ones_like(t), e - (m == 0.5).int())[:, None]
        want = ((blk / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).view(-1)
    assert torch.equal(ev, want[0::2]) and torch.equal(od, want[1::2])


@interp_only
def test_interp_extreme_scales_and_skipped_tokens() -> None:
    """Scales 2^-27 .. 2^13 (e8m0 100..140) with x of large magnitude; a token whose
    picks are all skipped gets exact zeros; the unsplit and split plans agree to fp32 rounding."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe_gemv as gv
    gen = torch.Generator().manual_seed(7)
    ex = _fp4_experts(gen, E, D, INTER, 128, scale_lo=100, scale_hi=141)
    x = (torch.randn(3, D, generator=gen) * 100).to(torch.bfloat16)
    ids, w = _routing(3, 3, gen)
    ids[2] = torch.tensor([-1, E, E + 1])
    y = gv.moe_experts_gemv(x, ids, w, ex, 10.0, gv.GemvConfig(BK=128, split_up=2, split_down=1))
    assert torch.equal(y[2], torch.zeros(D))
    r = ref.moe_experts(x, ids, w, ex, 10.0)
    assert bool(torch.isfinite(y).all()) and _rel(y[:2], r[:2]) < BF16_BOUND
    y1 = gv.moe_experts_gemv(x, ids, w, ex, 10.0, gv.GemvConfig(BK=128))
    assert _rel(y1, y) < BF16_BOUND


@interp_only
@pytest.mark.parametrize("act_block,bn_up,split_up,split_down", [
    (128, 128, 1, 1), (128, 64, 2, 2), (32, 64, 1, 2), (None, 32, 2, 1)])
def test_interp_kchunk_stacks_and_prequant(monkeypatch: pytest.MonkeyPatch, act_block,
                                           bn_up: int, split_up: int, split_down: int) -> None:
    """K-chunk-major stacks (the GPU layout, chunk = the K step) give the row-major stacks'
    bits; the inputs' fake quantization once per call (x by its own launch; act in the up
    finish when BN_up holds whole act blocks: 128 / 128, 64 / 32) gives the in-loop form's
    bits; both the twin to the bf16 bound; a K step other than the chunk is refused."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe_gemv as gv
    gen = torch.Generator().manual_seed(bn_up + (act_block or 0))
    ex = _fp4_experts(gen, E, D, INTER, act_block, scale_lo=112, scale_hi=132)
    bk = 128
    exk = ref.kchunk_experts(ex, bk)
    x = (torch.randn(3, D, generator=gen) * 3).to(torch.bfloat16)
    x[0, :32] *= 512.0                                   # one loud act block
    ids, w = _routing(3, 4, gen)
    cfg = gv.GemvConfig(BN_up=bn_up, BN_down=64, BK=bk, split_up=split_up,
                        split_down=split_down)
    monkeypatch.setattr(gv, "GEMV_PREQUANT", True)
    y = gv.moe_experts_gemv(x, ids, w, ex, 10.0, cfg)
    assert torch.equal(gv.moe_experts_gemv(x, ids, w, exk, 10.0, cfg), y)
    assert _rel(gv.moe_experts_gemv(x, ids, w, exk, 10.0), y) < BF16_BOUND   # default plan
    monkeypatch.setattr(gv, "GEMV_PREQUANT", False)
    assert torch.equal(gv.moe_experts_gemv(x, ids, w, ex, 10.0, cfg), y)
    assert bool(torch.isfinite(y).all())
    assert _rel(y, ref.moe_experts(x, ids, w, ex, 10.0)) < BF16_BOUND
    with pytest.raises(ValueError, match="chunk"):
        gv.moe_experts_gemv(x, ids, w, exk, 10.0, gv.GemvConfig(BK=256))


@interp_only
@pytest.mark.parametrize("bn,qa", [(128, 128), (128, 32), (64, 32), (32, 32)])
def test_interp_fake_quant_tile(bn: int, qa: int) -> None:
    """``_fake_quant_tile`` (the act quantization in the up finish, x's pre-pass): the bits of
    the torch reference per qa-wide block, blocks 2^12 apart in magnitude."""
    gen = torch.Generator().manual_seed(bn + qa)
    x = torch.randn(bn, generator=gen) * 3
    x.view(-1, qa)[::2] *= 4096.0
    y = torch.empty(1, bn)
    _fake_quant_probe[(1,)](x, y, BN=bn, QA=qa)
    blk = x.view(-1, qa)
    t = blk.abs().amax(-1).clamp_min(1e-4) * torch.tensor(1 / 448, dtype=torch.float32)
    m, e = torch.frexp(t)
    sc = torch.ldexp(torch.ones_like(t), e - (m == 0.5).int())[:, None]
    want = ((blk / sc).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sc).view(-1)
    assert torch.equal(y[0], want)


@interp_only
def test_interp_dispatch_takes_gemv_when_flag_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_experts with MOE_GEMV on: the GEMV result for <= 4 bf16 tokens, the MMA kernels for
    5 tokens (bits of moe_experts_with_config)."""
    from dsv4.ops import triton_moe as tri
    from dsv4.ops import triton_moe_gemv as gv
    gen = torch.Generator().manual_seed(3)
    ex = _fp4_experts(gen, E, D, INTER, 128)
    monkeypatch.setattr(gv, "MOE_GEMV", True)
    for T in (2, 5):
        x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
        ids, w = _routing(T, 2, gen)
        want = (gv.moe_experts_gemv(x, ids, w, ex, 10.0) if T <= 4
                else tri.moe_experts_with_config(x, ids, w, ex, 10.0, None))
        assert torch.equal(tri.moe_experts(x, ids, w, ex, 10.0), want)


@interp_only
def test_interp_errors() -> None:
    from dsv4.ops import triton_moe_gemv as gv
    gen = torch.Generator().manual_seed(1)
    ex = _fp4_experts(gen, E, D, INTER, 128)
    x = torch.randn(1, D).to(torch.bfloat16)
    ids, w = _routing(1, 2, gen)
    with pytest.raises(ValueError, match="K step"):
        gv.moe_experts_gemv(x, ids, w, ex, 10.0, gv.GemvConfig(BK=64))    # < act block 128
    with pytest.raises(ValueError, match="bf16 or fp32"):
        gv.moe_experts_gemv(x.half(), ids, w, ex, 10.0)
    assert torch.equal(gv.moe_experts_gemv(x[:0], ids[:0], w[:0], ex, 10.0), torch.zeros(0, D))


# ------------------------------------------------------------------------------ GPU
G_E, G_D, G_I, G_K = 256, 4096, 2048, 6
# The plans of the first H200 sweep (issue #5): every BK 256 / 512 plan at 4 warps was wrong and
# not run-to-run reproducible (the [BK/32, 16, 2] activation load + split + reshape, more than
# one element per thread); the BK 128 and the 8-warp plans were right.  All must pass now.
# (BN_up, BN_down, BK, split_up, split_down, warps)
GPU_PLANS = [(32, 32, 256, 2, 8, 4), (32, 32, 256, 1, 4, 4), (32, 32, 256, 4, 8, 4),
             (16, 32, 256, 4, 8, 4), (16, 16, 256, 4, 8, 4), (32, 64, 256, 2, 4, 4),
             (64, 64, 256, 2, 4, 8), (32, 32, 128, 4, 8, 4), (16, 32, 512, 2, 4, 4),
             (64, 64, 128, 4, 8, 4)]


def _gpu_routing(T: int, gen: torch.Generator):
    ids = torch.rand(T, G_E, generator=gen, device="cuda").topk(G_K, dim=-1).indices
    w = torch.rand(T, G_K, generator=gen, device="cuda") + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 1.5


def _gpu_case(T: int, seed: int):
    """V4-Flash MXFP4 stacks (row-major), bf16 x, routing with a skipped id and a shared
    expert at T >= 2, on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ex = _fp4_experts(gen, G_E, G_D, G_I, 128, device="cuda")
    x = (torch.randn(T, G_D, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    ids, w = _gpu_routing(T, gen)
    if T >= 2:
        ids[1, 3] = -1
        ids[T - 1, 0] = ids[0, 0]
    return ex, x, ids, w


def _check_gpu_plan(call, want: torch.Tensor, mma: torch.Tensor, cfg) -> torch.Tensor:
    """``call()`` twice on a NaN-poisoned allocator: finite, the same bits, the twin and the
    MMA kernels to the bf16 bound; returns the result."""
    from tests.kernels.test_gpu_kernels import _poison
    _poison()
    y = call()
    _poison()
    y2 = call()
    assert bool(torch.isfinite(y).all()) and torch.equal(y, y2), f"{cfg}: run-to-run"
    assert _rel(y, want) < BF16_BOUND and _rel(y, mma) < BF16_BOUND, \
        f"{cfg}: rel {_rel(y, want):.2e} (twin), {_rel(y, mma):.2e} (MMA)"
    return y


@needs_gpu
@pytest.mark.parametrize("T", [1, 2, 4])
def test_gpu_gemv_v4_flash(T: int) -> None:
    """Official numerics, bf16: finite everywhere, the twin and the MMA kernels to the bf16
    bound, run-to-run bits, the default plan and a split-heavy one (a skipped id at T >= 2)."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    from dsv4.ops import triton_moe_gemv as gv
    ex, x, ids, w = _gpu_case(T, 40 + T)
    want = ref.moe_experts(x, ids, w, ex, 10.0)
    mma = tri.moe_experts_with_config(x, ids, w, ex, 10.0, None)
    for cfg in (None, gv.GemvConfig(BN_up=16, BN_down=64, BK=128, split_up=8, split_down=8),
                *(gv.GemvConfig(bu, bd, bk, su, sd, wp, wp)
                  for bu, bd, bk, su, sd, wp in GPU_PLANS)):
        _check_gpu_plan(lambda: gv.moe_experts_gemv(x, ids, w, ex, 10.0, cfg), want, mma, cfg)


@needs_gpu
@pytest.mark.parametrize("T", [1, 2, 4])
def test_gpu_gemv_kchunk_v4_flash(T: int) -> None:
    """K-chunk-major stacks (the model's GPU layout) at V4-Flash widths, every plan of
    bench/moe_gemv.py's K-chunk sweep and the default: finite, the twin and the MMA kernels to
    the bf16 bound, run-to-run bits, the row-major stacks' bits, and the inputs quantized once
    per call giving the in-loop form's bits."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    from dsv4.ops import triton_moe_gemv as gv
    sweep = _load_bench("moe_gemv").SWEEP_KCHUNK
    ex, x, ids, w = _gpu_case(T, 60 + T)
    exk = ref.kchunk_experts(ex, 128)
    want = ref.moe_experts(x, ids, w, ex, 10.0)
    mma = tri.moe_experts_with_config(x, ids, w, exk, 10.0, None)
    before = gv.GEMV_PREQUANT
    try:
        for cfg in (None, *(gv.GemvConfig(bu, bd, bk, su, sd, wp, wp)
                            for bu, bd, bk, su, sd, wp in sweep)):
            gv.GEMV_PREQUANT = True
            y = _check_gpu_plan(lambda: gv.moe_experts_gemv(x, ids, w, exk, 10.0, cfg), want,
                                mma, cfg)
            if cfg is not None:
                assert torch.equal(gv.moe_experts_gemv(x, ids, w, ex, 10.0, cfg), y), \
                    f"{cfg}: row-major bits"
            gv.GEMV_PREQUANT = False
            assert torch.equal(gv.moe_experts_gemv(x, ids, w, exk, 10.0, cfg), y), \
                f"{cfg}: in-loop quantization bits"
    finally:
        gv.GEMV_PREQUANT = before


@needs_gpu
def test_gpu_gemv_decodes_agree() -> None:
    """The inline-PTX decode and the ALU decode are both exact: the same bits."""
    from dsv4.ops import triton_moe_gemv as gv
    gen = torch.Generator(device="cuda").manual_seed(9)
    ex = _fp4_experts(gen, G_E, G_D, G_I, 128, scale_lo=100, scale_hi=150, device="cuda")
    x = torch.randn(2, G_D, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = _gpu_routing(2, gen)
    before = gv.GEMV_DECODE
    try:
        gv.GEMV_DECODE = "asm"
        a = gv.moe_experts_gemv(x, ids, w, ex, 10.0)
        gv.GEMV_DECODE = "alu"
        b = gv.moe_experts_gemv(x, ids, w, ex, 10.0)
    finally:
        gv.GEMV_DECODE = before
    assert torch.equal(a, b)


@needs_gpu
@pytest.mark.parametrize("kchunk", [0, 128])
def test_gpu_gemv_cuda_graph_replay(kchunk: int) -> None:
    """moe_experts with the flag on, captured once at T = 1 (row-major and K-chunk-major
    stacks; the inputs' quantization launch inside the graph), replayed on new x / ids /
    weights written into the captured inputs: the eager call's bits each time."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    from dsv4.ops import triton_moe_gemv as gv
    gen = torch.Generator(device="cuda").manual_seed(77)
    ex = _fp4_experts(gen, G_E, G_D, G_I, 128, device="cuda")
    if kchunk:
        ex = ref.kchunk_experts(ex, kchunk)
    before = gv.MOE_GEMV
    gv.MOE_GEMV = True
    try:
        x = torch.randn(1, G_D, generator=gen, device="cuda").to(torch.bfloat16)
        ids, w = _gpu_routing(1, gen)
        sx, sids, sw = x.clone(), ids.clone(), w.clone()
        tri.moe_experts(sx, sids, sw, ex, 10.0)          # compile and size the counters first
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tri.moe_experts(sx, sids, sw, ex, 10.0)
        for seed in (1, 2, 3):
            g2 = torch.Generator(device="cuda").manual_seed(seed)
            nx = torch.randn(1, G_D, generator=g2, device="cuda").to(torch.bfloat16)
            nids, nw = _gpu_routing(1, g2)
            if seed == 3:
                nids[0, 2] = G_E + 1
            sx.copy_(nx)
            sids.copy_(nids)
            sw.copy_(nw)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, gv.moe_experts_gemv(nx, nids, nw, ex, 10.0))
    finally:
        gv.MOE_GEMV = before
