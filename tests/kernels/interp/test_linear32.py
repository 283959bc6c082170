"""The fp32 skinny GEMM kernel (``dsv4.ops.triton_linear32``) against its torch twin, in the
Triton interpreter: both product paths (broadcast for BM < 16, ieee dot for BM >= 16), split-K
reduced in the kernel, ragged tiles, bf16 / fp32 inputs.

Run with TRITON_INTERPRET=1 (tests/kernels/test_interpreter.py does that in a child process).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4.ops import get_ops  # noqa: E402
from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_dense as td  # noqa: E402
from dsv4.ops import triton_linear32 as tl32  # noqa: E402
from interp_helpers import rel_err  # noqa: E402
from test_dense import _program_order  # noqa: E402

CPU = torch.device("cpu")


def _counters_idle() -> bool:
    """True when the shared split-K arrival counters (if any exist yet) are all zero."""
    buf = td._splitk_counter_cache.get(CPU)
    return buf is None or not bool(buf.any())


def _fp64_ref(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x.float() @ w.T in float64 (exact for these sizes up to fp64 rounding), and Σ|terms|."""
    xd, wd = x.float().double(), w.double()
    return xd @ wd.T, xd.abs() @ wd.abs().T


def _plans(T: int) -> list[tl32.Linear32Config]:
    """A broadcast plan (BM covering T rows with BM < 16) where T allows, and dot plans."""
    plans = []
    bm = 1 << max(0, (T - 1).bit_length())
    if bm < 16:
        plans.append(tl32.Linear32Config(BM=bm, BN=32, BK=32))
    plans.append(tl32.Linear32Config(BM=16, BN=64, BK=32))  # T = 17: two M tiles
    return plans


@pytest.mark.parametrize("T,N,K", [(1, 48, 256), (3, 300, 512), (17, 100, 320)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear32_matches_twin_every_split(T: int, N: int, K: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(T * 1000 + N + K)
    x = (torch.randn(T, K, generator=gen) * 2).to(dtype)
    w = torch.randn(N, K, generator=gen) * 0.05
    twin = ref.linear_fp32(x, w)
    exact, magnitude = _fp64_ref(x, w)
    assert twin.dtype == torch.float32 and twin.shape == (T, N)
    for base in _plans(T):
        for split in (1, 2, 3):
            cfg = tl32.Linear32Config(BM=base.BM, BN=base.BN, BK=base.BK, split_k=split)
            y = tl32.linear_fp32_with_config(x, w, cfg)
            assert y.dtype == torch.float32 and y.shape == (T, N), cfg
            assert torch.isfinite(y).all(), cfg
            # fp32 summation in any order: within ~K ulps of Σ|terms| of the exact value.
            bound = 2 * K * 2.0 ** -24 * magnitude
            assert ((y.double() - exact).abs() <= bound).all(), cfg
            assert rel_err(y, twin) < 2e-6, (cfg, rel_err(y, twin))
            again = tl32.linear_fp32_with_config(x, w, cfg)
            assert torch.equal(y, again), f"not bit-reproducible: {cfg}"
            assert _counters_idle(), f"a tile's arrival counter was left non-zero: {cfg}"


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_linear32_split_k_bits_do_not_depend_on_arrival_order(monkeypatch: pytest.MonkeyPatch,
                                                              order: str) -> None:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 448, generator=gen)
    w = torch.randn(80, 448, generator=gen)
    for cfg in (tl32.Linear32Config(BM=4, BN=32, BK=32, split_k=4),    # 14 chunks: 4+4+4+2
                tl32.Linear32Config(BM=16, BN=32, BK=32, split_k=4)):
        first = tl32.linear_fp32_with_config(x, w, cfg)
        with _program_order(monkeypatch, order):
            other = tl32.linear_fp32_with_config(x, w, cfg)
        # Another split arrived last in each tile, yet the sum order (0..3) is the same.
        assert torch.equal(first, other), cfg
        assert _counters_idle()
        assert rel_err(first, ref.linear_fp32(x, w)) < 2e-6


def test_linear32_picked_plan_and_op_table() -> None:
    """The public op (picked plan; with the interpreter the CPU tensors run the kernel) and its
    entry in the triton op table."""
    gen = torch.Generator().manual_seed(5)
    ops = get_ops("triton")
    assert ops.linear_fp32 is tl32.linear_fp32
    for T, N, K in ((1, 256, 512), (5, 96, 384), (64, 64, 256)):
        x = torch.randn(T, K, generator=gen).to(torch.bfloat16)
        w = torch.randn(N, K, generator=gen)
        cfg = tl32.pick_linear32_config(T, N, K, CPU)
        assert cfg.BM >= T and (cfg.BM >= 16) == (T > 4), cfg
        y = ops.linear_fp32(x, w)
        y2 = ops.linear_fp32(x, w)
        assert torch.equal(y, y2)
        assert rel_err(y, ref.linear_fp32(x, w)) < 2e-6, (T, N, K)
        assert _counters_idle()


def test_linear32_outside_kernel_rows_runs_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """One row, and more than MAX_KERNEL_ROWS rows of an fp32 x, go to the twin (cuBLAS on the
    GPU, faster there as measured): no kernel launch."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(32, 64, generator=gen)

    def no_launch(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the kernel ran outside its row range")

    monkeypatch.setattr(tl32, "linear_fp32_with_config", no_launch)
    for T in (tl32.MIN_KERNEL_ROWS - 1, tl32.MAX_KERNEL_ROWS + 1):
        x = torch.randn(T, 64, generator=gen)
        assert torch.equal(tl32.linear_fp32(x, w), ref.linear_fp32(x, w))
    # Decode-sized bf16 rows above the kernel's range: cuBLAS too, not the prefill path.
    x = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    assert 64 < tl32.PREFILL_MIN_ROWS
    assert torch.equal(tl32.linear_fp32(x, w), ref.linear_fp32(x, w))


def test_linear32_strided_x_and_odd_dtype() -> None:
    """A row-strided x (a column slice) and a float64 x (cast to fp32 as the twin does)."""
    gen = torch.Generator().manual_seed(7)
    big = torch.randn(5, 400, generator=gen)
    x = big[:, 16:272]                                 # [5, 256], row stride 400
    w = torch.randn(40, 256, generator=gen)
    cfg = tl32.Linear32Config(BM=16, BN=32, BK=32, split_k=2)
    assert rel_err(tl32.linear_fp32_with_config(x, w, cfg), ref.linear_fp32(x, w)) < 2e-6
    xd = torch.randn(2, 256, generator=gen, dtype=torch.float64)
    cfg = tl32.Linear32Config(BM=2, BN=64, BK=32, split_k=3)
    assert rel_err(tl32.linear_fp32_with_config(xd, w, cfg), ref.linear_fp32(xd, w)) < 2e-6


def test_linear32_empty_shapes() -> None:
    w = torch.randn(24, 64)
    assert tl32.linear_fp32(torch.randn(0, 64), w).shape == (0, 24)
    y = tl32.linear_fp32(torch.randn(3, 0), torch.randn(24, 0))
    assert y.shape == (3, 24) and not y.any()


@pytest.mark.parametrize("fn", [tl32.linear_fp32, ref.linear_fp32])
def test_linear32_rejects_bad_inputs(fn) -> None:
    w = torch.randn(16, 64)
    with pytest.raises(ValueError, match="linear_fp32: x must be a 2-D float"):
        fn(torch.randn(2, 3, 64), w)
    with pytest.raises(ValueError, match="linear_fp32: x must be a 2-D float"):
        fn(torch.ones(2, 64, dtype=torch.int32), w)
    with pytest.raises(ValueError, match="linear_fp32: w must be a 2-D float32 or bfloat16"):
        fn(torch.randn(2, 64), w.half())
    with pytest.raises(ValueError, match="64 input features.*K = 48"):
        fn(torch.randn(2, 64), torch.randn(16, 48))


def test_linear32_config_validation() -> None:
    with pytest.raises(ValueError, match="BN must be a power of two"):
        tl32.Linear32Config(BM=1, BN=48, BK=32)
    with pytest.raises(ValueError, match="needs BK >= 16"):
        tl32.Linear32Config(BM=16, BN=32, BK=8)
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        tl32.Linear32Config(BM=1, BN=32, BK=32, split_k=0)


def test_linear32_prefill_bf16x3(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill rows with a bf16 x through the bf16x3 dot path (exact products, fp32 sums): the
    twin's fp32 GEMM to fp32 rounding, ragged tiles included; fp32 x keeps the twin."""
    gen = torch.Generator().manual_seed(21)
    for M, N, K in ((40, 48, 96), (130, 24, 160)):
        x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
        w = torch.randn(N, K, generator=gen) * 0.3
        cfg = tl32.Linear32Config(BM=32, BN=16, BK=32, num_warps=4, num_stages=2, bf16x3=True)
        got = tl32.linear_fp32_with_config(x, w, cfg)
        assert rel_err(got, ref.linear_fp32(x, w)) < 2e-6, (M, N, K)
    assert tl32.PREFILL_BF16X3
    plan = tl32.pick_prefill_config(40, 48, 96)
    assert plan.bf16x3 and plan.split_k == 1
    x = torch.randn(40, 96, generator=gen).to(torch.bfloat16)
    w = torch.randn(48, 96, generator=gen)
    monkeypatch.setattr(tl32, "PREFILL_MIN_ROWS", 32)
    assert rel_err(tl32.linear_fp32(x, w), ref.linear_fp32(x, w)) < 2e-6
    with pytest.raises(ValueError, match="bf16x3"):
        tl32.Linear32Config(BM=8, BN=16, BK=32, bf16x3=True)


@pytest.mark.parametrize("T,N,K", [(1, 48, 256), (3, 300, 512), (17, 100, 320), (70, 40, 192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear32_bf16_weight(T: int, N: int, K: int, dtype: torch.dtype) -> None:
    """A bf16 weight (checkpoint values held compactly): the same fp32 math as its fp32 widening
    — the broadcast path upcasts the tile, the dot path takes bf16 MMAs (one for a bf16 x, three
    for an fp32 x split exactly) — every plan, every split, and the public op at every T."""
    gen = torch.Generator().manual_seed(T * 7 + N + K)
    x = (torch.randn(T, K, generator=gen) * 2).to(dtype)
    w = (torch.randn(N, K, generator=gen) * 0.05).to(torch.bfloat16)
    twin = ref.linear_fp32(x, w)
    assert torch.equal(twin, ref.linear_fp32(x, w.float()))
    exact, magnitude = _fp64_ref(x, w.float())
    bound = 2 * K * 2.0 ** -24 * magnitude
    plans = _plans(T) + [tl32.pick_bf16w_config(T, N, K, CPU)]
    for base in plans:
        for split in (1, 3):
            cfg = tl32.Linear32Config(BM=base.BM, BN=base.BN, BK=base.BK, split_k=split)
            y = tl32.linear_fp32_with_config(x, w, cfg)
            assert y.dtype == torch.float32 and y.shape == (T, N) and torch.isfinite(y).all()
            assert ((y.double() - exact).abs() <= bound).all(), cfg
            assert rel_err(y, twin) < 2e-6, (cfg, rel_err(y, twin))
            assert _counters_idle()
    y = tl32.linear_fp32(x, w)     # the picked plan: the kernel at every T for a bf16 w
    assert rel_err(y, twin) < 2e-6 and ((y.double() - exact).abs() <= bound).all()


def test_linear32_bf16_weight_never_runs_the_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 w goes to the kernel at 1 row, decode rows, mid rows and prefill rows (the twin
    would widen the whole weight on every call)."""
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(ref, "linear_fp32", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("twin ran")))
    monkeypatch.setattr(tl32, "PREFILL_MIN_ROWS", 48)
    for T in (1, 2, 16, 17, 40, 50):
        x = torch.randn(T, 64, generator=gen).to(torch.bfloat16)
        y = tl32.linear_fp32(x, w)
        assert y.shape == (T, 32)
        assert rel_err(y, x.float() @ w.float().T) < 2e-6


def test_linear32_wide_one_row_bf16_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """BF16W_WIDE_ONE_ROW (off by default): one row on 16-row tiles, 512-wide K chunks, splits
    to ~256 programs (V4-Flash on 132 SMs: the gate 8, the compressors 2 / 4 / 8), other rows
    the default rule; the kernel on it matches the twin within the fp32 summation bound."""
    monkeypatch.setattr(tl32, "BF16W_WIDE_ONE_ROW", True)
    monkeypatch.setattr(tl32, "sm_count", lambda device: 132)
    splits = {N: tl32.pick_bf16w_config(1, N, 4096, CPU).split_k for N in (2048, 1024, 512, 256)}
    assert splits == {2048: 2, 1024: 4, 512: 8, 256: 8}
    assert all((c.BM, c.BN, c.BK) == (1, 16, 512) for c in
               (tl32.pick_bf16w_config(1, N, 4096, CPU) for N in (2048, 256)))
    assert tl32.pick_bf16w_config(2, 256, 4096, CPU).BK == 256        # two rows: as before
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1024, generator=gen).to(torch.bfloat16)
    w = (torch.randn(48, 1024, generator=gen) * 0.05).to(torch.bfloat16)
    cfg = tl32.pick_bf16w_config(1, 48, 1024, CPU)
    assert (cfg.BN, cfg.BK, cfg.split_k) == (16, 512, 2)
    exact, magnitude = _fp64_ref(x, w.float())
    y = tl32.linear_fp32(x, w)
    assert ((y.double() - exact).abs() <= 2 * 1024 * 2.0 ** -24 * magnitude).all()
    assert rel_err(y, ref.linear_fp32(x, w)) < 2e-6 and _counters_idle()
