"""The routing-plan kernel and the MXFP4 expert GEMMs under every tile plan bench/moe_decode.py
sweeps (split-K plans included), on the GPU at V4-Flash shapes (D 4096, I 2048, 256 experts,
top-6), against the torch twins (skipped without CUDA).  Outputs are allocated over NaN-poisoned
memory so an element the kernels never write shows up."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from tests.kernels.test_gpu_kernels import _poison, _rel

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")

DEV = "cuda"
E, D, INTER, TOPK = 256, 4096, 2048, 6
BENCH = Path(__file__).resolve().parents[2] / "bench" / "moe_decode.py"


def _sweep_plans(T: int):
    """bench/moe_decode.py's plans at ``T`` tokens (default first; bench/ is not a package)."""
    from dsv4.ops import triton_moe as tri
    spec = importlib.util.spec_from_file_location("moe_decode_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.sweep_plans(T, tri.pick_moe_config(T * TOPK, E, D, INTER, 128), D, INTER)


def _stacks(gen: torch.Generator, act_block):
    from dsv4.ops.torch_dense import ExpertWeights

    def stack(n: int, k: int):
        w = torch.randint(-128, 128, (E, n, k // 2), generator=gen, device=DEV, dtype=torch.int8)
        s = torch.randint(118, 123, (E, n, k // 32), generator=gen, device=DEV)
        return w, s.to(torch.uint8).view(torch.float8_e8m0fnu)

    (w1, s1), (w3, s3), (w2, s2) = stack(INTER, D), stack(INTER, D), stack(D, INTER)
    return ExpertWeights(w1, w3, w2, act_block, "fp4", s1, s3, s2, 128)


def _routing(T: int, gen: torch.Generator):
    ids = torch.rand(T, E, generator=gen, device=DEV).topk(TOPK, dim=-1).indices
    w = torch.rand(T, TOPK, generator=gen, device=DEV) + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 1.5


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("T,BM", [(1, 16), (16, 16), (64, 16), (256, 16), (8192, 64), (777, 32),
                                  (32768, 128)])
def test_plan_kernel_equals_twin_gpu(T: int, BM: int, chunked: bool) -> None:
    """Both forms past decode sizes (one program per expert; the chunked kernels)."""
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(T)
    ids, _ = _routing(T, gen)
    if T > 2:
        ids[1, 2] = -1
        ids[2, 0] = E + 5
    _poison()
    pairs, bexp = tri.moe_plan(ids, E, BM, chunked=chunked)
    pairs_ref, bexp_ref = tri.moe_plan_torch(ids, E, BM)
    assert torch.equal(pairs, pairs_ref) and torch.equal(bexp, bexp_ref)
    p32, b32 = tri.moe_plan(ids.to(torch.int32), E, BM, chunked=chunked)
    assert torch.equal(p32, pairs_ref) and torch.equal(b32, bexp_ref)


def test_plan_kernel_in_a_cuda_graph() -> None:
    """Captured once, replayed on new ids written into the captured input: the twin's plan."""
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(5)
    ids, _ = _routing(64, gen)
    static = ids.clone()
    tri.moe_plan(static, E, 16)                    # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pairs, bexp = tri.moe_plan(static, E, 16)
    for seed in (6, 7):
        new, _ = _routing(64, torch.Generator(device=DEV).manual_seed(seed))
        static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        ref_pairs, ref_bexp = tri.moe_plan_torch(new, E, 16)
        assert torch.equal(pairs, ref_pairs) and torch.equal(bexp, ref_bexp)


@pytest.mark.parametrize("T", [1, 2, 10])
def test_plan_prep_fused_gpu(T: int) -> None:
    """Decode (<= 64 pairs): the one-launch plan + activation prep equals the twin's plan and
    moe_prep's rows, eagerly and replayed from a CUDA graph on new inputs."""
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(50 + T)
    ids, _ = _routing(T, gen)
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)

    def check(pairs, bexp, xs) -> None:
        ref_pairs, ref_bexp = tri.moe_plan_torch(ids, E, 16)
        assert torch.equal(pairs, ref_pairs) and torch.equal(bexp, ref_bexp)
        ref = torch.zeros_like(xs)
        tri.moe_prep(x, pairs, bexp, ref, T * TOPK, E, TOPK, True, 1, True, 16, 128)
        real = pairs < T * TOPK
        assert torch.equal(xs[real], ref[real])

    check(*tri.moe_plan_prep(x, ids, E, 16, 1, True, 128))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.moe_plan_prep(x, ids, E, 16, 1, True, 128)
    for seed in (51, 52):
        g = torch.Generator(device=DEV).manual_seed(seed)
        new, _ = _routing(T, g)
        ids.copy_(new)
        x.copy_(torch.randn(T, D, generator=g, device=DEV).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        check(*out)


@pytest.mark.parametrize("T", [1, 7, 64, 256, 2048])
def test_default_plan_gpu(T: int) -> None:
    """Official numerics (act_block 128), bf16 compute, the kernel path under the default plan
    (2048 tokens: 32-row blocks, where moe_experts may take the grouped path): against the twin;
    every output element written and finite."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(100 + T)
    ex = _stacks(gen, 128)
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    if T == 7:
        ids[3, 1] = -1
    _poison()
    y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, None)
    assert y.shape == (T, D) and bool(torch.isfinite(y).all())
    assert _rel(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-2


# Decode and prefill-sized token counts: every alternative plan of the bench's sweep (1 and 16
# tokens: its split-K plans too; compiling them here also warms the Triton cache for the
# moe_decode stage of the session).
@pytest.mark.parametrize("T,twin_rows", [(1, 1), (16, 16), (64, 64), (1024, 128)])
def test_sweep_plans_gpu(T: int, twin_rows: int) -> None:
    """Each plan of bench/moe_decode.py's sweep: finite everywhere, the twin on the first rows
    (rows are independent), and agreeing with the default plan on all rows."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(200 + T)
    ex = _stacks(gen, 128)
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    y_ref = ref.moe_experts(x[:twin_rows], ids[:twin_rows], w[:twin_rows], ex, 10.0)
    plans = _sweep_plans(T)
    assert len(plans) >= 5
    y_default = tri.moe_experts_with_config(x, ids, w, ex, 10.0, plans[0])
    for cfg in plans:
        _poison()
        y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
        assert bool(torch.isfinite(y).all()), cfg
        assert _rel(y[:twin_rows], y_ref) < 1e-2, cfg
        # Same products, another fp32 order: the bf16 roundings of the intermediates may flip.
        assert _rel(y, y_default) < 1e-2, cfg


def test_fp32_compute_gpu() -> None:
    """fp32 compute: no bf16 rounding points, so kernel and twin differ only in fp32 order."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(9)
    ex = _stacks(gen, 128)
    x = torch.randn(5, D, generator=gen, device=DEV)
    ids, w = _routing(5, gen)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        y_ref = ref.moe_experts(x, ids, w, ex, 10.0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    _poison()
    y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, tri.MoeConfig(16, 64, 128))
    assert bool(torch.isfinite(y).all())
    assert _rel(y, y_ref) < 1e-5


def _counters_clean() -> bool:
    from dsv4.ops import triton_dense as td
    torch.cuda.synchronize()
    return all(not bool(b.any()) for b in td._splitk_counter_cache.values())


@pytest.mark.parametrize("T", [1, 3])
def test_split_k_bit_reproducible_gpu(T: int) -> None:
    """The default decode plan splits K (1 token: up 4 / down 4) and a forced 3/3 plan (ragged
    shares): bit-identical over two identical calls (fixed summation order whatever the
    arrival order), close to the unsplit plan and the twin, every output written, all arrival
    counters back to 0; the same with fp32 compute against the fp32 twin."""
    from dataclasses import replace

    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(300 + T)
    ex = _stacks(gen, 128)
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    base = tri.pick_moe_config(T * TOPK, E, D, INTER, 128)
    assert base.split_up > 1 or base.split_down > 1, base
    y_ref = ref.moe_experts(x, ids, w, ex, 10.0)
    unsplit = tri.moe_experts_with_config(x, ids, w, ex, 10.0,
                                          replace(base, split_up=1, split_down=1))
    for cfg in (base, replace(base, split_up=3, split_down=3)):
        _poison()
        y1 = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
        y2 = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
        assert bool(torch.isfinite(y1).all()) and torch.equal(y1, y2), cfg
        assert _rel(y1, y_ref) < 1e-2 and _rel(y1, unsplit) < 1e-2, cfg
        assert _counters_clean(), cfg
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        y32_ref = ref.moe_experts(x.float(), ids, w, ex, 10.0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    y32 = tri.moe_experts_with_config(x.float(), ids, w, ex, 10.0,
                                      replace(base, split_up=4, split_down=3))
    assert _rel(y32, y32_ref) < 1e-5 and _counters_clean()


def replays_match_eager(ex, cfg, seed: int) -> None:
    """A one-token expert call under plan ``cfg`` captured after its warm-up, replayed on new
    inputs written into the captured ones: each replay equals the eager call bit for bit, and
    the split-K counters end clean (shared by the expert GPU test files)."""
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(1, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(1, gen)
    tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)      # warm-up: compile, counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    for new_seed in (seed + 1, seed + 2, seed + 3):
        g = torch.Generator(device=DEV).manual_seed(new_seed)
        x.copy_(torch.randn(1, D, generator=g, device=DEV).to(torch.bfloat16))
        new_ids, new_w = _routing(1, g)
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)), new_seed
    assert _counters_clean()


def test_split_k_in_a_cuda_graph() -> None:
    """The one-token split-K default plan (the counters start clean every replay)."""
    from dsv4.ops import triton_moe as tri
    cfg = tri.pick_moe_config(TOPK, E, D, INTER, 128)
    assert cfg.split_up > 1
    replays_match_eager(_stacks(torch.Generator(device=DEV).manual_seed(400), 128), cfg, 400)


@pytest.mark.parametrize("T", [1, 16, 64, 8192])
def test_fold_decode_bit_identical_gpu(T: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-multiply MXFP4 decode (every scale byte <= 128) against the two-multiply one, at
    V4-Flash widths under the default plan of T tokens (split-K at 1 token, 16-row blocks at
    16 and 64, 64-row blocks at 8192) and under a 128-row / 8-warp plan: bit for bit, both
    numerics (plain and the FP8 act block)."""
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(500 + T)
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    plans = [None, tri.MoeConfig(128, 128, 128, warps_up=8, warps_down=8)] if T >= 64 else [None]
    for act_block in (None, 128):
        ex = _stacks(gen, act_block)
        # Scales from the smallest byte to the largest the fold takes (rows of expert 0..).
        s2 = ex.s2.view(torch.uint8)
        s2[:, :, 0] = torch.arange(0, 129, device=DEV, dtype=torch.uint8).repeat(D // 129 + 1)[:D]
        assert tri._fold_ok(ex)
        for cfg in plans:
            monkeypatch.setattr(tri, "FP4_FOLD", False)
            y_two = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
            monkeypatch.setattr(tri, "FP4_FOLD", True)
            _poison()
            y_one = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
            assert torch.equal(y_one, y_two), (act_block, cfg)
            assert bool(torch.isfinite(y_one).all())


def test_fold_check_large_scales_and_capture_gpu() -> None:
    """A stack with a scale byte above 128 takes the two-multiply decode (still the twin); a
    stack first seen inside a CUDA-graph capture takes it too (no host sync in the capture),
    and its replay equals the eager call."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(600)
    ex = _stacks(gen, 128)
    ex.s1.view(torch.uint8)[3, 5, 7] = 150
    assert not tri._fold_ok(ex)
    x = torch.randn(16, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(16, gen)
    ids[0, 0] = 3
    y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, None)
    assert _rel(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-2
    fresh = _stacks(torch.Generator(device=DEV).manual_seed(601), 128)
    cfg = tri.pick_moe_config(16 * TOPK, E, D, INTER, 128)
    # Compile both variants outside the capture, on another stack with the same layout.
    other = _stacks(torch.Generator(device=DEV).manual_seed(602), 128)
    tri.moe_experts_with_config(x, ids, w, other, 10.0, cfg)
    tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = tri.moe_experts_with_config(x, ids, w, fresh, 10.0, cfg)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, tri.moe_experts_with_config(x, ids, w, fresh, 10.0, cfg))
