"""The indexer's top-k kernel (``dsv4/ops/triton_topk.py``) against its torch twin
(``torch_attn.topk_indices``): identical ids, always.

* argument checks, op-table wiring, the twin off the GPU — plain CPU;
* ``test_interp_*``: the kernel in the Triton interpreter at tiny shapes, re-run in a child
  process with ``TRITON_INTERPRET=1`` by :func:`test_kernels_in_interpreter`: random and tied
  scores, ±0, ±inf, rows with n_visible 0 / < k / == k / > k / == L (and out of range), the
  in-register, streaming and split plans (a small ``block`` reaches the long-row plans);
* ``test_gpu_*``: real shapes on the GPU (skipped without CUDA), NaN-poisoned allocator.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.ops import get_ops, torch_attn
from tests.kernels.gpu_helpers import poison_allocator as _poison
from tests.kernels.interp_child import run_in_interpreter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(
    not INTERP, reason="interpreter test: run by test_kernels_in_interpreter in a child process")
NEG_INF = float("-inf")


def make_scores(T: int, L: int, n_visible: torch.Tensor, mode: str, gen: torch.Generator,
                device: str = "cpu") -> torch.Tensor:
    """[T, L] fp32 scores of one ``mode``, −inf at and past each row's n_visible (the contract
    of ``indexer_scores``)."""
    s = torch.randn(T, L, generator=gen, device=device)
    if mode == "ties":          # a handful of values: long runs of equal keys at the cutoff
        s = (s * 1.5).round() / 2
    elif mode == "equal":
        s = torch.full((T, L), 0.75, device=device)
    elif mode == "zeros":       # ReLU-like: +0.0 and −0.0 (equal for the twin's sort) and a few
        z = torch.where(torch.rand(T, L, generator=gen, device=device) < 0.5, 0.0, -0.0)
        s = torch.where(torch.rand(T, L, generator=gen, device=device) < 0.9, z, s.abs())
    elif mode == "neg_inf":     # candidate masking: many visible −inf, a few ±inf / huge
        r = torch.rand(T, L, generator=gen, device=device)
        s = s.masked_fill(r < 0.6, NEG_INF).masked_fill(r > 0.97, float("inf")) * 1e30
    elif mode != "randn":
        raise ValueError(f"make_scores: unknown mode {mode!r}")
    past = torch.arange(L, device=device)[None, :] >= n_visible.to(device)[:, None]
    return s.masked_fill(past, NEG_INF)


def visible_counts(T: int, L: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """n_visible for T rows cycling through 0, < k, == k, > k, == L, random (clamped to L)."""
    picks = [0, max(0, k // 2), k, k + 1 + L // 3, L]
    n = [picks[i % len(picks)] if i < len(picks) else
         int(torch.randint(0, L + 1, (1,), generator=gen)) for i in range(T)]
    return torch.tensor([min(v, L) for v in n], dtype=torch.int64)


# ------------------------------------------------------------------------ plain CPU
def test_op_table_has_topk_kernel() -> None:
    pytest.importorskip("triton")
    from dsv4 import ops
    from dsv4.ops import triton_topk

    assert "dsv4.ops.triton_topk" in ops._TRITON_MODULES
    assert get_ops("torch").topk_indices is torch_attn.topk_indices
    assert get_ops("triton").topk_indices is triton_topk.topk_indices   # tests enable unverified


def test_bad_arguments_are_named() -> None:
    pytest.importorskip("triton")
    from dsv4.ops.triton_topk import topk_indices_with_block as topk

    s, n = torch.zeros(3, 8), torch.full((3,), 8)
    with pytest.raises(ValueError, match="scores must be a 2-D float"):
        topk(torch.zeros(3, 8, 1), n, 2)
    with pytest.raises(ValueError, match="scores must be a 2-D float"):
        topk(torch.zeros(3, 8, dtype=torch.int32), n, 2)
    with pytest.raises(ValueError, match=r"n_visible must be an integer tensor \[3\]"):
        topk(s, n[:2], 2)
    with pytest.raises(ValueError, match="n_visible must be an integer"):
        topk(s, n.float(), 2)
    with pytest.raises(ValueError, match="k must be an int >= 0"):
        topk(s, n, -1)
    with pytest.raises(ValueError, match="k must be an int >= 0"):
        topk(s, n, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block must be a power of two"):
        topk(s, n, 2, block=48)


def test_triton_op_runs_the_twin_off_gpu() -> None:
    if INTERP:
        pytest.skip("the interpreter runs the kernel itself on CPU")
    pytest.importorskip("triton")
    from dsv4.ops import triton_topk

    gen = torch.Generator().manual_seed(0)
    n = visible_counts(5, 40, 7, gen)
    s = make_scores(5, 40, n, "ties", gen)
    assert torch.equal(triton_topk.topk_indices(s, n, 7), torch_attn.topk_indices(s, n, 7))


# The sm_90 compile of every launch plan: scenario "topk/v4_flash" in tests/kernels/sm90_cases.py.


# ---------------------------------------------------------------- interpreter (child process)
def test_kernels_in_interpreter() -> None:
    """Run this file's interpreter tests with ``TRITON_INTERPRET=1`` in a child."""
    if INTERP:
        pytest.skip("TRITON_INTERPRET is set: the interp tests run directly")
    run_in_interpreter(__file__, "interp_", min_passed=10)


# (T, L, k, block, split): block None is the in-register plan; a small block makes L stream
# (split False) or split into chunks (split True), with a merge that fits registers or streams.
PLANS = [(6, 37, 7, None, None), (6, 300, 64, None, None), (5, 300, 1, None, None),
         (6, 300, 7, 64, False), (6, 300, 64, 64, False), (6, 300, 7, 64, True),
         (6, 300, 64, 128, True), (4, 100, 7, 16, True), (6, 300, 64, 32, True)]


@interp_only
@pytest.mark.parametrize("T,L,k,block,split", PLANS)
@pytest.mark.parametrize("mode", ["randn", "ties", "equal", "zeros", "neg_inf"])
def test_interp_kernel_is_the_twin(T: int, L: int, k: int, block: int | None,
                                   split: bool | None, mode: str) -> None:
    from dsv4.ops.triton_topk import topk_indices_with_block

    gen = torch.Generator().manual_seed(T * L + k + len(mode))
    n_visible = visible_counts(T, L, k, gen)
    scores = make_scores(T, L, n_visible, mode, gen)
    got = topk_indices_with_block(scores, n_visible, k, block, split)
    want = torch_attn.topk_indices(scores, n_visible, k)
    assert got.dtype == torch.int64 and got.shape == (T, k)
    assert torch.equal(got, want)


@interp_only
@pytest.mark.parametrize("fin,cand_block,scratch", [(4, 8, 1 << 20), (8, 16, 1)])
@pytest.mark.parametrize("block,split,compact", [(None, None, True), (None, None, False),
                                                 (64, False, True), (64, True, False)])
def test_interp_compaction_paths(monkeypatch: pytest.MonkeyPatch, fin: int, cand_block: int,
                                 scratch: int, block: int | None, split: bool | None,
                                 compact: bool) -> None:
    """Small finish / candidate-block / scratch sizes, so that at tiny L the select runs passes
    over compacted keys, compacts them again, finishes by direct ranks, or (scratch too small to
    compact, or compact=False for rows in registers) runs every pass over the whole row."""
    from dsv4.ops import triton_topk

    monkeypatch.setattr(triton_topk, "_FIN", fin)
    monkeypatch.setattr(triton_topk, "_CAND_BLOCK", cand_block)
    monkeypatch.setattr(triton_topk, "_SCRATCH_BYTES", scratch)
    gen = torch.Generator().manual_seed(fin + cand_block)
    for mode in ("randn", "ties", "zeros"):
        n_visible = visible_counts(6, 250, 9, gen)
        scores = make_scores(6, 250, n_visible, mode, gen)
        got = triton_topk.topk_indices_with_block(scores, n_visible, 9, block, split,
                                                  compact=compact)
        assert torch.equal(got, torch_attn.topk_indices(scores, n_visible, 9)), mode


@interp_only
def test_interp_edge_shapes() -> None:
    """k == 0, L == 0, T == 0, k > L, n_visible past L or negative, int32 n_visible, a strided
    and a bf16 score tensor: all as the twin (the public op, in-register plan)."""
    from dsv4.ops.triton_topk import topk_indices

    gen = torch.Generator().manual_seed(5)
    for n, k in ((torch.tensor([20, 3, 0, 11]), 0), (torch.tensor([20, 3, 0, 11]), 32),
                 (torch.tensor([25, -2, 20, 19], dtype=torch.int32), 5)):
        s = make_scores(4, 20, n, "ties", gen)
        want = torch_attn.topk_indices(s, n.clamp(max=20), k)
        assert torch.equal(topk_indices(s, n, k), want)
    for shape in ((3, 0), (0, 9)):
        z = torch.zeros(shape)
        n = torch.zeros(shape[0], dtype=torch.int64)
        assert torch.equal(topk_indices(z, n, 4), torch_attn.topk_indices(z, n, 4))
    n = torch.tensor([20, 7, 12, 1, 0, 19, 20, 3])
    wide = make_scores(8, 20, n, "randn", gen).t().contiguous().t()   # column-major rows
    assert torch.equal(topk_indices(wide, n, 6), torch_attn.topk_indices(wide, n, 6))
    n = torch.tensor([50, 30, 5])
    half = make_scores(3, 50, n, "ties", gen).to(torch.bfloat16)
    assert torch.equal(topk_indices(half, n, 8), torch_attn.topk_indices(half, n, 8))


@interp_only
@pytest.mark.parametrize("block,split", [(None, None), (32, False), (32, True)])
def test_interp_ignores_entries_past_n_visible(block: int | None, split: bool | None) -> None:
    """Scores past n_visible are never read: finite junk there picks what −inf would."""
    from dsv4.ops.triton_topk import topk_indices_with_block

    gen = torch.Generator().manual_seed(9)
    n = torch.tensor([10, 40, 100, 3])
    junk = torch.randn(4, 100, generator=gen) + 100.0      # above every visible score
    clean = make_scores(4, 100, n, "randn", gen)
    past = torch.arange(100)[None, :] >= n[:, None]
    got = topk_indices_with_block(torch.where(past, junk, clean), n, 16, block, split)
    assert torch.equal(got, torch_attn.topk_indices(clean, n, 16))


@interp_only
def test_interp_bench_smoke() -> None:
    """bench/topk_bench.py runs its tiny shapes through the interpreter, outputs identical."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "topk_bench.py"
    spec = importlib.util.spec_from_file_location("topk_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--no-extra"]) == 0


# ------------------------------------------------------------------ GPU at real shapes
gpu_only = pytest.mark.skipif(not torch.cuda.is_available() or INTERP,
                              reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")



GPU_SHAPES = [(1, 2048, 512), (64, 2048, 512), (16, 16384, 512), (2048, 2048, 512),
              (4, 65536, 1024)]


@gpu_only
@pytest.mark.parametrize("T,L,k", GPU_SHAPES)
@pytest.mark.parametrize("mode", ["randn", "ties", "zeros", "neg_inf"])
def test_gpu_real_shapes(T: int, L: int, k: int, mode: str) -> None:
    from dsv4.ops.triton_topk import topk_indices

    gen = torch.Generator(device="cuda").manual_seed(T + L + k + len(mode))
    # Random n_visible, and a few rows on the path boundaries (0, < k, == k, == L).
    n = torch.randint(0, L + 1, (T,), generator=gen, device="cuda")
    n[: min(T, 4)] = torch.tensor([L, k, k // 2, 0], device="cuda")[: min(T, 4)]
    scores = make_scores(T, L, n, mode, gen, "cuda")
    _poison()
    got = topk_indices(scores, n, k)
    want = torch_attn.topk_indices(scores, n, k)
    assert torch.equal(got, want)


@gpu_only
@pytest.mark.parametrize("split,compact", [(False, True), (False, False), (True, True),
                                           (True, False)])
@pytest.mark.parametrize("T,L,k", [(64, 2048, 512), (16, 16384, 512), (4, 65536, 1024),
                                   (300, 9000, 512)])
def test_gpu_plans(T: int, L: int, k: int, split: bool, compact: bool) -> None:
    """Every plan (stream / split long rows, with and without compaction in registers) at real
    shapes, whatever the op would pick."""
    from dsv4.ops.triton_topk import topk_indices_with_block

    gen = torch.Generator(device="cuda").manual_seed(T * 3 + L + int(split) + 2 * int(compact))
    n = torch.randint(k, L + 1, (T,), generator=gen, device="cuda")
    n[0] = L
    for mode in ("randn", "ties"):
        scores = make_scores(T, L, n, mode, gen, "cuda")
        _poison()
        got = topk_indices_with_block(scores, n, k, None, split, compact=compact)
        assert torch.equal(got, torch_attn.topk_indices(scores, n, k)), mode
