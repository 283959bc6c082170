"""The per-rank random-weight builder (``dsv4.dist.random_weights``): each rank gets exactly what
a sharded load of a real checkpoint gives (names, shapes, dtypes, quantized storage), the ranks'
shards put together are the single-process model of the same seed, and the values keep the
activations O(1).  No processes needed: building a shard runs no collective."""

from __future__ import annotations

import pytest
import torch

from dsv4.checkpoint import open_checkpoint
from dsv4.config import ModelConfig
from dsv4.dist.parallel import SINGLE, Parallel
from dsv4.dist.random_weights import RandomCheckpoint, build_random_model, model_bytes
from dsv4.dist.sharding import shard_plan
from dsv4.model.layers import Linear
from dsv4.model.transformer import build_model


def _loaded(path: str, cfg: ModelConfig, par: Parallel, keep_quantized: bool) -> torch.nn.Module:
    """What ``load_model(path, parallel=par)`` builds (with the storage of a GPU model when
    ``keep_quantized``), on the CPU."""
    model = build_model(cfg, numerics="bf16", backend="torch", dtype=torch.float32, parallel=par,
                        keep_quantized=keep_quantized)
    reader = open_checkpoint(path, cfg, device="cpu", dtype=torch.float32,
                             keep_quantized=keep_quantized, progress=False,
                             shard_plan=shard_plan(cfg, par))
    model.load_stream(reader.names, reader)
    return model


def _layout(model: torch.nn.Module) -> dict[str, tuple]:
    """Every tensor the model holds: (shape, dtype), quantized Linears' codes and scales too."""
    out: dict[str, tuple] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out[name] = (tuple(t.shape), t.dtype)
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.qweight is not None:
            q = m.qweight
            out[f"{name}.qweight"] = (q.fmt, tuple(q.shape), q.weight.dtype,
                                      tuple(q.weight.shape), q.scale.dtype, tuple(q.scale.shape))
    return out


@pytest.mark.parametrize("keep_quantized", [False, True])
@pytest.mark.parametrize("ep", [False, True])
def test_each_rank_gets_the_shapes_of_a_sharded_load(tiny_paths: dict[str, str], ep: bool,
                                                     keep_quantized: bool) -> None:
    path = tiny_paths["v4"]
    cfg = ModelConfig.from_file(path)
    layouts = []
    for rank in range(2):
        par = Parallel(rank, 2, rank, expert_parallel=ep)
        want = _layout(_loaded(path, cfg, par, keep_quantized))
        got_model = build_random_model(cfg, parallel=par, device="cpu", dtype=torch.float32,
                                       numerics="bf16", keep_quantized=keep_quantized, seed=3)
        got = _layout(got_model)
        assert got == want, {k: (got.get(k), want.get(k)) for k in set(got) | set(want)
                             if got.get(k) != want.get(k)}
        layouts.append(got)
        assert not any(t.is_meta for t in got_model.parameters())
        assert model_bytes(got_model)["total"] > 0
    # The ranks really hold halves: the heads and (per mode) the experts or their columns.
    w1 = "layers.1.ffn.experts.w1"
    full = _layout(build_random_model(cfg, device="cpu", dtype=torch.float32, numerics="bf16",
                                      keep_quantized=keep_quantized))
    assert layouts[0][w1][0][0] == (full[w1][0][0] // 2 if ep else full[w1][0][0])
    sink = "layers.0.attn.attn_sink"
    assert layouts[1][sink][0][0] * 2 == full[sink][0][0]


def _dense_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    return out


@pytest.mark.parametrize("ep", [False, True])
def test_shards_put_together_are_the_single_process_model(tiny_paths: dict[str, str],
                                                          ep: bool) -> None:
    cfg = ModelConfig.from_file(tiny_paths["v4"])
    kw = dict(device="cpu", dtype=torch.float32, numerics="bf16", seed=5)
    full = _dense_tensors(build_random_model(cfg, parallel=SINGLE, **kw))
    ranks = [_dense_tensors(build_random_model(
        cfg, parallel=Parallel(r, 2, r, expert_parallel=ep), **kw)) for r in range(2)]
    split = replicated = 0
    for name, want in full.items():
        parts = [r[name] for r in ranks if name in r and r[name].numel()]
        if all(p.shape == want.shape for p in parts):
            for p in parts:  # replicated (or held whole by one rank): the same values
                assert torch.equal(p, want), name
            replicated += 1
            continue
        dim = next(d for d in range(want.dim()) if parts[0].shape[d] != want.shape[d])
        assert torch.equal(torch.cat(parts, dim=dim), want), name
        split += 1
    assert split >= cfg.n_layers * 3 and replicated > split  # heads, groups, experts at least
    # Another seed gives other values.
    other = _dense_tensors(build_random_model(cfg, **{**kw, "seed": 6}))
    assert not torch.equal(other["layers.0.attn.wkv.weight"], full["layers.0.attn.wkv.weight"])


def test_values_keep_activations_order_one() -> None:
    from dsv4.tiny import tiny_config

    cfg = ModelConfig.from_dict(tiny_config("v4", num_nextn_predict_layers=0,
                                            compress_ratios=[0, 4, 128, 4, 128]))
    for keep_quantized in (False, True):
        model = build_random_model(cfg, device="cpu", dtype=torch.float32, numerics="official",
                                   keep_quantized=keep_quantized)
        logits = model.forward_full(torch.arange(3, 60))
        assert torch.isfinite(logits).all()
        assert 0.2 < float(logits.std()) < 5.0, float(logits.std())
        # A real hash table: distinct experts per token.
        tid2eid = model.layers[0].ffn.gate.tid2eid
        assert all(len(set(row)) == len(row) for row in tid2eid[:50].tolist())
        norms = model.layers[0].attn_norm.weight
        assert torch.equal(norms, torch.ones_like(norms))


def test_bad_input_is_rejected(tiny_paths: dict[str, str]) -> None:
    cfg = ModelConfig.from_file(tiny_paths["v4"])
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple of 3"):
        build_random_model(cfg, parallel=Parallel(0, 3, 0), device="cpu")
    ckpt = RandomCheckpoint(cfg, device="cpu", dtype=torch.float32)
    assert len(ckpt) == len(ckpt.names) > 0
    next(iter(ckpt))
    with pytest.raises(ValueError, match="one pass only"):
        iter(ckpt)
    with pytest.raises(ValueError, match="Engram"):
        build_random_model(ModelConfig.from_file(tiny_paths["v41"]), device="cpu")
