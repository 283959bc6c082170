"""Fused MoE glue (``dsv4/ops/torch_route.py`` twins, ``dsv4/ops/triton_route.py`` kernels).

* twins against the MoE code they replaced (bit for bit), argument checks, op-table wiring,
  the MoE module running the ops of its table — plain CPU;
* ``test_interp_*``: the kernels against the twins in the Triton interpreter, re-run in a child
  with ``TRITON_INTERPRET=1`` by :func:`test_kernels_in_interpreter`;
* ``test_gpu_*``: V4-Flash shapes on the GPU (skipped without CUDA).

Bounds: ids identical; routing weights and fp32 SwiGLU within 1e-6 relative (exp / log1p of
the interpreter vs torch's vectorized CPU ones; division and square root are IEEE in both);
bf16 outputs equal except rare one-ulp differences (an fp32 value next to a bf16 rounding
boundary); the combine is exact.  Ties in the top-k: the kernel takes the lowest id first
(checked against a stable sort; random fp32 logits give no ties).
"""

from __future__ import annotations

import dataclasses

import os

import pytest
import torch
import torch.nn.functional as F

from dsv4.ops import get_ops, torch_route
from dsv4.ops.torch_dense import swiglu
from tests.kernels.interp_child import run_in_interpreter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(
    not INTERP, reason="interpreter test: run by test_kernels_in_interpreter in a child process")
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _route_inputs(T: int, E: int, k: int, gen: torch.Generator, device: str = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gate logits of a real-looking gate (x·Wᵀ), a selection bias, a hash table, token ids."""
    x = torch.randn(T, 64, generator=gen)
    w = torch.randn(E, 64, generator=gen) * 0.3
    logits = F.linear(x, w)
    bias = torch.randn(E, generator=gen) * 0.05
    tid2eid = torch.rand(50, E, generator=gen).topk(k, dim=-1).indices
    ids = torch.randint(0, 50, (T,), generator=gen)
    return logits.to(device), bias.to(device), tid2eid.to(device), ids.to(device)


def _unfused_route(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
                   input_ids: torch.Tensor | None, k: int, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate.forward's code after the GEMM before the fusion (verbatim)."""
    scores = F.softplus(logits).sqrt()
    if tid2eid is not None:
        ids = tid2eid[input_ids]
    else:
        ids = (scores + bias).topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(dim=-1, keepdim=True) * scale
    return weights, ids


def _assert_rel(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.double() - want.double()).abs()
    bound = rel * want.double().abs() + 1e-30
    assert bool((err <= bound).all()), f"max rel error {(err / bound).max().item() * rel:.3g}"


def _assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for rare one-ulp bf16 differences."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = got != want
    assert diff.float().mean().item() <= 0.01
    ulp = want.float().abs() * 2.0 ** -7 + 1e-30
    assert bool(((got.float() - want.float()).abs() <= ulp)[diff].all())


# ------------------------------------------------------------------------ twins (plain CPU)
@pytest.mark.parametrize("hash_routed", [False, True])
def test_route_twin_is_the_unfused_code(hash_routed: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    logits, bias, tid2eid, ids = _route_inputs(9, 32, 4, gen)
    args = (None, tid2eid, ids) if hash_routed else (bias, None, None)
    w, e = torch_route.moe_route(logits, *args, 4, 1.5)
    w0, e0 = _unfused_route(logits, *args, 4, 1.5)
    assert torch.equal(e, e0) and torch.equal(w, w0) and e.dtype == torch.int64
    assert torch.allclose(w.sum(-1), torch.full((9,), 1.5))


@pytest.mark.parametrize("limit", [0.0, 10.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_and_combine_twins_are_the_unfused_code(limit: float, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    g = (torch.randn(5, 48, generator=gen) * 8).to(dtype)
    u = (torch.randn(5, 48, generator=gen) * 8).to(dtype)
    got = torch_route.swiglu_act(g, u, limit, dtype)
    assert torch.equal(got, swiglu(g, u, limit).to(dtype))
    if limit:  # the clamp really acts on this data
        assert not torch.equal(got, swiglu(g, u, 0.0).to(dtype))
    routed = torch.randn(5, 48, generator=gen)
    assert torch.equal(torch_route.moe_combine(routed, g, dtype), (routed + g.float()).to(dtype))


def test_twins_reject_bad_input() -> None:
    logits = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="logits"):
        torch_route.moe_route(logits.double(), torch.zeros(8), None, None, 2, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        torch_route.moe_route(logits, torch.zeros(8), None, None, 9, 1.0)
    with pytest.raises(ValueError, match="exactly one"):
        torch_route.moe_route(logits, None, None, None, 2, 1.0)
    with pytest.raises(ValueError, match="bias"):
        torch_route.moe_route(logits, torch.zeros(7), None, None, 2, 1.0)
    with pytest.raises(ValueError, match="tid2eid"):
        torch_route.moe_route(logits, None, torch.zeros(4, 3, dtype=torch.int64),
                              torch.zeros(3, dtype=torch.int64), 2, 1.0)
    with pytest.raises(ValueError, match="input_ids"):
        torch_route.moe_route(logits, None, torch.zeros(4, 2, dtype=torch.int64), None, 2, 1.0)
    with pytest.raises(ValueError, match="swiglu_act"):
        torch_route.swiglu_act(torch.zeros(2, 4), torch.zeros(2, 5), 1.0, torch.float32)
    with pytest.raises(ValueError, match="moe_combine"):
        torch_route.moe_combine(torch.zeros(2, 4).bfloat16(), torch.zeros(2, 4), torch.float32)


def test_op_table_has_the_fused_ops() -> None:
    pytest.importorskip("triton")
    from dsv4.ops import triton_moe, triton_route

    t, k = get_ops("torch"), get_ops("triton")
    for name in ("moe_route", "swiglu_act", "moe_combine", "moe_gate", "moe_experts_shared"):
        assert getattr(t, name) is getattr(torch_route, name)
    for name in ("moe_route", "swiglu_act", "moe_combine"):
        assert getattr(k, name) is getattr(triton_route, name)
    # The fused compositions (checked on the H200): their kernels.
    assert k.moe_gate is triton_route.moe_gate
    assert k.moe_experts_shared is triton_moe.moe_experts_shared
    assert t.moe_gate_plan is torch_route.moe_gate_plan
    assert k.moe_gate_plan is triton_route.moe_gate_plan      # checked on the H200 (s18f)


@pytest.mark.parametrize("fused", [True, False])
def test_moe_runs_the_ops_of_its_table(fused: bool) -> None:
    """The MoE's gate, shared expert and combine call the table's ops (a recording table):
    the composed ops where the table has them, else their parts — with the same output."""
    from types import SimpleNamespace

    from dsv4.config import ModelConfig
    from dsv4.model.moe import MoE

    calls: list[str] = []
    base = get_ops("torch")

    def rec(name: str):
        def fn(*args, **kwargs):
            calls.append(name)
            return getattr(base, name)(*args, **kwargs)
        return fn

    names = ("moe_route", "swiglu_act", "moe_combine", "moe_gate", "moe_experts_shared",
             "moe_gate_plan")
    ops = {**vars(base), **{n: rec(n) for n in names}}
    if not fused:
        # A table without the fused kernels.
        del ops["moe_gate"], ops["moe_experts_shared"], ops["moe_gate_plan"]
    table = SimpleNamespace(**ops)
    cfg = ModelConfig.from_dict(_tiny_cfg())
    for layer in (0, 1):                     # hash-routed, learned
        torch.manual_seed(layer)
        moe = MoE(cfg, layer, "bf16", table, torch.float32)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.2)
        if moe.gate.is_hash:
            moe.gate.tid2eid.copy_(torch.arange(2).repeat(cfg.vocab_size, 1))
        calls.clear()
        x = torch.randn(3, cfg.dim)
        out = moe(x, torch.tensor([1, 2, 3]))
        # The shared expert (swiglu_act) is issued first: on the GPU it forks onto a side stream.
        want = (["swiglu_act", "moe_gate_plan", "moe_experts_shared"] if fused
                else ["swiglu_act", "moe_route", "moe_combine"])
        assert calls == want and out.shape == x.shape
        moe.ops = moe.gate.ops = base
        assert torch.equal(out, moe(x, torch.tensor([1, 2, 3])))


def test_gate_and_shared_twins_are_the_compositions() -> None:
    from dsv4.ops import torch_dense

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    w = (torch.randn(24, 64, generator=gen) * 0.2).bfloat16()
    bias = torch.randn(24, generator=gen) * 0.05
    logits = torch_dense.linear_fp32(x, w)
    for got, want in zip(torch_route.moe_gate(x, w, bias, None, None, 3, 1.5),
                         torch_route.moe_route(logits, bias, None, None, 3, 1.5)):
        assert torch.equal(got, want)
    ex = torch_dense.ExpertWeights(*(torch.randn(*shape, generator=gen).bfloat16() * 0.1
                                     for shape in ((4, 16, 64), (4, 16, 64), (4, 64, 16))),
                                   None, "dense")
    ids = torch.randint(0, 4, (5, 2), generator=gen)
    wts = torch.rand(5, 2, generator=gen)
    shared = torch.randn(5, 64, generator=gen).bfloat16()
    waits: list[int] = []
    got = torch_route.moe_experts_shared(x, ids, wts, ex, 10.0, shared, lambda: waits.append(1))
    want = torch_route.moe_combine(torch_dense.moe_experts(x, ids, wts, ex, 10.0), shared,
                                   torch.bfloat16)
    assert torch.equal(got, want) and waits == [1]
    # moe_gate_plan's twin: moe_gate's picks and no plan (the twins need none).
    got3 = torch_route.moe_gate_plan(x, w, bias, None, None, 3, 1.5, ex)
    assert got3[2] is None and all(torch.equal(a, b) for a, b in
                                   zip(got3[:2], torch_route.moe_gate(x, w, bias, None, None,
                                                                      3, 1.5)))


def _tiny_cfg() -> dict:
    return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "qk_rope_head_dim": 16, "q_lora_rank": 16, "o_groups": 1, "o_lora_rank": 16,
            "moe_intermediate_size": 16, "n_routed_experts": 4, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
            "swiglu_limit": 10.0, "sliding_window": 8, "index_n_heads": 2,
            "index_head_dim": 32, "index_topk": 4, "hc_mult": 2, "hc_sinkhorn_iters": 3,
            "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "rope_theta": 10000,
            "max_position_embeddings": 4096, "num_nextn_predict_layers": 0,
            "compress_ratios": [0, 0], "bos_token_id": 0, "eos_token_id": 1,
            "tie_word_embeddings": False, "torch_dtype": "float32"}


def test_triton_ops_run_the_twins_off_gpu() -> None:
    if INTERP:
        pytest.skip("the interpreter runs the kernels themselves on CPU")
    pytest.importorskip("triton")
    from dsv4.ops import triton_route as tri

    gen = torch.Generator().manual_seed(2)
    logits, bias, _, _ = _route_inputs(4, 16, 3, gen)
    w, e = tri.moe_route(logits, bias, None, None, 3, 2.0)
    w0, e0 = torch_route.moe_route(logits, bias, None, None, 3, 2.0)
    assert torch.equal(w, w0) and torch.equal(e, e0)


def test_kernels_in_interpreter() -> None:
    """Run this file's interpreter tests with ``TRITON_INTERPRET=1`` in a child."""
    if INTERP:
        pytest.skip("TRITON_INTERPRET is set: the interp tests run directly")
    run_in_interpreter(__file__, "interp_")


# ------------------------------------------------------------------------ kernels (interpreter)
@interp_only
@pytest.mark.parametrize("T,E,k", [(1, 256, 6), (37, 256, 6), (5, 24, 3)])
@pytest.mark.parametrize("hash_routed", [False, True])
def test_interp_route_matches_twin(T: int, E: int, k: int, hash_routed: bool) -> None:
    from dsv4.ops import triton_route as tri

    gen = torch.Generator().manual_seed(T * 1000 + E)
    logits, bias, tid2eid, ids = _route_inputs(T, E, k, gen)
    logits[0, :3] = torch.tensor([25.0, -30.0, 1e-3])  # softplus' linear branch, tiny values
    args = (None, tid2eid, ids) if hash_routed else (bias, None, None)
    w, e = tri.moe_route(logits, *args, k, 2.5)
    w0, e0 = torch_route.moe_route(logits, *args, k, 2.5)
    assert torch.equal(e, e0)
    _assert_rel(w, w0, 1e-6)


@interp_only
def test_interp_route_ties_take_the_lowest_id() -> None:
    from dsv4.ops import triton_route as tri

    # Four distinct logit values over 16 experts, no bias: many exact ties.
    gen = torch.Generator().manual_seed(4)
    logits = torch.randint(0, 4, (6, 16), generator=gen).float()
    w, e = tri.moe_route(logits, torch.zeros(16), None, None, 5, 1.0)
    order = torch.sort(-logits, dim=-1, stable=True).indices[:, :5]   # lowest id first on ties
    assert torch.equal(e, order)
    w0 = F.softplus(logits).sqrt().gather(1, order)
    _assert_rel(w, w0 / w0.sum(-1, keepdim=True), 1e-6)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [0.0, 10.0])
def test_interp_swiglu_matches_twin(dtype: torch.dtype, limit: float) -> None:
    from dsv4.ops import triton_route as tri

    gen = torch.Generator().manual_seed(5)
    g = (torch.randn(7, 1100, generator=gen) * 6).to(dtype)   # two column tiles, a ragged one
    u = (torch.randn(7, 1100, generator=gen) * 6).to(dtype)
    want = torch_route.swiglu_act(g, u, limit, dtype)
    got = tri.swiglu_act(g, u, limit, dtype)
    if dtype == torch.float32:
        _assert_rel(got, want, 1e-6)
    else:
        _assert_bf16_close(got, want)
    # A strided view (the halves of one [T, 2I] buffer) gives the same values.
    both = torch.cat([g, u], dim=1)
    assert torch.equal(tri.swiglu_act(both[:, :1100], both[:, 1100:], limit, dtype), got)


@interp_only
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_interp_combine_is_exact(out_dtype: torch.dtype) -> None:
    from dsv4.ops import triton_route as tri

    gen = torch.Generator().manual_seed(6)
    routed = torch.randn(5, 300, generator=gen) * 3
    shared = (torch.randn(5, 300, generator=gen) * 3).bfloat16()
    assert torch.equal(tri.moe_combine(routed, shared, out_dtype),
                       torch_route.moe_combine(routed, shared, out_dtype))


@interp_only
@pytest.mark.parametrize("T,E", [(1, 256), (2, 256), (5, 24), (16, 256), (17, 24)])
@pytest.mark.parametrize("hash_routed", [False, True])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_interp_gate_is_the_two_kernels(T: int, E: int, hash_routed: bool,
                                        w_dtype: torch.dtype) -> None:
    """moe_gate in one launch = linear_fp32's kernel then moe_route's, bit for bit, for the
    default plan and split-K plans (the routing in the last tile's finisher), counters idle
    after; T = 17 takes the two kernels."""
    from dsv4.ops import triton_dense as td
    from dsv4.ops import triton_linear32 as l32
    from dsv4.ops import triton_route as tri

    gen = torch.Generator().manual_seed(T * 100 + E)
    K = 512
    x = torch.randn(T, K, generator=gen).bfloat16()
    w = (torch.randn(E, K, generator=gen) * K ** -0.5).to(w_dtype)
    bias = torch.randn(E, generator=gen) * 0.05
    tid2eid = torch.rand(50, E, generator=gen).topk(6, dim=-1).indices
    tok = torch.randint(0, 50, (T,), generator=gen)
    args = (None, tid2eid, tok) if hash_routed else (bias, None, None)
    plans: list = [None]
    if T <= tri.GATE_MAX_ROWS:
        bm = 1 << max(0, (T - 1).bit_length())
        plans += [l32.Linear32Config(BM=bm, BN=32, BK=128, split_k=3),
                  l32.Linear32Config(BM=16, BN=16, BK=64, split_k=2)]
    for cfg in plans:
        # (linear_fp32 sends one fp32-weight row to cuBLAS; moe_gate keeps its kernel.)
        one_fp32_row = T == 1 and w_dtype == torch.float32
        logits = (l32.linear_fp32(x, w) if cfg is None and not one_fp32_row
                  else l32.linear_fp32_with_config(x, w, cfg))
        want = tri.moe_route(logits, *args, 6, 2.5)
        for _ in range(2):                                  # counters reset for the next call
            got = (tri.moe_gate(x, w, *args, 6, 2.5) if cfg is None
                   else tri.moe_gate_with_config(x, w, *args, 6, 2.5, cfg))
            assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), cfg
        buf = td._splitk_counter_cache.get(torch.device("cpu"))
        assert buf is None or not bool(buf.any())
    # Against the torch twin: the same picks, weights to rounding.
    w0, e0 = torch_route.moe_gate(x, w, *args, 6, 2.5)
    assert torch.equal(got[1], e0)
    _assert_rel(got[0], w0, 1e-5)


def _plan_experts(fmt: str, E: int, D: int, inter: int, gen: torch.Generator,
                  device: str = "cpu"):
    """Random expert stacks of one format: fp4 (row-major or K-chunk-major), fp8, dense."""
    from dsv4.ops import torch_dense

    def fp4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(0, 256, (E, n, k // 2), generator=gen, dtype=torch.uint8)
        sc = torch.randint(118, 124, (E, n, k // 32), generator=gen).to(torch.uint8)
        return w.view(torch.int8).to(device), sc.view(torch.float8_e8m0fnu).to(device)

    def fp8(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = (torch.randn(E, n, k, generator=gen) * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
        sc = torch.randint(118, 124, (E, n // 128, k // 128), generator=gen).to(torch.uint8)
        return w.to(device), sc.view(torch.float8_e8m0fnu).to(device)
    if fmt in ("fp4", "fp4_kchunk"):
        (w1, s1), (w3, s3), (w2, s2) = fp4(inter, D), fp4(inter, D), fp4(D, inter)
        ex = torch_dense.ExpertWeights(w1, w3, w2, 128, "fp4", s1, s3, s2)
        return torch_dense.kchunk_experts(ex, 128) if fmt == "fp4_kchunk" else ex
    if fmt == "fp8":
        (w1, s1), (w3, s3), (w2, s2) = fp8(inter, D), fp8(inter, D), fp8(D, inter)
        return torch_dense.ExpertWeights(w1, w3, w2, 128, "fp8", s1, s3, s2, 128)
    return torch_dense.ExpertWeights(*((torch.randn(*shape, generator=gen) * 0.06).to(
        device, torch.bfloat16) for shape in ((E, inter, D), (E, inter, D), (E, D, inter))),
        None, "dense")


@interp_only
@pytest.mark.parametrize("T", [0, 1, 3])
@pytest.mark.parametrize("fmt", ["fp4", "dense"])
def test_interp_experts_shared_is_the_combine(T: int, fmt: str) -> None:
    """moe_experts_shared = moe_combine(moe_experts(...)) bit for bit; wait_shared once."""
    from dsv4.ops import triton_moe as tmoe

    gen = torch.Generator().manual_seed(T + 11)
    E, D, inter = 4, 256, 128
    ex = _plan_experts(fmt, E, D, inter, gen)
    x = torch.randn(T, D, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)]) if T else \
        torch.zeros(0, 2, dtype=torch.int64)
    if T:
        ids[0, 1] = -1                                     # a pick of another rank: skipped
    wts = torch.rand(T, 2, generator=gen) + 0.1
    shared = torch.randn(T, D, generator=gen).bfloat16()
    waits: list[int] = []
    got = tmoe.moe_experts_shared(x, ids, wts, ex, 10.0, shared, lambda: waits.append(1))
    want = torch_route.moe_combine(tmoe.moe_experts(x, ids, wts, ex, 10.0), shared,
                                   torch.bfloat16)
    assert torch.equal(got, want) and waits == [1] and got.dtype == torch.bfloat16
    if T:
        _assert_bf16_close(got, torch_route.moe_experts_shared(x, ids, wts, ex, 10.0, shared))


@interp_only
@pytest.mark.parametrize("T,k", [(1, 6), (3, 3), (10, 6), (11, 6), (17, 2)])
@pytest.mark.parametrize("fmt,hash_routed", [("fp4", False), ("fp4_kchunk", False),
                                             ("fp8", False), ("dense", False),
                                             # the routing part does not see the format
                                             ("fp4", True)])
def test_interp_gate_plan_is_the_gate_and_the_experts_plan(
        T: int, k: int, fmt: str, hash_routed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_gate_plan: moe_gate's weights and ids bit for bit, and a decode plan with which
    moe_experts / moe_experts_shared give their own results bit for bit (the plan's pairs and
    blocks those of moe_plan); no plan beyond SMALL_PLAN_MAX_PAIRS pairs (11 × 6) or
    GATE_MAX_ROWS rows (17), nor for a gate plan whose K splits cut the experts' K steps;
    split-K gate plans; counters idle after."""
    from dsv4.ops import triton_dense as td
    from dsv4.ops import triton_linear32 as l32
    from dsv4.ops import triton_moe as tmoe
    from dsv4.ops import triton_route as tri

    gen = torch.Generator().manual_seed(T * 10 + k + len(fmt))
    E, D, inter = 8, 256, 128
    ex = _plan_experts(fmt, E, D, inter, gen)
    preps: list[int] = []                  # the experts' own plan + prep launches
    own_prep = tmoe.moe_plan_prep
    monkeypatch.setattr(tmoe, "moe_plan_prep",
                        lambda *a, **kw: (preps.append(1), own_prep(*a, **kw))[1])
    x = torch.randn(T, D, generator=gen).bfloat16()
    w = (torch.randn(E, D, generator=gen) * D ** -0.5).bfloat16()
    bias = torch.randn(E, generator=gen) * 0.05
    tid2eid = torch.rand(50, E, generator=gen).topk(k, dim=-1).indices
    tok = torch.randint(0, 50, (T,), generator=gen)
    args = (None, tid2eid, tok) if hash_routed else (bias, None, None)
    shared = torch.randn(T, D, generator=gen).bfloat16()
    bm = 1 << max(0, (T - 1).bit_length())
    cfgs = [None, l32.Linear32Config(BM=min(bm, 16), BN=32, BK=128, split_k=2),
            l32.Linear32Config(BM=16, BN=16, BK=64, split_k=4)]   # K splits of 64: no plan
    for cfg in cfgs:
        wts, ids, plan = tri._gate(x, w, *args, k, 2.5, cfg, ex)
        want = tri.moe_gate_with_config(x, w, *args, k, 2.5, cfg)
        assert torch.equal(wts, want[0]) and torch.equal(ids, want[1]), cfg
        kps = l32.split_k_grid(T, E, D, cfg or l32.pick_bf16w_config(T, E, D, x.device))[0]
        expect_plan = T * k <= 64 and T <= tri.GATE_MAX_ROWS and kps % 128 == 0
        assert (plan is not None) == expect_plan, (cfg, kps, plan)
        buf = td._splitk_counter_cache.get(torch.device("cpu"))
        assert buf is None or not bool(buf.any())
        if plan is None:
            continue
        pairs, blocks = tmoe.moe_plan(ids, E, plan.BM)
        assert torch.equal(plan.pairs, pairs) and torch.equal(plan.block_expert, blocks)
        routed = tmoe.moe_experts(x, ids, wts, ex, 10.0)
        n = len(preps)
        assert torch.equal(tmoe.moe_experts(x, ids, wts, ex, 10.0, plan=plan), routed), cfg
        assert n >= 1 and len(preps) == n           # the plan was used: no launch of its own
        assert torch.equal(tmoe.moe_experts_shared(x, ids, wts, ex, 10.0, shared, plan=plan),
                           tmoe.moe_experts_shared(x, ids, wts, ex, 10.0, shared))
    # The public op: moe_gate's picks (its default GEMM plan).
    got = tri.moe_gate_plan(x, w, *args, k, 2.5, ex)
    want = tri.moe_gate(x, w, *args, k, 2.5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@interp_only
def test_interp_experts_ignore_a_plan_of_other_ids() -> None:
    """A plan made for another call (other pair count or row block) is not used."""
    from dsv4.ops import triton_moe as tmoe
    from dsv4.ops import triton_route as tri

    gen = torch.Generator().manual_seed(3)
    E, D, inter = 8, 256, 128
    ex = _plan_experts("fp4", E, D, inter, gen)
    x = torch.randn(2, D, generator=gen).bfloat16()
    w = (torch.randn(E, D, generator=gen) * D ** -0.5).bfloat16()
    bias = torch.randn(E, generator=gen) * 0.05
    _, _, plan = tri.moe_gate_plan(x, w, bias, None, None, 3, 2.5, ex)
    wts, ids, _ = tri.moe_gate_plan(x[:1], w, bias, None, None, 3, 2.5, ex)
    assert plan is not None and plan.P == 6
    assert torch.equal(tmoe.moe_experts(x[:1], ids, wts, ex, 10.0, plan=plan),
                       tmoe.moe_experts(x[:1], ids, wts, ex, 10.0))
    other_rows = dataclasses.replace(plan, BM=plan.BM * 2)
    wts, ids = tri.moe_gate(x, w, bias, None, None, 3, 2.5)
    assert torch.equal(tmoe.moe_experts(x, ids, wts, ex, 10.0, plan=other_rows),
                       tmoe.moe_experts(x, ids, wts, ex, 10.0))


# ------------------------------------------------------------------------ GPU (V4-Flash shapes)
@gpu_only
@pytest.mark.parametrize("T", [1, 16, 8192])
def test_gpu_v4_flash_shapes(T: int) -> None:
    from dsv4.ops import triton_route as tri

    dev = "cuda"
    gen = torch.Generator().manual_seed(T)
    logits, bias, tid2eid, ids = _route_inputs(T, 256, 6, gen, dev)
    for args in ((bias, None, None), (None, tid2eid, ids)):
        w, e = tri.moe_route(logits, *args, 6, 1.5)
        w0, e0 = torch_route.moe_route(logits, *args, 6, 1.5)
        assert torch.equal(e, e0)
        _assert_rel(w, w0, 1e-6)
    g = (torch.randn(T, 2048, generator=gen) * 6).to(dev, torch.bfloat16)
    u = (torch.randn(T, 2048, generator=gen) * 6).to(dev, torch.bfloat16)
    _assert_bf16_close(tri.swiglu_act(g, u, 10.0, torch.bfloat16),
                       torch_route.swiglu_act(g, u, 10.0, torch.bfloat16))
    routed = torch.randn(T, 4096, generator=gen).to(dev)
    shared = torch.randn(T, 4096, generator=gen).to(dev, torch.bfloat16)
    assert torch.equal(tri.moe_combine(routed, shared, torch.bfloat16),
                       torch_route.moe_combine(routed, shared, torch.bfloat16))


@gpu_only
@pytest.mark.parametrize("T", [1, 2, 16])
def test_gpu_gate_is_the_two_kernels(T: int) -> None:
    """V4-Flash gate (bf16 weight [256, 4096]): moe_gate = linear_fp32 + moe_route bit for bit,
    eager and in a CUDA graph replayed on new inputs; the picks agree with the twin."""
    from dsv4.ops import triton_linear32 as l32
    from dsv4.ops import triton_route as tri

    dev = "cuda"
    gen = torch.Generator().manual_seed(T + 3)
    x = torch.randn(T, 4096, generator=gen).to(dev, torch.bfloat16)
    w = (torch.randn(256, 4096, generator=gen) * 4096 ** -0.5).to(dev, torch.bfloat16)
    bias = (torch.randn(256, generator=gen) * 0.05).to(dev)
    tid2eid = torch.rand(1000, 256, generator=gen).topk(6, dim=-1).indices.to(dev)
    tok = torch.randint(0, 1000, (T,), generator=gen).to(dev)
    for args in ((bias, None, None), (None, tid2eid, tok)):
        want = tri.moe_route(l32.linear_fp32(x, w), *args, 6, 2.5)
        got = tri.moe_gate(x, w, *args, 6, 2.5)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert not bool(torch.isnan(got[0]).any())
        w0, e0 = torch_route.moe_gate(x, w, *args, 6, 2.5)
        assert torch.equal(got[1], e0)
        _assert_rel(got[0], w0, 1e-5)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out = tri.moe_gate(x, w, *args, 6, 2.5)
        for seed in range(3):
            x.copy_(torch.randn(T, 4096, generator=gen).to(dev, torch.bfloat16))
            graph.replay()
            want = tri.moe_route(l32.linear_fp32(x, w), *args, 6, 2.5)
            assert torch.equal(g_out[0], want[0]) and torch.equal(g_out[1], want[1]), seed


@gpu_only
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_experts_shared_is_the_combine(T: int) -> None:
    """V4-Flash widths (16 MXFP4 experts, D 4096, I 2048, K-chunk-major as loaded on a GPU):
    moe_experts_shared = moe_combine(moe_experts(...)) bit for bit, with the shared expert on
    the side lane joined by wait_shared."""
    from dsv4.ops import streams
    from dsv4.ops import triton_moe as tmoe

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(T)
    E, D, inter = 16, 4096, 2048
    ex = _plan_experts("fp4_kchunk", E, D, inter, gen, dev)
    x = torch.randn(T, D, generator=gen).to(dev, torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:6] for _ in range(T)]).to(dev)
    wts = (torch.rand(T, 6, generator=gen) + 0.1).to(dev)
    src = torch.randn(T, D, generator=gen).to(dev, torch.bfloat16)
    with streams.side_lane(dev, T):
        shared = src * 2                                  # made on the side lane
    got = tmoe.moe_experts_shared(x, ids, wts, ex, 10.0, shared,
                                  lambda: streams.join_side_lane(dev))
    streams.join_side_lane(dev)
    want = torch_route.moe_combine(tmoe.moe_experts(x, ids, wts, ex, 10.0), src * 2,
                                   torch.bfloat16)
    assert torch.equal(got, want) and not bool(torch.isnan(got.float()).any())
