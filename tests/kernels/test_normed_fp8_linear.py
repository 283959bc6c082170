"""``normed_fp8_linear``: the attention's ``q_norm`` inside ``wq_b``'s FP8 GEMV
(``_fp8_gemv_normed_kernel`` in ``dsv4/ops/triton_dense.py``), one launch at decode instead of
two.

* plain CPU: the op table (a composed twin: without the kernel the model calls the parts), the
  argument checks, and the model — a V4 step with the fused path gives the logits of the
  unfused one (the twin is the parts; this checks the plumbing: the indexer's own qr);
* ``test_interp_*`` (a child process under ``TRITON_INTERPRET=1``): the normed kernel at 1-4 rows,
  split and unsplit K, e8m0 / fp32 weight scales, bf16 / fp32 activations, against the twin
  ``rms_norm`` + ``fp8_linear`` and against the two Triton kernels it replaces;
* ``test_gpu_*``: V4-Flash's ``wq_b`` (32768 × 1024) and a wider K at 1-2 rows, fresh random
  inputs, NaN-poisoned outputs, against the twin and the two launches; CUDA-graph replays.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.gpu_helpers import poison_allocator as _poison
from tests.kernels.interp_child import run_in_interpreter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(
    not INTERP, reason="interpreter test: run by test_kernels_in_interpreter in a child process")
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERP, reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")

E8M0 = torch.float8_e8m0fnu
EPS = 1e-6
# The fused statistic sums x² in another order than rms_norm's kernel: ~1e-7 relative in rstd,
# which can move a bf16 rounding of the normed x by one ulp and, rarely, an e4m3 code.
FP32_BOUND = 2e-3
BF16_BOUND = 6e-3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _fp8_weight(n: int, k: int, block: int, scale_dtype: torch.dtype, gen: torch.Generator,
                device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    w8 = (torch.randn(n, k, generator=gen, device=device) * 40).clamp(-448, 448)
    w8 = w8.to(torch.float8_e4m3fn)
    exps = torch.randint(115, 124, (-(-n // block), k // block), generator=gen, device=device)
    if scale_dtype == E8M0:
        return w8, exps.to(torch.uint8).view(E8M0)
    return w8, torch.exp2(exps.float() - 127) * (
        1 + torch.rand(exps.shape, generator=gen, device=device))


def _inputs(M: int, K: int, dtype: torch.dtype, gen: torch.Generator, device: str = "cpu"
            ) -> tuple[torch.Tensor, torch.Tensor]:
    x = (torch.randn(M, K, generator=gen, device=device) * 3).to(dtype)
    nw = 0.5 + torch.rand(K, generator=gen, device=device)       # fp32, as RMSNorm keeps it
    return x, nw


# ------------------------------------------------------------------------------ plain CPU
def test_op_table_and_twin() -> None:
    """The twin is rms_norm then fp8_linear; the Triton table leaves the op out (a composed
    twin) while it is unverified on a GPU, so the model calls the parts."""
    from dsv4.ops import UNVERIFIED_ON_GPU, get_ops
    from dsv4.ops import torch_attn, torch_dense
    gen = torch.Generator().manual_seed(0)
    w8, ws = _fp8_weight(64, 256, 128, E8M0, gen)
    x, nw = _inputs(2, 256, torch.bfloat16, gen)
    y = torch_dense.normed_fp8_linear(x, nw, EPS, w8, ws, 128)
    want = torch_dense.fp8_linear(torch_attn.rms_norm(x, nw, EPS), w8, ws, 128, x.dtype)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    assert get_ops("torch").normed_fp8_linear is torch_dense.normed_fp8_linear
    if "normed_fp8_linear" in UNVERIFIED_ON_GPU and \
            os.environ.get("DSV4_UNVERIFIED_KERNELS", "0") != "1":
        assert not hasattr(get_ops("triton"), "normed_fp8_linear")


def test_rejects_bad_norm_weight() -> None:
    pytest.importorskip("triton")
    from dsv4.ops import triton_dense as tri
    gen = torch.Generator().manual_seed(1)
    w8, ws = _fp8_weight(32, 128, 128, E8M0, gen)
    x, _ = _inputs(1, 128, torch.bfloat16, gen)
    with pytest.raises(ValueError, match="norm_weight"):
        tri.normed_fp8_linear(x, torch.ones(64), EPS, w8, ws, 128)


def test_model_step_with_fused_q_norm_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flash bench's tiny V4 model (window, window, CSA, HCA layers; FP8 storage, fp8
    records): prefill and a decode step with q_norm in wq_b's op give the logits of the two
    ops (torch twins: the same math; this checks the plumbing — the indexer's own qr), and the
    decode step really takes the fused path in every layer."""
    from bench import flash_bench as fb
    from dsv4.cache.formats import RECORD_DTYPE
    from dsv4.cache.tensors import HybridCache
    from dsv4.model import attention
    from dsv4.model.context import StepContext, pages_needed
    from dsv4.ops import torch_dense

    monkeypatch.setattr(fb, "DEV", "cpu")
    torch.manual_seed(0)
    model = fb.build_model(4, tiny=True)
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (70,))
    pages = list(range(pages_needed(80, fb.PAGE)))
    real = torch_dense.normed_fp8_linear
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_dense, "normed_fp8_linear", counted)
    outs = []
    for flag in (0, 1):
        monkeypatch.setattr(attention, "FUSE_Q_NORM", flag)
        # The op table holds the function itself: point the model's table at the counter.
        for layer in model.layers:
            monkeypatch.setattr(layer.attn.ops, "normed_fp8_linear", counted, raising=False)
        cache = HybridCache.allocate(cfg, num_pages=len(pages), num_slots=1, page_size=fb.PAGE,
                                     dtype=RECORD_DTYPE, device="cpu")
        pre = model.compute_logits(model.forward(
            StepContext.build(ids, [70], [0], [0], [pages]), cache))
        n_pre = len(calls)
        dec = model.compute_logits(model.forward(
            StepContext.build(ids[:1], [1], [70], [0], [pages]), cache))
        outs.append((pre, dec, n_pre, len(calls) - n_pre))
        calls.clear()
    assert outs[0][2:] == (0, 0)                 # off: never called
    assert outs[1][2:] == (0, len(model.layers))  # on: decode only, every layer
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# ------------------------------------------------------------------------------ interpreter
def test_kernels_in_interpreter() -> None:
    if INTERP:
        pytest.skip("already in the interpreter")
    run_in_interpreter(__file__, "interp_", min_passed=3)


def _gemv(bn: int, bk: int, split: int, warps: int = 4):
    from dsv4.ops import triton_dense as td
    return td.Fp8GemmConfig(BM=4, BN=bn, split_k=split, num_warps=warps, num_stages=1,
                            gemv=True, BK=bk)


# (N, K, block, BN, BK, split): one 128-block; several K steps unsplit; a split plan
# (the statistic covers the whole row in every split); 32-blocks with BK > block.
INTERP_CASES = [(64, 128, 128, 32, 128, 1), (96, 1024, 128, 32, 256, 1),
                (128, 1024, 128, 32, 256, 3), (72, 256, 32, 32, 128, 1)]


@interp_only
@pytest.mark.parametrize("case", INTERP_CASES, ids=lambda c: "N{}-K{}-b{}-BN{}-BK{}-s{}".format(*c))
def test_interp_normed_gemv_matches_parts(case: tuple) -> None:
    """The fused launch against the twin (rms_norm + fp8_linear) and against the two Triton
    kernels it replaces with the same GEMV plan, at 1-4 rows (e8m0 and fp32 weight scales,
    bf16 and fp32 x)."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    from dsv4.ops import triton_norm
    N, K, block, bn, bk, split = case
    gen = torch.Generator().manual_seed(N + K + split)
    for scale_dtype in (E8M0, torch.float32):
        w8, ws = _fp8_weight(N, K, block, scale_dtype, gen)
        sw, e8 = tri._scale_operand(ws)
        for M in (1, 2, 3, 4):
            for dtype in (torch.bfloat16, torch.float32):
                x, nw = _inputs(M, K, dtype, gen)
                cfg = _gemv(bn, bk, split)
                y = tri._fp8_gemv(x, w8, sw, e8, block, torch.float32, cfg, norm=(nw, EPS))
                y_ref = ref.normed_fp8_linear(x, nw, EPS, w8, ws, block, torch.float32)
                parts = tri._fp8_gemv(triton_norm.rms_norm(x, nw, EPS), w8, sw, e8, block,
                                      torch.float32, cfg)
                assert y.shape == (M, N) and torch.isfinite(y).all()
                assert _rel(y, y_ref) < FP32_BOUND, (M, dtype, _rel(y, y_ref))
                assert _rel(y, parts) < FP32_BOUND, (M, dtype, _rel(y, parts))


@interp_only
def test_interp_normed_linear_dispatch() -> None:
    """The op: 1-2 rows take the fused GEMV, more rows and zero rows the two ops; bf16 out
    with leading dims kept."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    gen = torch.Generator().manual_seed(7)
    w8, ws = _fp8_weight(64, 256, 128, E8M0, gen)
    for M in (1, 2, 3, 8):
        x, nw = _inputs(M, 256, torch.bfloat16, gen)
        y = tri.normed_fp8_linear(x.view(M, 1, 256), nw, EPS, w8, ws, 128)
        y_ref = ref.normed_fp8_linear(x.view(M, 1, 256), nw, EPS, w8, ws, 128)
        assert y.shape == (M, 1, 64) and y.dtype == torch.bfloat16
        assert _rel(y, y_ref) < BF16_BOUND, (M, _rel(y, y_ref))
    empty = tri.normed_fp8_linear(torch.zeros(0, 256, dtype=torch.bfloat16), nw, EPS, w8, ws,
                                  128)
    assert empty.shape == (0, 64)


# ------------------------------------------------------------------------------ GPU
@needs_gpu
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("N,K", [(32768, 1024), (4096, 4096)], ids=["wq_b", "k4096"])
def test_gpu_normed_gemv(N: int, K: int, M: int) -> None:
    """V4-Flash's wq_b (and a 4096-wide row): the fused launch against the twin and the two
    launches, every element written, the same bits run to run and in CUDA-graph replays."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    from dsv4.ops import triton_norm
    gen = torch.Generator(device="cuda").manual_seed(M + N + K)
    w8, ws = _fp8_weight(N, K, 128, E8M0, gen, "cuda")
    x, nw = _inputs(M, K, torch.bfloat16, gen, "cuda")
    y_ref = ref.normed_fp8_linear(x, nw, EPS, w8, ws, 128)
    parts = tri.fp8_linear(triton_norm.rms_norm(x, nw, EPS), w8, ws, 128)
    _poison()
    y = tri.normed_fp8_linear(x, nw, EPS, w8, ws, 128)
    assert y.shape == (M, N) and bool(torch.isfinite(y.float()).all())
    assert _rel(y, y_ref) < BF16_BOUND, _rel(y, y_ref)
    assert _rel(y, parts) < BF16_BOUND, _rel(y, parts)
    assert torch.equal(tri.normed_fp8_linear(x, nw, EPS, w8, ws, 128), y)
    x_static = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y_graph = tri.normed_fp8_linear(x_static, nw, EPS, w8, ws, 128)
    for _ in range(2):
        x2, _ = _inputs(M, K, torch.bfloat16, gen, "cuda")
        x_static.copy_(x2)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_graph, tri.normed_fp8_linear(x2, nw, EPS, w8, ws, 128))
