"""``dsv4.ops.streams`` on the CPU: the side lane is a no-op off CUDA, and the split-K counters
of the two lanes are separate buffers (two concurrently running launches never share one)."""

from __future__ import annotations

import pytest
import torch

from dsv4.ops import streams
from dsv4.ops import triton_dense as td


def test_side_lane_off_cuda_runs_in_order() -> None:
    with streams.side_lane(torch.device("cpu")) as lane:
        assert lane is None
        assert streams.current_lane() == 0
    streams.join_side_lane(torch.device("cpu"))      # nothing forked: no-op
    assert streams.current_lane() == 0


def test_split_k_counters_are_per_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(td, "_splitk_counter_cache", {})
    cpu = torch.device("cpu")
    main = td.splitk_counters(cpu, 8)
    assert td.splitk_counters(cpu, 8) is main
    monkeypatch.setattr(streams, "_lane", 1)
    side = td.splitk_counters(cpu, 8)
    assert side is not main and not side.any()
    assert td.splitk_counters(cpu, 8) is side
    monkeypatch.setattr(streams, "_lane", 0)
    assert td.splitk_counters(cpu, 8) is main
    assert set(td._splitk_counter_cache) == {cpu, (cpu, 1)}


def test_disabled_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4_SIDE_STREAM", "0")
    assert not streams.side_stream_enabled()
    monkeypatch.setenv("DSV4_SIDE_STREAM", "1")
    assert streams.side_stream_enabled()


def test_long_steps_run_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above SIDE_LANE_MAX_TOKENS the body runs on the current stream (prefill kernels fill the
    GPU alone), whatever the device."""
    dev = torch.device("cuda", 0)   # never touched: the token check comes first
    with streams.side_lane(dev, streams.SIDE_LANE_MAX_TOKENS + 1) as lane:
        assert lane is None and streams.current_lane() == 0


def test_branch_and_comb_lanes_off_cuda_and_outside_the_side_lane(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The branch lane forks only inside the side lane (and on CUDA); the comb lane only inside
    a CUDA model step: elsewhere both run in order and their joins are no-ops."""
    cpu, dev = torch.device("cpu"), torch.device("cuda", 0)
    with streams.branch_lane(cpu) as lane:
        assert lane is None and streams.current_lane() == 0
    with streams.branch_lane(dev) as lane:       # on the main lane: never touches the GPU
        assert lane is None and streams.current_lane() == 0
    streams.join_branch_lane(cpu)
    monkeypatch.setattr(streams, "_lane", 1)
    monkeypatch.setenv("DSV4_BRANCH_LANE", "0")
    with streams.branch_lane(dev) as lane:
        assert lane is None and streams.current_lane() == 1
    monkeypatch.setattr(streams, "_lane", 0)
    with streams.deferred_comb(cpu, 1):
        assert not streams.comb_lane_active(cpu)
    streams.join_comb_lane(cpu)
    monkeypatch.setenv("DSV4_COMB_LANE", "0")
    with streams.deferred_comb(dev, 1):          # disabled: no state, no GPU touched
        assert not streams.comb_lane_active(dev)


def test_branch_lane_has_its_own_split_k_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(td, "_splitk_counter_cache", {})
    cpu = torch.device("cpu")
    monkeypatch.setattr(streams, "_lane", 1)
    side = td.splitk_counters(cpu, 8)
    monkeypatch.setattr(streams, "_lane", 2)
    branch = td.splitk_counters(cpu, 8)
    assert branch is not side and set(td._splitk_counter_cache) == {(cpu, 1), (cpu, 2)}


@pytest.mark.parametrize("flag_name", ["KV_ON_SIDE_LANE", "INDEX_KEYS_ON_BRANCH"])
def test_branch_placement_keeps_the_bits(monkeypatch: pytest.MonkeyPatch, flag_name: str
                                         ) -> None:
    """attention.KV_ON_SIDE_LANE (the window branch) and INDEX_KEYS_ON_BRANCH (the CSA index
    keys) only move where work is issued: a V4 schedule model (window, window, CSA, HCA layers;
    fp8 records) gives the same logits either way, at prefill and at decode (on the CPU both
    run in order; the GPU check is the launch A/B of bench/flash_bench.py)."""
    from bench import flash_bench as fb
    from dsv4.cache.formats import RECORD_DTYPE
    from dsv4.cache.tensors import HybridCache
    from dsv4.model import attention
    from dsv4.model.context import StepContext, pages_needed

    monkeypatch.setattr(fb, "DEV", "cpu")
    torch.manual_seed(0)
    model = fb.build_model(4, tiny=True)
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (70,))
    pages = list(range(pages_needed(80, fb.PAGE)))
    outs = []
    for flag in (0, 1):
        monkeypatch.setattr(attention, flag_name, flag)
        cache = HybridCache.allocate(cfg, num_pages=len(pages), num_slots=1, page_size=fb.PAGE,
                                     dtype=RECORD_DTYPE, device="cpu")
        pre = model.compute_logits(model.forward(
            StepContext.build(ids, [70], [0], [0], [pages]), cache))
        dec = model.compute_logits(model.forward(
            StepContext.build(ids[:1], [1], [70], [0], [pages]), cache))
        outs.append((pre, dec))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
