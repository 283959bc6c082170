"""The decode experts on FP8 wgmma with the MXFP4 codes decoded in registers
(dsv4.ops.gluon_moe_decode) on an sm_90 GPU at V4-Flash widths (256 K-chunk-major experts,
top-6, official numerics) and at toy widths (one split): the torch twin agrees within the
FP8-MMA bound of the prefill experts (the tensor cores' FP8 accumulation, ~2.5e-5 of each GEMM,
flips a few e4m3 roundings of the activation between the GEMMs: the H100 measured 1e-3 to
2.5e-3 at 1-10 tokens; 64 tokens for the measurements past one token); every output element
is written (NaN-poisoned memory); skipped picks (ids outside 0..E-1) are left out; the GEMMs
quantizing their own activation (three launches) give the five-launch chain's bits (its two
Triton kernels equal ``act_quant`` in the interpreter tests), with PDL and without, also when
one token picks an expert twice (two rows of one block); the shared expert's sum matches; a
CUDA-graph replay on new inputs equals the eager call bit for bit and the split-K counters end
clean; the op table routes one-token calls to it under the flag (on by
default).  Skipped without an sm_90 GPU and Gluon."""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.test_gpu_kernels import _poison, _rel
from tests.kernels.test_moe_fast import D, DEV, E, TOPK, _counters_clean, _routing, _stacks


# tests/kernels/test_moe_fp8mma_gpu.py's bound for the FP8-MMA experts against the twin.
REL_BOUND = 5e-3


def _sm90() -> bool:
    return (torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability() == (9, 0))


pytestmark = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (TRITON_INTERPRET unset)")


def _experts(seed: int):
    from dsv4.ops import torch_dense as ref
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return ref.kchunk_experts(_stacks(gen, 128), 128), gen


@pytest.mark.parametrize("T", [1, 2, 4, 10, 64])
def test_wgmma_decode_matches_the_twin_gpu(T: int) -> None:
    from dsv4.ops import gluon_moe_decode as gm
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    ch, gen = _experts(1100 + T)
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    if T >= 4:
        ids[2, 1] = -1                     # another shard's pick: skipped
    _poison()
    got = gm.moe_experts_wgmma(x, ids, w, ch, 10.0)
    assert bool(torch.isfinite(got).all())
    twin = ref.moe_experts(x, ids, w, ch, 10.0)
    grouped = tri.moe_experts_with_config(x, ids, w, ch, 10.0,
                                          tri.pick_moe_config(T * TOPK, E, D, ch.inter_dim, 128))
    err, err_grouped = _rel(got, twin), _rel(grouped, twin)
    assert err < REL_BOUND and err_grouped < 1e-3, (err, err_grouped)
    assert _counters_clean()


@pytest.mark.parametrize("T", [1, 2, 10, 64])
def test_fused_fill_gives_the_launch_chains_bits_gpu(T: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4.ops import gluon_moe_decode as gm
    ch, gen = _experts(1500 + T)
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    ids[0, 1] = ids[0, 0]                  # one expert picked twice: two rows of its block
    if T > 1:
        ids[1, 2] = -1
    monkeypatch.setattr(gm, "FUSED_FILL", False)
    chain = gm.moe_experts_wgmma(x, ids, w, ch, 10.0)
    monkeypatch.setattr(gm, "FUSED_FILL", True)
    for pdl in ("1", "0"):
        monkeypatch.setenv("DSV4_PDL", pdl)
        _poison()
        got = gm.moe_experts_wgmma(x, ids, w, ch, 10.0)
        assert torch.equal(got, chain), (pdl, _rel(got, chain))
    assert _counters_clean()


@pytest.mark.parametrize("T", [1, 2])
def test_toy_widths_one_split_gpu(T: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/flash_bench.py --tiny's expert widths (D 256, I 128, 16 experts): the whole K in
    one split (no partials), two chunks and one."""
    from bench.moe_decode import mxfp4_stacks
    from dsv4.ops import gluon_moe_decode as gm
    from dsv4.ops import torch_dense as ref
    gen = torch.Generator(device=DEV).manual_seed(1600 + T)
    ex = mxfp4_stacks(16, 256, 128, gen, DEV, kchunk=True)
    x = torch.randn(T, 256, generator=gen, device=DEV).to(torch.bfloat16)
    ids = torch.rand(T, 16, generator=gen, device=DEV).topk(TOPK, dim=-1).indices
    w = torch.rand(T, TOPK, generator=gen, device=DEV) + 0.1
    monkeypatch.setattr(gm, "WGMMA_DECODE", True)
    assert gm.qualifies(x, ids, ex) == (T <= gm.MAX_TOKENS)
    _poison()
    got = gm.moe_experts_wgmma(x, ids, w, ex, 10.0)
    assert _rel(got, ref.moe_experts(x, ids, w, ex, 10.0)) < REL_BOUND
    monkeypatch.setattr(gm, "FUSED_FILL", False)
    assert torch.equal(got, gm.moe_experts_wgmma(x, ids, w, ex, 10.0))


def test_wgmma_decode_with_shared_gpu() -> None:
    from dsv4.ops import gluon_moe_decode as gm
    from dsv4.ops import triton_moe as tri
    ch, gen = _experts(1200)
    T = 3
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    shared = (torch.randn(T, D, generator=gen, device=DEV) * 0.1).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    routed = gm.moe_experts_wgmma(x, ids, w, ch, 10.0)
    got = gm.moe_experts_wgmma(x, ids, w, ch, 10.0, shared=shared)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (routed + shared.float()).to(torch.bfloat16))
    assert _rel(got, tri.moe_experts_with_config(x, ids, w, ch, 10.0, None, shared=shared)) < 1e-2


def test_wgmma_decode_graph_replays_gpu() -> None:
    from dsv4.ops import gluon_moe_decode as gm
    ch, gen = _experts(1300)
    T = 2
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    gm.moe_experts_wgmma(x, ids, w, ch, 10.0)          # compile / warm up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gm.moe_experts_wgmma(x, ids, w, ch, 10.0)
    for _ in range(3):
        x.copy_(torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16))
        nid, nw = _routing(T, gen)
        ids.copy_(nid)
        w.copy_(nw)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gm.moe_experts_wgmma(x, ids, w, ch, 10.0))
    assert _counters_clean()


def test_op_routes_decode_calls_under_the_flag_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4.ops import gluon_moe_decode as gm
    from dsv4.ops import triton_moe as tri
    ch, gen = _experts(1400)
    x = torch.randn(1, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(1, gen)
    monkeypatch.setattr(gm, "WGMMA_DECODE", True)
    assert gm.qualifies(x, ids, ch)
    assert torch.equal(tri.moe_experts(x, ids, w, ch, 10.0), gm.moe_experts_wgmma(x, ids, w, ch,
                                                                                 10.0))
    x2 = torch.randn(2, D, generator=gen, device=DEV).to(torch.bfloat16)
    assert not gm.qualifies(x2, _routing(2, gen)[0], ch)    # two tokens: the grouped kernels
    monkeypatch.setattr(gm, "WGMMA_DECODE", False)
    assert not gm.qualifies(x, ids, ch)
