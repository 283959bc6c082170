"""ParallelConfig / Parallel helpers and the torchrun environment (one process)."""

from __future__ import annotations

import pytest
import torch

from dsv4.dist.parallel import SINGLE, Parallel, ParallelConfig, init_parallel, launch_env


def test_splits_cover_every_item_once() -> None:
    for world in (1, 2, 4):
        ranks = [Parallel(r, world, r) for r in range(world)]
        even = [p.split(8, "things") for p in ranks]
        assert [hi - lo for lo, hi in even] == [8 // world] * world
        assert even[0][0] == 0 and even[-1][1] == 8
        assert all(a[1] == b[0] for a, b in zip(even, even[1:]))
        # ceil split: 10 rows over 4 ranks -> 3, 3, 3, 1
        ceil = [p.split_ceil(10) for p in ranks]
        assert sum(hi - lo for lo, hi in ceil) == 10
        assert all(a[1] == b[0] for a, b in zip(ceil, ceil[1:]))
    assert [p.split_ceil(10) for p in (Parallel(r, 4, r) for r in range(4))][-1] == (9, 10)
    with pytest.raises(ValueError, match="experts=6 does not split evenly over 4 ranks"):
        Parallel(1, 4, 1).split(6, "experts")


def test_single_process_collectives_are_identities() -> None:
    t = torch.arange(6.0).view(2, 3)
    assert SINGLE.all_reduce(t) is t
    assert SINGLE.all_gather(t, dim=1) is t
    assert SINGLE.broadcast_object({"a": 1}) == {"a": 1}
    assert SINGLE.min_int(7) == 7
    assert not SINGLE.enabled and SINGLE.is_driver
    # One rank with expert_parallel asked: nothing to split.
    assert not Parallel(expert_parallel=True).expert_parallel


def test_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert launch_env() is None
    assert init_parallel(ParallelConfig(1, expert_parallel=True)) is SINGLE
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert launch_env() == {"rank": 1, "world_size": 2, "local_rank": 1}
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK=2 is not in 0..WORLD_SIZE-1"):
        launch_env()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="must be integers"):
        launch_env()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="tensor_parallel_size=1 but the launch has WORLD_SIZE=2"):
        init_parallel(ParallelConfig(1))


def test_expert_slices_must_hold_whole_scale_blocks(tiny_paths: dict[str, str]) -> None:
    from dsv4.config import ModelConfig

    cfg = ModelConfig.from_file(tiny_paths["v4"])  # MXFP4 experts, moe_intermediate_size 128
    ParallelConfig(2).check_model(cfg)              # 64 columns: two blocks of 32
    with pytest.raises(ValueError, match=r"128 / 8 = 16\) is not a multiple of their fp4 scale "
                                         r"block 32; use expert_parallel=True"):
        ParallelConfig(8).check_model(cfg.replace(n_heads=8, o_groups=8))
    ParallelConfig(8, expert_parallel=True).check_model(cfg.replace(n_heads=8, o_groups=8))
    with pytest.raises(ValueError, match="expert_parallel=1 is invalid"):
        ParallelConfig(2, expert_parallel=1)  # type: ignore[arg-type]


def test_step_channel_messages_arrive_in_order(tmp_path) -> None:
    """The driver's objects, static-step headers (+ a tensor each), park and a re-opened channel
    reach the worker in order (two gloo processes)."""
    import json
    import os

    from test_tp_static_decode import HERE, torchrun

    out = tmp_path / "got.json"
    torchrun(os.path.join(HERE, "channel_child.py"), ["--out", str(out)], timeout=120)
    got = json.loads(out.read_text())
    assert got == [["object", {"n": 1}],
                   ["static", [4, 3, 1, 5], [7, 8, 9]],
                   ["object", ["on", "the", "channel"]],
                   ["static", [2, 1, 0, 0], [1, 2, 3]],
                   ["object", "parked"],
                   ["static", [1, 1, 0, 0], [1, 2, 3]],
                   ["object", None]]
