"""Loading without running out of memory (docs/MEMORY_PLAN.md finding 1): the model is built
on ``meta`` (nothing allocated, even for full-size V4.1 Engram tables and V4-Pro experts), the
checkpoint is streamed one tensor at a time and each tensor is put in place before the next is
read, so the peak is the model plus one tensor; the logits are those of the old load path; the
head keeps bf16 under GPU storage and still gives fp32 logits from exact products."""

from __future__ import annotations

import importlib.util
import weakref
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F

import dsv4.model.transformer as transformer_mod
from dsv4.checkpoint import CheckpointReader, load_checkpoint, open_checkpoint
from dsv4.config import ModelConfig
from dsv4.dist.parallel import Parallel
from dsv4.dist.sharding import shard_plan
from dsv4.formats import QuantWeight
from dsv4.model.layers import Linear, quantized_storage
from dsv4.model.transformer import Head, Transformer, build_model, load_model
from dsv4.tiny import make_tiny_checkpoint

GIB = 1 << 30
_REAL_CONFIGS = Path(__file__).resolve().parents[1] / "checkpoint" / "ckpt_real_configs.py"


def _real_config(name: str) -> ModelConfig:
    spec = importlib.util.spec_from_file_location("ckpt_real_configs_loading", _REAL_CONFIGS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    data = {"v41": lambda: mod.V41_FLASH, "pro": mod.v4_pro}[name]()
    return ModelConfig.from_dict(data)


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loading_ckpts")
    return {v: str(make_tiny_checkpoint(root / v, variant=v, seed=3))
            for v in ("v4", "v4-base", "v41")}


# ------------------------------------------------------------------ accounting helpers
def _logical_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size()
               for t in list(model.parameters()) + list(model.buffers()))


def _storage_bytes(model: torch.nn.Module) -> tuple[int, set[int]]:
    """Bytes of real (non-meta) storage the model holds, and the data pointers of it."""
    seen: set[int] = set()
    total = 0
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if not t.is_meta]
    for m in model.modules():
        if isinstance(m, Linear) and m.qweight is not None:
            tensors += [m.qweight.weight, m.qweight.scale]
    for t in tensors:
        if t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total, seen


def _value_tensors(v: Any) -> list[torch.Tensor]:
    return [v.weight, v.scale] if isinstance(v, QuantWeight) else [v]


def _value_bytes(v: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _value_tensors(v))


class _LoadProbe:
    """Wraps the checkpoint stream: at every tensor read, records the model's own storage and
    the values read earlier that are still alive outside it (weak references)."""

    def __init__(self) -> None:
        self.model: Transformer | None = None
        self.refs: list[tuple[str, weakref.ref, int]] = []
        self.steps: list[tuple[int, int, int]] = []  # (model bytes, leaked bytes, value bytes)
        self.reads = 0

    def leaked(self) -> tuple[int, list[str]]:
        assert self.model is not None
        _, ptrs = _storage_bytes(self.model)
        held_qweights = {id(m.qweight) for m in self.model.modules()
                         if isinstance(m, Linear) and m.qweight is not None}
        total, names = 0, []
        for name, ref, nbytes in self.refs:
            obj = ref()
            if obj is None or id(obj) in held_qweights:
                continue
            if all(t.data_ptr() in ptrs for t in _value_tensors(obj)):
                continue  # alive only as the model's own storage
            total += nbytes
            names.append(name)
        return total, names

    def wrap(self, stream: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, value in stream:
            self.reads += 1
            leaked, names = self.leaked()
            assert leaked == 0, f"values read earlier still alive outside the model: {names[:4]}"
            held, _ = _storage_bytes(self.model)
            self.steps.append((held, leaked, _value_bytes(value)))
            self.refs.append((name, weakref.ref(value), _value_bytes(value)))
            yield name, value
            del value


def _probe_load(monkeypatch: pytest.MonkeyPatch, path: str, **kw: Any
                ) -> tuple[Transformer, _LoadProbe]:
    probe = _LoadProbe()
    real_build = transformer_mod.build_model
    real_read = CheckpointReader._read

    def build(*a: Any, **k: Any) -> Transformer:
        probe.model = real_build(*a, **k)
        return probe.model

    def read(self: CheckpointReader) -> Iterator[tuple[str, Any]]:
        return probe.wrap(real_read(self))

    monkeypatch.setattr(transformer_mod, "build_model", build)
    monkeypatch.setattr(CheckpointReader, "_read", read)
    model = load_model(path, **kw)
    monkeypatch.undo()
    return model, probe


# ------------------------------------------------------------------ (b) nothing preallocated
@pytest.mark.parametrize("name,world,rank", [("v41", 1, 0), ("v41", 8, 5), ("pro", 8, 0)])
def test_full_size_construction_allocates_nothing(name: str, world: int, rank: int) -> None:
    """The real V4.1-Flash (Engram tables [~384M, 256] e4m3 per layer) and V4-Pro configs build
    with every tensor on meta: no storage at all, whatever the logical size."""
    cfg = _real_config(name)
    par = Parallel(rank=rank, world_size=world, expert_parallel=True) if world > 1 else None
    model = build_model(cfg, dtype=torch.bfloat16, parallel=par, keep_quantized=True)
    tensors = list(model.parameters()) + list(model.buffers())
    assert tensors and all(t.is_meta for t in tensors)
    assert _storage_bytes(model)[0] == 0
    logical = _logical_bytes(model)
    if name == "v41":
        table = model.layers[cfg.engram_layer_ids[0]].engram.embed
        rows = cfg.engram_num_embeddings[0]
        assert table.weight.is_meta and table.weight.dtype == torch.float8_e4m3fn
        assert table.weight.shape == (-(-rows // world), cfg.engram_head_dim)
        # one process holds the whole model (~474 GiB); a rank of 8 about an eighth of it
        assert logical > (400 * GIB if world == 1 else 50 * GIB)
    else:
        assert model.layers[3].ffn.experts.w1.shape[0] == cfg.n_routed_experts // world
        assert logical > 100 * GIB
    # GPU storage keeps the checkpoint formats: MXFP4 experts, bf16 head.
    assert model.layers[3].ffn.experts.w1.dtype == torch.int8
    assert model.head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_load_peaks_at_model_plus_one_tensor(monkeypatch: pytest.MonkeyPatch,
                                             tiny_paths: dict[str, str], variant: str) -> None:
    """The model owns no storage before the first tensor; while loading, its storage never
    exceeds what it finally holds, and no value read earlier outlives its assignment unless it
    became the model's storage: peak <= final model + the one tensor in flight."""
    model, probe = _probe_load(monkeypatch, tiny_paths[variant])
    final, _ = _storage_bytes(model)
    assert probe.reads == len(probe.refs) > 100
    assert probe.steps[0][0] == 0  # nothing allocated at construction
    assert probe.leaked()[0] == 0
    peak = max(held + value for held, _, value in probe.steps)
    largest = max(value for _, _, value in probe.steps)
    assert all(held <= final for held, _, _ in probe.steps)
    assert peak <= final + largest
    assert not any(t.is_meta for t in model.parameters())


def test_quantized_storage_adopts_loaded_tensors(tiny_paths: dict[str, str]) -> None:
    """GPU storage composed on CPU (build_model(keep_quantized) + open_checkpoint + load_stream):
    FP8 weights and the Engram table are the loaded tensors themselves (no copy); the routed
    experts fill one stack allocated at the first expert; logits equal the old load path."""
    path = tiny_paths["v41"]
    cfg = ModelConfig.from_file(path)
    model = build_model(cfg, dtype=torch.float32, keep_quantized=True)
    reader = open_checkpoint(path, cfg, dtype=torch.float32, keep_quantized=True, progress=False)
    seen: dict[str, Any] = {}
    table_name = f"layers.{cfg.engram_layer_ids[0]}.engram.embed.weight"
    wq_name = "layers.2.attn.wq_a.weight"

    def keep(stream: CheckpointReader) -> Iterator[tuple[str, Any]]:
        for name, value in stream:
            if name in (table_name, wq_name):
                seen[name] = value
            yield name, value

    model.load_stream(reader.names, keep(reader))
    table = model.layers[cfg.engram_layer_ids[0]].engram.embed
    assert table.weight.data_ptr() == seen[table_name].weight.data_ptr()
    assert table.scale.data_ptr() == seen[table_name].scale.data_ptr()
    assert model.layers[2].attn.wq_a.qweight is seen[wq_name]
    assert model.layers[2].ffn.experts.w1.dtype == torch.int8

    with quantized_storage(True):
        old = Transformer(cfg, dtype=torch.float32)
    old.load_tensors(load_checkpoint(path, cfg, dtype=torch.float32, keep_quantized=True,
                                     progress=False), consume=True)
    from dsv4.model.engram import build_compressed_token_map
    from dsv4.tokenizer import load_tokenizer
    token_map, n = build_compressed_token_map(load_tokenizer(path))
    for m in (model, old):
        m.set_engram_token_map(token_map, n)
    ids = torch.arange(2, 30)
    assert torch.equal(model.forward_full(ids), old.forward_full(ids))


# ------------------------------------------------------------------ (a) same logits as before
@pytest.mark.parametrize("variant", ["v4", "v4-base"])
def test_streamed_load_gives_the_old_logits(tiny_paths: dict[str, str], variant: str) -> None:
    """load_model (meta build + stream) == a model built with storage and filled from the whole
    checkpoint dict (the previous path), bit for bit."""
    path = tiny_paths[variant]
    cfg = ModelConfig.from_file(path)
    new = load_model(path)
    old = Transformer(cfg, dtype=torch.float32)
    old.load_tensors(load_checkpoint(path, cfg, dtype=torch.float32, progress=False),
                     consume=True)
    for (name, a), (_, b) in zip(new.state_dict().items(), old.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    ids = torch.randint(2, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(new.forward_full(ids), old.forward_full(ids))


def test_tensor_parallel_ranks_stream_their_shard(tiny_paths: dict[str, str]) -> None:
    """A rank of a TP2+EP launch builds on meta and streams only its shard (shard_plan)."""
    path = tiny_paths["v4"]
    cfg = ModelConfig.from_file(path)
    par = Parallel(rank=1, world_size=2, expert_parallel=True)
    model = build_model(cfg, dtype=torch.float32, parallel=par)
    reader = open_checkpoint(path, cfg, dtype=torch.float32, progress=False,
                             shard_plan=shard_plan(cfg, par))
    half = cfg.n_routed_experts // 2
    assert "layers.1.ffn.experts.0.w1.weight" not in reader.names
    assert f"layers.1.ffn.experts.{half}.w1.weight" in reader.names
    model.load_stream(reader.names, reader)
    full = load_checkpoint(path, cfg, dtype=torch.float32, progress=False)
    torch.testing.assert_close(model.layers[1].ffn.experts.w1[0],
                               full[f"layers.1.ffn.experts.{half}.w1.weight"], rtol=0, atol=0)
    sink = full["layers.1.attn.attn_sink"]
    assert torch.equal(model.layers[1].attn.attn_sink, sink[sink.numel() // 2:])


# ------------------------------------------------------------------ stream contract / errors
def test_reader_is_lazy_and_single_pass(tiny_paths: dict[str, str]) -> None:
    reader = open_checkpoint(tiny_paths["v4"], dtype=torch.float32, progress=False)
    assert len(reader) == len(reader.names) > 100
    it = iter(reader)
    first = [next(it) for _ in range(3)]
    assert [n for n, _ in first] == reader.names[:3]
    with pytest.raises(ValueError, match="one pass"):
        iter(reader)
    assert len(list(it)) == len(reader.names) - 3


def test_stream_errors_name_the_problem(tiny_paths: dict[str, str]) -> None:
    path = tiny_paths["v4"]
    cfg = ModelConfig.from_file(path)
    model = build_model(cfg, dtype=torch.float32)
    names = open_checkpoint(path, cfg, progress=False).names
    with pytest.raises(ValueError, match=r"1 missing \(head\.weight\)"):
        model.load_stream([n for n in names if n != "head.weight"], iter(()))
    # The stream ends before every announced tensor arrived.
    reader = open_checkpoint(path, cfg, dtype=torch.float32, progress=False)
    short = (item for i, item in enumerate(reader) if i < 10)
    with pytest.raises(ValueError, match="ended early"):
        build_model(cfg, dtype=torch.float32).load_stream(reader.names, short)
    # A tensor no target fills stays on meta: named, not silently garbage.
    model = build_model(cfg, dtype=torch.float32)
    model.norm.register_buffer("scratch", torch.empty(3, device="meta"), persistent=False)
    reader = open_checkpoint(path, cfg, dtype=torch.float32, progress=False)
    with pytest.raises(ValueError, match=r"still on the meta device\): norm\.scratch"):
        model.load_stream(reader.names, reader)
    # Shape checks still apply to meta placeholders.
    model = build_model(cfg, dtype=torch.float32)
    reader = open_checkpoint(path, cfg, dtype=torch.float32, progress=False)
    bad = ((n, torch.zeros(cfg.hc_mult + 1) if n == "hc_head_base" else v) for n, v in reader)
    with pytest.raises(ValueError, match=r"hc_head_base: expected shape \(4,\)"):
        model.load_stream(reader.names, bad)


# ------------------------------------------------------------------ (c) the head
def test_head_dtype_rule() -> None:
    assert Head(16, 8, torch.float32).weight.dtype == torch.float32
    assert Head(16, 8, torch.bfloat16).weight.dtype == torch.float32  # dense (CPU) storage
    with quantized_storage(True):
        assert Head(16, 8, torch.bfloat16).weight.dtype == torch.bfloat16
        assert Head(16, 8, torch.float32).weight.dtype == torch.float32


def test_bf16_head_logits_are_exact_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 head gives the fp32 logits of its (exact) values: chunked over the vocabulary on
    CPU, for bf16 and fp32 hidden states alike."""
    gen = torch.Generator().manual_seed(0)
    vocab, dim = 300, 64
    w = torch.randn(vocab, dim, generator=gen).to(torch.bfloat16)
    with quantized_storage(True):
        head = Head(vocab, dim, torch.bfloat16)
    head.weight.data.copy_(w)
    monkeypatch.setattr(transformer_mod, "_HEAD_CHUNK_BYTES", 4 * dim * 7)  # 7 rows a chunk
    for hidden in (torch.randn(5, dim, generator=gen).to(torch.bfloat16),
                   torch.randn(2, 3, dim, generator=gen)):
        got = head(hidden)
        assert got.dtype == torch.float32 and got.shape == (*hidden.shape[:-1], vocab)
        ref = (hidden.double() @ w.double().T)
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-5)
        fp32_head = F.linear(hidden.float(), w.float())
        torch.testing.assert_close(got, fp32_head, rtol=1e-6, atol=1e-5)


def test_cpu_head_stays_fp32(tiny_paths: dict[str, str]) -> None:
    model = load_model(tiny_paths["v4"])
    assert model.head.weight.dtype == torch.float32
    hidden = torch.randn(3, model.cfg.dim)
    assert torch.equal(model.compute_logits(hidden), F.linear(hidden, model.head.weight))
