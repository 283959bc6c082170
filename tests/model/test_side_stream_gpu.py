"""How kernels are issued changes no bit: a V4-Flash schedule model (toy widths, FP8 Linears and
MXFP4 experts on the Triton kernels, fp8 cache) gives identical logits with the side lane
(``dsv4.ops.streams``: the shared expert on a second CUDA stream) on and off, the mHC
Sinkhorn on a third (the comb lane) and the attention's compressor on a fourth (the branch
lane) on and off, and with
programmatic dependent launch (``dsv4.ops.pdl``) on and off, eagerly and as CUDA-graph replays,
and leaves every split-K arrival counter at zero.  GPU only."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _step_fn(monkeypatch: pytest.MonkeyPatch):
    from bench import flash_bench as fb
    from dsv4.cache.formats import RECORD_DTYPE
    from dsv4.cache.tensors import HybridCache
    from dsv4.model.context import StepContext, pages_needed

    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "1")
    model = fb.build_model(5, tiny=True)         # window, window, CSA, HCA, CSA; hash + learned
    cfg = model.cfg
    B, ctx_len, page = 3, 300, fb.PAGE
    ppr = pages_needed(ctx_len + 8, page)
    cache = HybridCache.allocate(cfg, num_pages=B * ppr, num_slots=B, page_size=page,
                                 dtype=RECORD_DTYPE, device="cuda")
    tables = [fb.request_pages(r, ppr) for r in range(B)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for r in range(B):
        ids = torch.randint(0, cfg.vocab_size, (ctx_len + r,), generator=gen, device="cuda")
        model.forward(StepContext.build(ids, [ctx_len + r], [0], [r], [tables[r]],
                                        device="cuda"), cache)
    tok = torch.randint(0, cfg.vocab_size, (B,), generator=gen, device="cuda")
    # Fixed positions: replaying the step rewrites the same cache rows with the same values.
    c = StepContext.build(tok, [1] * B, [ctx_len + r for r in range(B)], list(range(B)), tables,
                          device="cuda")
    return lambda: model.compute_logits(model.forward(c, cache))


def _assert_replays_equal(step, expected: torch.Tensor, replays: int) -> None:
    """``step`` captured in a CUDA graph (warmed on a side stream) gives ``expected`` bit for
    bit on every replay, and leaves every split-K arrival counter at zero."""
    from dsv4.ops import triton_dense as td

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for _ in range(replays):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
    del g
    for buf in td._splitk_counter_cache.values():
        assert not buf.any(), "arrival counters left non-zero"


def test_side_stream_same_logits_eager_and_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    step = _step_fn(monkeypatch)
    monkeypatch.setenv("DSV4_SIDE_STREAM", "0")
    plain = step().clone()
    monkeypatch.setenv("DSV4_SIDE_STREAM", "1")
    side = step().clone()
    torch.cuda.synchronize()
    assert torch.isfinite(plain).all()
    assert torch.equal(side, plain)
    _assert_replays_equal(step, plain, 3)          # the fork / join captured as graph edges


def test_pdl_same_logits_eager_and_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that read its predecessor's output before the grid dependency wait would show
    here as a changed bit (in eager steps or replays, which run the chain back to back)."""
    from dsv4.ops import pdl

    step = _step_fn(monkeypatch)
    x = torch.empty(1, device="cuda")
    monkeypatch.setenv("DSV4_PDL", "0")
    assert pdl.pdl_args(x) == {}
    plain = step().clone()
    monkeypatch.setenv("DSV4_PDL", "1")
    assert pdl.pdl_args(x) == {"PDL": True, "launch_pdl": True}
    for _ in range(3):
        assert torch.equal(step(), plain)
    torch.cuda.synchronize()
    assert torch.isfinite(plain).all()
    _assert_replays_equal(step, plain, 5)


@pytest.mark.parametrize("var", ["DSV4_COMB_LANE", "DSV4_BRANCH_LANE"])
def test_extra_lanes_same_logits_eager_and_graph(var: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The mHC Sinkhorn on the comb lane (``streams.deferred_comb``) and a V4 attention's
    compressor on a branch of the side lane (``streams.branch_lane``) change no bit."""
    step = _step_fn(monkeypatch)
    monkeypatch.setenv(var, "0")
    plain = step().clone()
    monkeypatch.setenv(var, "1")
    lane = step().clone()
    torch.cuda.synchronize()
    assert torch.isfinite(plain).all()
    assert torch.equal(lane, plain)
    _assert_replays_equal(step, plain, 3)


def test_wo_a_gemv_in_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention's wo_a at 1-2 tokens: the engine makes its FP8 copy up front
    (``prepare_decode_weights``, counted before the cache is sized), and the grouped GEMV on it
    equals the bf16 weight's GEMM to fp32 rounding."""
    from bench import flash_bench as fb
    from dsv4.model import attention

    model = fb.build_model(2, tiny=True)
    made = model.prepare_decode_weights()
    layers = list(model.layers)
    per_layer = layers[0].attn.wo_a.weight.numel() * (1 + 1 / 128**2)      # e4m3 + e8m0 bytes
    assert made == pytest.approx(len(layers) * per_layer, rel=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for layer in layers:
        att = layer.attn
        for T in (1, 2):
            o = torch.randn(T, att.n_groups, att.wo_a.in_features,
                            generator=gen, device="cuda").bfloat16()
            y = att._wo_a(o)
            monkeypatch.setattr(attention, "WO_A_GEMV_MAX_ROWS", 0)
            ref = att._wo_a(o)
            monkeypatch.undo()
            assert y.dtype == ref.dtype == torch.bfloat16
            rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
            assert rel < 4e-3, rel                       # one bf16 rounding apart at most
