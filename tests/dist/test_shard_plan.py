"""The shard plan and the loader's shard-aware read path (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from dsv4.checkpoint import TensorShard, expected_tensors, load_checkpoint
from dsv4.config import ModelConfig
from dsv4.dist.parallel import Parallel, ParallelConfig
from dsv4.dist.sharding import shard_plan
from dsv4.formats import QuantWeight


def _dense(v: object) -> torch.Tensor:
    if isinstance(v, QuantWeight):
        return v.dequantize(torch.float32)
    assert isinstance(v, torch.Tensor)
    return v


def _same(a: object, b: object) -> bool:
    if isinstance(a, QuantWeight) or isinstance(b, QuantWeight):
        if not (isinstance(a, QuantWeight) and isinstance(b, QuantWeight)):
            return False
        return (a.fmt == b.fmt and a.shape == b.shape
                and torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
                and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8)))
    return torch.equal(a, b)  # type: ignore[arg-type]


@pytest.mark.parametrize("variant", ["v4", "v41"])
@pytest.mark.parametrize("ep", [False, True])
def test_shards_are_slices_of_the_full_tensors(tiny_paths: dict[str, str], variant: str,
                                               ep: bool) -> None:
    path = tiny_paths[variant]
    cfg = ModelConfig.from_file(path)
    full = load_checkpoint(path, cfg, dtype=torch.float32, progress=False)
    full_q = load_checkpoint(path, cfg, dtype=torch.float32, keep_quantized=True, progress=False)
    experts_seen: list[set[str]] = []
    for rank in range(2):
        par = Parallel(rank, 2, rank, expert_parallel=ep)
        plan = shard_plan(cfg, par)
        assert plan, "a 2-rank plan shards something"
        got = load_checkpoint(path, cfg, dtype=torch.float32, progress=False, shard_plan=plan)
        assert set(got) == {n for n in full if plan.get(n, True) is not None}
        for name, value in got.items():
            piece = plan.get(name)
            if piece is None:
                assert _same(value, full[name]), name
                continue
            want = _dense(full[name]).narrow(piece.dim, piece.start, piece.stop - piece.start)
            assert torch.equal(_dense(value), want), name
        experts_seen.append({n for n in got if ".experts." in n})
        # The quantized read keeps the format wherever the slice is block-aligned.
        got_q = load_checkpoint(path, cfg, dtype=torch.float32, keep_quantized=True,
                                progress=False, shard_plan=plan)
        for name, value in got_q.items():
            piece = plan.get(name)
            if piece is not None and isinstance(full_q[name], QuantWeight):
                assert isinstance(value, QuantWeight), name
                want = _dense(full_q[name]).narrow(piece.dim, piece.start,
                                                   piece.stop - piece.start)
                assert torch.equal(_dense(value), want), name
    if ep:
        # Every expert tensor is loaded by exactly one rank.
        all_experts = {n for n in full if ".experts." in n}
        assert experts_seen[0] | experts_seen[1] == all_experts
        assert not experts_seen[0] & experts_seen[1]


def test_plan_splits_heads_groups_and_engram_rows(tiny_paths: dict[str, str]) -> None:
    cfg = ModelConfig.from_file(tiny_paths["v41"])
    plans = [shard_plan(cfg, Parallel(r, 2, r)) for r in range(2)]
    hd = cfg.head_dim
    h = cfg.n_heads // 2
    assert plans[1]["layers.0.attn.wq_b.weight"] == TensorShard(0, h * hd, 2 * h * hd)
    assert plans[0]["layers.0.attn.attn_sink"] == TensorShard(0, 0, h)
    lora = cfg.o_lora_rank
    assert plans[1]["layers.0.attn.wo_b.weight"] == TensorShard(1, lora, 2 * lora)
    rows = cfg.engram_num_embeddings[0]
    name = f"layers.{cfg.engram_layer_ids[0]}.engram.embed.weight"
    a, b = plans[0][name], plans[1][name]
    assert (a.start, a.stop, b.start, b.stop) == (0, -(-rows // 2), -(-rows // 2), rows)
    assert shard_plan(cfg, Parallel()) == {}


def test_bad_plans_and_configs_are_rejected(tiny_paths: dict[str, str]) -> None:
    path = tiny_paths["v4"]
    cfg = ModelConfig.from_file(path)
    with pytest.raises(ValueError, match="'nope' is not in this checkpoint"):
        load_checkpoint(path, cfg, progress=False, shard_plan={"nope": None})
    with pytest.raises(ValueError, match=r"\[0, 999\) is not a range"):
        load_checkpoint(path, cfg, progress=False,
                        shard_plan={"layers.0.attn.attn_sink": TensorShard(0, 0, 999)})
    # A quantized shard that cuts a scale block cannot stay quantized.
    with pytest.raises(ValueError, match="does not fall on its fp8 scale blocks"):
        load_checkpoint(path, cfg, progress=False, keep_quantized=True,
                        shard_plan={"layers.0.attn.wq_b.weight": TensorShard(0, 64, 320)})
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple of 3"):
        ParallelConfig(3).check_model(cfg)
    with pytest.raises(ValueError, match="n_routed_experts=8 is not a multiple of 16"):
        ParallelConfig(16, expert_parallel=True).check_model(cfg.replace(
            n_heads=16, o_groups=16, moe_inter_dim=256))
    with pytest.raises(ValueError, match="tensor_parallel_size=0 is invalid"):
        ParallelConfig(0)
    assert len(expected_tensors(cfg)) > 0


def test_official_numerics_needs_whole_activation_blocks_per_rank() -> None:
    """Under numerics 'official' the w2 input is FP8-quantized per 128 columns: a rank's slice
    of the intermediate dim that cuts a block is refused when the model is built, with the
    numbers, instead of failing in the first step."""
    from dsv4.model.moe import Experts
    from dsv4.tiny import tiny_config

    cfg = ModelConfig.from_dict({**tiny_config("v4"), "moe_intermediate_size": 128})
    par = Parallel(0, 2, 0)                                  # 64 columns per rank
    with pytest.raises(ValueError, match=r"slice of moe_intermediate_size \(64 of 128\).*128"):
        Experts(cfg, act_block=128, dtype=torch.float32, keep_quantized=False, parallel=par)
    Experts(cfg, act_block=None, dtype=torch.float32, keep_quantized=False, parallel=par)
    Experts(cfg, act_block=128, dtype=torch.float32, keep_quantized=False,
            parallel=Parallel(0, 2, 0, expert_parallel=True))  # whole experts: fine
