"""The FP8-MMA routed-expert path (dsv4.ops.triton_moe_fp8) on the GPU at V4-Flash widths (D 4096,
I 2048, 256 experts, top-6), official numerics, bf16: against the torch twin and the bf16 kernel
of triton_moe under both prefill tile plans, scale spreads at the scale-folded decode's limit
(11 per 128-wide K step), the fallback beyond it, the inline-PTX and ALU decodes giving the same
bytes (skipped without CUDA).  Outputs are allocated over NaN-poisoned memory so an element the
kernels never write shows up.  Off the GPU (no interpreter): the op runs the torch twin, after
the same argument checks.

Tolerance: the products are exact, but the tensor core sums each 128-wide K step in its own
reduced precision (DeepGEMM's promotion interval), so the outputs equal the twin and the bf16-MMA
kernels to a relative 2e-3 (norm-wise; see the module docstring of triton_moe_fp8), not to fp32
rounding."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from dsv4.ops import triton_moe_fp8 as f8
from tests.kernels.test_gpu_kernels import _poison, _rel

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")

DEV = "cuda"
E, D, INTER, TOPK = 256, 4096, 2048, 6


# Norm-wise relative bound against the twin and the bf16-MMA kernels (module docstring).  The
# H200 measured 3.5e-3 (2026-11-30, V4-Flash widths, 2K and 8K tokens): the tensor core's
# reduced-precision fp8 accumulation over each 128-wide step (the first guess, 2e-3, failed).
REL_BOUND = 5e-3


def _stacks(gen: torch.Generator, lo: int = 118, hi: int = 123):
    """Random MXFP4 stacks, e8m0 scales uniform in [lo, hi) (spread hi - 1 - lo at most)."""
    from dsv4.ops.torch_dense import ExpertWeights

    def stack(n: int, k: int):
        w = torch.randint(-128, 128, (E, n, k // 2), generator=gen, device=DEV, dtype=torch.int8)
        s = torch.randint(lo, hi, (E, n, k // 32), generator=gen, device=DEV)
        return w, s.to(torch.uint8).view(torch.float8_e8m0fnu)

    (w1, s1), (w3, s3), (w2, s2) = stack(INTER, D), stack(INTER, D), stack(D, INTER)
    return ExpertWeights(w1, w3, w2, 128, "fp4", s1, s3, s2, 128)


@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, sw_ptr, K: tl.constexpr, KS: tl.constexpr,
                   BN: tl.constexpr, ASM: tl.constexpr):
    """The K steps of one expert's rows decoded by _mxfp4_e4m3_step (bytes, step factors)."""
    rn = tl.arange(0, BN)
    e = tl.program_id(0)
    for k0 in range(0, K, KS):
        w8, sw = f8._mxfp4_e4m3_step(w_ptr, s_ptr, e, rn, rn < BN, k0, 0, K // 2, 0, K // 32,
                                     ASM, BN, KS)
        rk = k0 + tl.arange(0, KS)
        tl.store(out_ptr + rn[:, None] * K + rk[None, :], w8.to(tl.uint8, bitcast=True))
        tl.store(sw_ptr + rn * (K // KS) + k0 // KS, sw)


def _routing(T: int, gen: torch.Generator):
    ids = torch.rand(T, E, generator=gen, device=DEV).topk(TOPK, dim=-1).indices
    w = torch.rand(T, TOPK, generator=gen, device=DEV) + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 1.5


def _prefill_inputs(T: int, seed: int):
    """x [T, D] bf16 and a random routing (weights summing to 1.5) with one skipped pick."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(T, D, generator=gen, device=DEV) * 2).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    ids[7, 2] = -1
    return x, ids, w


@needs_gpu
@pytest.mark.parametrize("plan", ["pick", "bm64", "bm128"])
def test_fp8mma_prefill_gpu(plan: str) -> None:
    """2048 tokens (a skipped pick, an id of another shard): finite everywhere, the twin and
    triton_moe.moe_experts to REL_BOUND (same exact products, the tensor core's 128-wide sums,
    other fp32 orders: the bf16 roundings of the intermediates may flip)."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    from dsv4.ops import triton_moe_fp8 as f8
    cfg = {"pick": None, "bm64": f8.pick_fp8mma_config(2048 * TOPK, E),
           "bm128": f8.pick_fp8mma_config(8192 * TOPK, E)}[plan]
    T = 2048
    gen = torch.Generator(device=DEV).manual_seed(31)
    ex = _stacks(gen)
    x = (torch.randn(T, D, generator=gen, device=DEV) * 2).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    ids[3, 1] = -1
    ids[5, 0] = E + 7
    _poison()
    y = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, cfg)
    assert y.shape == (T, D) and bool(torch.isfinite(y).all())
    assert f8.fold_spread_ok(ex, 128)
    r_ref = _rel(y, ref.moe_experts(x, ids, w, ex, 10.0))
    r_bf16 = _rel(y, tri.moe_experts(x, ids, w, ex, 10.0))
    assert r_ref < REL_BOUND and r_bf16 < REL_BOUND, (r_ref, r_bf16)
    # Bit-reproducible run to run (no atomics, fixed order).
    assert torch.equal(y, f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, cfg))


@needs_gpu
@pytest.mark.parametrize("plan", ["pick", "bm128"])
def test_fp8mma_predecoded_gpu(plan: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The predecoded path (experts re-encoded to e4m3 codes 18 at a time in two slots, the
    re-encoding on its own stream; in order: 37 at a time; short last chunks; its own plan and
    the in-loop decode's 8K plan) against the in-loop decode under the same plan (same bytes and
    dots: to 1e-6, bit-equal expected), in order (bit-equal) and the twin (REL_BOUND); the op
    table's route (triton_moe.moe_experts with FP8MMA_PREFILL) takes it."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    from dsv4.ops import triton_moe_fp8 as f8
    cfg = {"pick": f8.PLAN_PREDECODED, "bm128": f8.PLAN_LARGE}[plan]
    monkeypatch.setattr(f8, "PREDECODE_BYTES", 2 * INTER * D * 37)
    ex = _stacks(torch.Generator(device=DEV).manual_seed(41))
    T = 2048
    x, ids, w = _prefill_inputs(T, 42)
    _poison()
    y_pre = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, cfg, predecode=True)
    y_loop = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, cfg, predecode=False)
    assert bool(torch.isfinite(y_pre).all())
    # The re-encoding on its own stream next to the GEMMs (two slots of 18 experts: 15
    # chunks) against the same in order (one slot of 37): the same bits.
    monkeypatch.setattr(f8, "PREDECODE_OVERLAP", not f8.PREDECODE_OVERLAP)
    y_other = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, cfg, predecode=True)
    monkeypatch.setattr(f8, "PREDECODE_OVERLAP", not f8.PREDECODE_OVERLAP)
    assert torch.equal(y_pre, y_other)
    print(f"predecoded == in-loop decode: {torch.equal(y_pre, y_loop)}")
    assert _rel(y_pre, y_loop) < 1e-6
    assert _rel(y_pre, ref.moe_experts(x, ids, w, ex, 10.0)) < REL_BOUND
    monkeypatch.setattr(f8, "FP8MMA_PREFILL", True)
    monkeypatch.setattr(f8, "FP8MMA_PREDECODE", True)
    monkeypatch.setattr(f8, "MIN_PAIRS_PER_EXPERT", 32)
    assert f8.fp8mma_applies(x, ids, ex)
    if cfg == f8.pick_fp8mma_config(T * TOPK, E, predecode=True):
        assert torch.equal(tri.moe_experts(x, ids, w, ex, 10.0), y_pre)


@needs_gpu
def test_fp8mma_kept_codes_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """V4-Flash stacks with their FP8 re-encoding kept (encode_fp8_codes, the engine option
    moe_fp8_codes): the codes equal the per-call re-encoding's bytes, the expert call on them
    gives the re-encoding path's bits at 2048 tokens (a skipped pick), and the op table takes
    the FP8-MMA path from MIN_PAIRS_KEPT pairs an expert."""
    from dataclasses import replace

    from dsv4.ops import triton_moe as tri
    ex = _stacks(torch.Generator(device=DEV).manual_seed(61))
    codes = f8.encode_fp8_codes(ex)
    assert codes is not None
    q = torch.empty_like(codes.q2)
    f = torch.empty_like(codes.f2)
    w2, s2, _ = tri._weight_args(ex, "w2")
    f8._predecode(w2, s2, q, f, 0, E, True, 128, kchunk=bool(ex.kchunk))
    assert torch.equal(q.view(torch.uint8), codes.q2.view(torch.uint8))
    assert torch.equal(f, codes.f2)
    kept = replace(ex, fp8_codes=codes)
    x, ids, w = _prefill_inputs(2048, 62)
    _poison()
    y_kept = f8.moe_experts_fp8mma(x, ids, w, kept, 10.0, predecode=True)
    y_pre = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, predecode=True)
    assert bool(torch.isfinite(y_kept).all())
    assert torch.equal(y_kept, y_pre)
    monkeypatch.setattr(f8, "FP8MMA_PREFILL", True)
    monkeypatch.setattr(f8, "FP8MMA_PREDECODE", True)
    monkeypatch.setattr(f8, "MIN_PAIRS_KEPT", 48)
    assert f8.fp8mma_applies(x, ids, kept) and not f8.fp8mma_applies(x, ids, ex)
    assert torch.equal(tri.moe_experts(x, ids, w, kept, 10.0), y_kept)


@needs_gpu
def test_fp8mma_encode_ahead_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """encode_ahead at V4-Flash widths (8,192 tokens): the codes come from the side stream
    with an event, equal the kept codes' bytes once it is waited on, and the op table's call on
    them (waiting on its own) gives the in-call re-encoding's bits, also when the current
    stream is busy with other work first and a second layer's re-encoding reuses the scratch
    right after the first call."""
    from dataclasses import replace

    from dsv4.ops import triton_moe as tri
    monkeypatch.setattr(f8, "FP8MMA_PREFILL", True)
    monkeypatch.setattr(f8, "FP8MMA_PREDECODE", True)
    monkeypatch.setattr(f8, "AHEAD", True)
    monkeypatch.setattr(f8, "_ahead_scratch", {})
    gen = torch.Generator(device=DEV).manual_seed(63)
    ex, ex2 = _stacks(gen), _stacks(gen)
    x, ids, w = _prefill_inputs(8192, 64)
    want = tri.moe_experts(x, ids, w, ex, 10.0)
    want2 = tri.moe_experts(x, ids, w, ex2, 10.0)
    busy = torch.randn(8192, 8192, device=DEV)
    _poison()
    codes = tri.moe_encode_ahead(ex, 8192, TOPK)
    assert codes is not None and codes.ready is not None
    for _ in range(4):
        busy = busy @ busy / 100.0       # the "attention" issued between start and call
    got = tri.moe_experts(x, ids, w, replace(ex, fp8_codes=codes), 10.0)
    codes2 = tri.moe_encode_ahead(ex2, 8192, TOPK)
    assert codes2.q1.data_ptr() == codes.q1.data_ptr()      # the same scratch
    got2 = tri.moe_experts(x, ids, w, replace(ex2, fp8_codes=codes2), 10.0)
    assert bool(torch.isfinite(got).all()) and torch.equal(got, want)
    assert torch.equal(got2, want2)
    torch.cuda.current_stream().wait_event(codes2.ready)
    kept = f8.encode_fp8_codes(ex2)
    for name in ("q1", "q3", "q2"):
        assert torch.equal(getattr(codes2, name).view(torch.uint8),
                           getattr(kept, name).view(torch.uint8))
    for name in ("f1", "f3", "f2"):
        assert torch.equal(getattr(codes2, name), getattr(kept, name))
    assert tri.moe_encode_ahead(ex, 1024, TOPK) is None            # below the pair threshold


@needs_gpu
def test_fp8mma_predecode_tiles_same_bytes_gpu() -> None:
    """Every re-encoding tile of bench/moe_prefill_fp8.py's sweep writes the same codes and
    factors (w2-shaped stacks of 3 experts: N = D, K = I), the hoisted-load tiles included,
    from row-major and K-chunk-major stacks."""
    import importlib.util
    from pathlib import Path

    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    from dsv4.ops import triton_moe_fp8 as f8
    bench_file = Path(__file__).resolve().parents[2] / "bench" / "moe_prefill_fp8.py"
    spec = importlib.util.spec_from_file_location("moe_prefill_fp8_bench", bench_file)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = _stacks(torch.Generator(device=DEV).manual_seed(43))
    outs = []
    for ex in (rows, ref.kchunk_experts(rows, 128)):
        w2, s2, _ = tri._weight_args(ex, "w2")
        for tile in bench.PREDECODE_TILES:
            q = torch.full((3, D, INTER), 0x7F, dtype=torch.uint8, device=DEV)
            f = torch.full((3, INTER // 128, D), float("nan"), device=DEV)
            f8._predecode(w2, s2, q.view(torch.float8_e4m3fn), f, 5, 8, True, 128, tile,
                          bool(ex.kchunk))
            outs.append((q, f))
    q0, f0 = outs[0]
    assert not bool((q0 == 0x7F).any()) and bool(torch.isfinite(f0).all())
    for q, f in outs[1:]:
        assert torch.equal(q, q0) and torch.equal(f, f0)


def _run(T: int, ex, seed: int, cfg=None):
    from dsv4.ops import triton_moe_fp8 as f8
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(T, D, generator=gen, device=DEV) * 2).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    _poison()
    return x, ids, w, f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, cfg)


@needs_gpu
def test_fp8mma_spread_at_the_limit_gpu() -> None:
    """Scales uniform over 12 exponents (spread 11 = FOLD_SPREAD inside most 128-wide steps):
    still the scale-folded path, to REL_BOUND; the ALU decode (DSV4_FP8MMA_DECODE=alu) gives
    the same bytes, so bit-equal outputs."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    from dsv4.ops import triton_moe_fp8 as f8
    ex = _stacks(torch.Generator(device=DEV).manual_seed(5), 112, 124)
    assert f8.scale_spread(ex.s1, 128) == f8.FOLD_SPREAD and f8.fold_spread_ok(ex, 128)
    x, ids, w, y = _run(1024, ex, 6)
    assert bool(torch.isfinite(y).all())
    r_ref = _rel(y, ref.moe_experts(x, ids, w, ex, 10.0))
    r_bf16 = _rel(y, tri.moe_experts(x, ids, w, ex, 10.0))
    assert r_ref < REL_BOUND and r_bf16 < REL_BOUND, (r_ref, r_bf16)
    saved = f8.FP8MMA_DECODE
    f8.FP8MMA_DECODE = "alu"
    try:
        y_alu = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0)
    finally:
        f8.FP8MMA_DECODE = saved
    assert torch.equal(y, y_alu)


@needs_gpu
def test_fp8mma_too_wide_spread_falls_back_gpu() -> None:
    """One (expert, row, step) of s2 at spread FOLD_SPREAD + 1: the call runs the bf16-MMA
    kernels (bit-equal to triton_moe.moe_experts_with_config) and equals the twin."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    from dsv4.ops import triton_moe_fp8 as f8
    ex = _stacks(torch.Generator(device=DEV).manual_seed(7))
    ex.s2.view(torch.uint8)[9, 100, 4:8] = torch.tensor([110, 111, 110 + f8.FOLD_SPREAD + 1, 112],
                                                        dtype=torch.uint8, device=DEV)
    assert not f8.fold_spread_ok(ex, 128)
    x, ids, w, y = _run(512, ex, 8)
    assert torch.equal(y, tri.moe_experts_with_config(x, ids, w, ex, 10.0, None))
    assert _rel(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-2
    assert not f8.fp8mma_applies(x, ids, ex)


@needs_gpu
@pytest.mark.parametrize("KS", [128, 32])
def test_fp8mma_asm_and_alu_decode_same_bytes_gpu(KS: int) -> None:
    """The inline-PTX decode and the ALU decode of one K step give the same e4m3 bytes for all
    256 byte values and spreads 0..11, and the same step factors."""
    gen = torch.Generator(device=DEV).manual_seed(KS)
    BN, K = 64, 1024
    w = torch.randint(0, 256, (BN, K // 2), generator=gen, device=DEV, dtype=torch.int32)
    w[:, :256] = torch.arange(256, device=DEV)
    w = w.to(torch.uint8)
    s = (100 + torch.randint(0, 12, (BN, K // 32), generator=gen, device=DEV)).to(torch.uint8)
    outs = []
    for asm in (True, False):
        out = torch.empty(BN, K, dtype=torch.uint8, device=DEV)
        sw = torch.empty(BN, K // KS, device=DEV)
        _decode_kernel[(1,)](w, s, out, sw, K=K, KS=KS, BN=BN, ASM=asm)
        outs.append((out, sw))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the interpreter runs the kernels on CPU tensors")
def test_cpu_runs_the_twin() -> None:
    """CPU tensors without the interpreter: exactly the twin; the path's requirements still
    raise (it would not apply on the GPU either)."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe_fp8 as f8
    gen = torch.Generator().manual_seed(0)
    e, d, inter = 4, 64, 64

    def stack(n: int, k: int):
        w = torch.randint(-128, 128, (e, n, k // 2), generator=gen, dtype=torch.int8)
        s = torch.randint(120, 126, (e, n, k // 32), generator=gen)
        return w, s.to(torch.uint8).view(torch.float8_e8m0fnu)

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, d), stack(inter, d), stack(d, inter)
    ex = ref.ExpertWeights(w1, w3, w2, 32, "fp4", s1, s3, s2)
    x = torch.randn(5, d, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, -1], [3, 3], [1, 0], [2, 1]])
    w = torch.rand(5, 2, generator=gen)
    assert torch.equal(f8.moe_experts_fp8mma(x, ids, w, ex, 10.0),
                       ref.moe_experts(x, ids, w, ex, 10.0))
    with pytest.raises(ValueError, match="bf16"):
        f8.moe_experts_fp8mma(x.float(), ids, w, ex, 10.0)


@needs_gpu
@pytest.mark.parametrize("T", [2048, 8192])
def test_n_tiles_first_same_bits_gpu(T: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """triton_moe.N_FIRST (each row block's N tiles first) at V4-Flash widths: the bf16-MMA
    grouped kernels (a 2K chunk's path) and the FP8-MMA kernels, re-encoded per call and on
    kept codes, give the block-first bits, finite everywhere."""
    from dataclasses import replace

    from dsv4.ops import triton_moe as tri
    from dsv4.ops import triton_moe_fp8 as f8
    ex = _stacks(torch.Generator(device=DEV).manual_seed(71))
    kept = replace(ex, fp8_codes=f8.encode_fp8_codes(ex))
    x, ids, w = _prefill_inputs(T, 72)
    calls = [lambda: tri.moe_experts_with_config(x, ids, w, ex, 10.0, None),
             lambda: f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, predecode=True),
             lambda: f8.moe_experts_fp8mma(x, ids, w, kept, 10.0, predecode=True)]
    for call in calls:
        monkeypatch.setattr(tri, "N_FIRST", 0)
        _poison()
        want = call()
        monkeypatch.setattr(tri, "N_FIRST", 1)
        _poison()
        got = call()
        assert bool(torch.isfinite(got).all())
        assert torch.equal(got, want)


@needs_gpu
@pytest.mark.parametrize("mode", ["default", "plain", "lag", "ws", "ws_skip"])
def test_fp8mma_gluon_gemms_gpu(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon GEMMs on FP8 codes (dsv4.ops.gluon_moe_prefill, DSV4_FP8MMA_GLUON) at
    V4-Flash widths: the expert call on kept codes and on the per-call re-encoding (two chunks,
    short last one) gives the Triton kernels' bits at 2,048 tokens (a skipped pick; outputs over
    NaN-poisoned memory), with the default plans (warp-specialized), with both GEMMs' rescale
    lagging a step, warp-specialized with 4 stages, and with the blocks of other chunks skipped
    before the ring (WS_SKIP)."""
    from dataclasses import replace

    from dsv4.ops import gluon_moe_prefill as gp
    if not gp.HAVE_GLUON or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs Gluon and an sm_90 GPU")
    if mode == "plain":
        monkeypatch.setattr(gp, "PLAN_UP", replace(gp.PLAN_UP, BN=64, ws=False))
        monkeypatch.setattr(gp, "PLAN_DOWN", replace(gp.PLAN_DOWN, BN=128, ws=False))
    elif mode == "lag":
        monkeypatch.setattr(gp, "PLAN_UP", replace(gp.PLAN_UP, BN=32, lag=True, ws=False))
        monkeypatch.setattr(gp, "PLAN_DOWN", replace(gp.PLAN_DOWN, BN=64, lag=True, ws=False))
    elif mode == "ws":
        monkeypatch.setattr(gp, "PLAN_UP", replace(gp.PLAN_UP, BN=128, stages=4, ws=True))
        monkeypatch.setattr(gp, "PLAN_DOWN", replace(gp.PLAN_DOWN, BN=256, stages=4, ws=True))
    elif mode == "ws_skip":
        monkeypatch.setattr(gp, "WS_SKIP", True)
    monkeypatch.setattr(f8, "PREDECODE_BYTES", 2 * INTER * D * 150)
    ex = _stacks(torch.Generator(device=DEV).manual_seed(71))
    codes = f8.encode_fp8_codes(ex)
    assert codes is not None
    x, ids, w = _prefill_inputs(2048, 72)
    for stacks in (replace(ex, fp8_codes=codes), ex):
        monkeypatch.setattr(gp, "GLUON_PREFILL", "0")
        want = f8.moe_experts_fp8mma(x, ids, w, stacks, 10.0, predecode=True)
        monkeypatch.setattr(gp, "GLUON_PREFILL", "1")
        _poison()
        got = f8.moe_experts_fp8mma(x, ids, w, stacks, 10.0, predecode=True)
        assert bool(torch.isfinite(got).all())
        assert torch.equal(got, want), _rel(got, want)


@needs_gpu
@pytest.mark.parametrize("T, form", [(2048, "default"), (8192, "default"), (8192, "dec"),
                                     (8192, "plain64"), (2048, "pdec"), (8192, "pdec"),
                                     (8192, "chain")])
def test_fp8mma_mx_gemms_gpu(T: int, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon GEMMs on the MXFP4 stacks (dsv4.ops.gluon_moe_mxfp4, DSV4_FP8MMA_MX) at
    V4-Flash widths give the per-call re-encoding's bits (outputs over NaN-poisoned memory,
    finite): the same products, each k32 MMA summing the same 32 in another order, which the
    tensor cores' sum does not depend on.  Forms: the default plans (at 2K tokens, 48 pairs an
    expert, the plain 64-row plans of small calls; at 8K the up GEMM's persistent decode
    warpgroup, the plain down GEMM, 128-row blocks) and, at every size, both GEMMs with a
    non-persistent
    decode warpgroup, both plain with 64-row blocks, both persistent (one program an SM
    walking the tiles, the weight tiles brought by TMA), both persistent with chained
    products."""
    from dataclasses import replace

    from dsv4.ops import gluon_moe_mxfp4 as mx
    if not mx.HAVE_GLUON or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs Gluon and an sm_90 GPU")
    if form != "default":
        monkeypatch.setattr(mx, "SMALL_PAIRS", 0)     # the form's plans at every size
    if form == "dec":
        monkeypatch.setattr(mx, "PLAN_UP", mx.MxPlan(BM=128, stages=4, dec=True))
        monkeypatch.setattr(mx, "PLAN_DOWN", mx.MxPlan(BM=128, dec=True))
    elif form in ("pdec", "chain"):
        plan = mx.MxPlan(BM=128, stages=4, dec=True, persist=True)
        monkeypatch.setattr(mx, "PLAN_UP", replace(plan, chain=0 if form == "pdec" else 2))
        monkeypatch.setattr(mx, "PLAN_DOWN", replace(plan, chain=0 if form == "pdec" else 4))
    elif form == "plain64":
        monkeypatch.setattr(mx, "PLAN_UP", mx.MxPlan(BM=64))
        monkeypatch.setattr(mx, "PLAN_DOWN", mx.MxPlan(BM=64))
    # K-chunk-major (random bytes either way), group exponents spread over the fold's full
    # range (11).
    ex = replace(_stacks(torch.Generator(device=DEV).manual_seed(73), 115, 127), kchunk=128)
    x, ids, w = _prefill_inputs(T, 74)
    monkeypatch.setattr(mx, "MX_PREFILL", False)
    want = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, predecode=True)
    monkeypatch.setattr(mx, "MX_PREFILL", True)
    _poison()
    got = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, predecode=True)
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got, want), _rel(got, want)
