"""load_checkpoint: tiny checkpoints of every variant, and every malformed input."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsv4.checkpoint as ckpt
from dsv4.checkpoint import expected_tensors, load_checkpoint
from dsv4.config import ModelConfig
from dsv4.formats import QuantWeight


@pytest.fixture()
def v4_copy(tiny_dirs: dict[str, Path], tmp_path: Path) -> Path:
    dst = tmp_path / "v4"
    shutil.copytree(tiny_dirs["v4"], dst)
    return dst


def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def _edit(path: Path, fn) -> None:
    """Apply ``fn(name -> tensor dict)`` to every shard of a checkpoint and rewrite the index."""
    index = _index(path)
    new_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(path / shard)
        fn(tensors, shard)
        save_file(tensors, path / shard)
        new_map.update({k: shard for k in tensors})
    index["weight_map"] = new_map
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _shard_of(path: Path, name: str) -> str:
    return _index(path)["weight_map"][name]


# ------------------------------------------------------------------------------ good loads
@pytest.mark.parametrize("variant", ["v4", "v4-base", "v41", "v4-bf16"])
def test_load_every_variant(tiny_dirs: dict[str, Path], variant: str) -> None:
    path = tiny_dirs[variant]
    specs = expected_tensors(ModelConfig.from_file(path))
    sd = load_checkpoint(path, dtype=torch.float32, progress=False)
    assert list(sd) == list(specs)
    assert not any(n.endswith(".scale") for n in sd)
    for name, t in sd.items():
        if specs[name].fmt == "mxfp8":  # Engram tables stay quantized (dequantized on lookup)
            assert isinstance(t, QuantWeight) and t.fmt == "mxfp8", name
            continue
        assert isinstance(t, torch.Tensor), name
        if name.endswith("tid2eid"):
            assert t.dtype == torch.int64
        else:
            assert t.dtype == torch.float32, name
        assert torch.isfinite(t.float()).all(), name
    qd = load_checkpoint(path, dtype=torch.float32, keep_quantized=True, progress=False)
    for name, t in qd.items():
        spec = specs[name]
        if spec.fmt == "mxfp8":
            assert torch.equal(t.weight.view(torch.uint8), sd[name].weight.view(torch.uint8))
        elif spec.scale_shape is not None and not name.endswith("attn.wo_a.weight"):
            assert isinstance(t, QuantWeight) and t.fmt == spec.fmt, name
            assert torch.equal(t.dequantize(torch.float32), sd[name]), name
        else:
            assert isinstance(t, torch.Tensor) and torch.equal(t, sd[name]), name


def test_dtypes_and_formats_of_v4(tiny_dirs: dict[str, Path]) -> None:
    sd = load_checkpoint(tiny_dirs["v4"], keep_quantized=True, progress=False)
    assert sd["embed.weight"].dtype == torch.bfloat16  # the default dtype
    for name in ("hc_head_fn", "layers.1.hc_attn_base", "layers.1.attn.attn_sink",
                 "layers.1.attn.compressor.ape", "layers.1.ffn.gate.bias"):
        assert sd[name].dtype == torch.float32, name
    assert sd["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    e = sd["layers.2.ffn.experts.0.w1.weight"]
    assert isinstance(e, QuantWeight) and e.fmt == "fp4" and e.weight.shape == (128, 128)
    w = sd["layers.2.attn.wq_b.weight"]
    assert isinstance(w, QuantWeight) and w.fmt == "fp8" and w.block == 128
    assert w.scale.dtype == torch.float8_e8m0fnu
    wo_a = sd["layers.2.attn.wo_a.weight"]  # dense even when keep_quantized (spec §2.4)
    assert isinstance(wo_a, torch.Tensor) and wo_a.dtype == torch.bfloat16
    assert wo_a.shape == (256, 256)
    base = load_checkpoint(tiny_dirs["v4-base"], keep_quantized=True, progress=False)
    e = base["layers.2.ffn.experts.0.w2.weight"]
    assert e.fmt == "fp8" and e.scale.dtype == torch.float32
    v41 = load_checkpoint(tiny_dirs["v41"], keep_quantized=True, progress=False)
    table = v41["layers.1.engram.embed.weight"]
    assert isinstance(table, QuantWeight) and table.fmt == "mxfp8" and table.block == 32
    assert v41["layers.2.attn.wq_a.weight"].block == 32


def test_single_file_checkpoint(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    src = tiny_dirs["v4"]
    merged: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        merged.update(load_file(shard))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    save_file(merged, tmp_path / "model.safetensors")
    a = load_checkpoint(tmp_path, dtype=torch.float32, progress=False)
    b = load_checkpoint(tmp_path / "model.safetensors", dtype=torch.float32, progress=False)
    c = load_checkpoint(src, dtype=torch.float32, progress=False)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)


def test_every_tensor_read_once_and_no_bar_off_tty(tiny_dirs: dict[str, Path],
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    reads: Counter[str] = Counter()
    orig = ckpt._Shards.read

    def counting(self, entry, name, device):
        reads[name] += 1
        return orig(self, entry, name, device)

    monkeypatch.setattr(ckpt._Shards, "read", counting)
    load_checkpoint(tiny_dirs["v4"], progress=True)
    weight_map = _index(tiny_dirs["v4"])["weight_map"]
    assert set(reads) == set(weight_map)
    assert set(reads.values()) == {1}
    assert "loading checkpoint" not in capsys.readouterr().err  # stderr is not a TTY here


def test_strict_mtp(v4_copy: Path) -> None:
    _edit(v4_copy, lambda t, _: [t.pop(k) for k in list(t) if k.startswith("mtp.")])
    with pytest.raises(ValueError, match=r"missing tensor 'mtp\.0\."):
        load_checkpoint(v4_copy, progress=False)
    sd = load_checkpoint(v4_copy, strict_mtp=False, progress=False)
    assert not any(k.startswith("mtp.") for k in sd) and "layers.4.attn_norm.weight" in sd


# ------------------------------------------------------------------------------ malformed
def _no_data_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if any tensor data is read: validation must come first."""
    def boom(*a, **k):
        raise AssertionError("tensor data was read before validation finished")
    monkeypatch.setattr(ckpt._Shards, "read", boom)


def test_missing_tensor(v4_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _edit(v4_copy, lambda t, _: t.pop("layers.1.attn.wq_a.weight", None))
    _no_data_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.1\.attn\.wq_a\.weight'.*fp8"):
        load_checkpoint(v4_copy, progress=False)


def test_unexpected_tensor(v4_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def add(t, shard):
        if "00001" in shard:
            t["layers.0.attn.bogus.weight"] = torch.zeros(3)
    _edit(v4_copy, add)
    _no_data_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"unexpected tensor 'layers\.0\.attn\.bogus\.weight'"):
        load_checkpoint(v4_copy, progress=False)


def test_wrong_shape(v4_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "layers.0.attn_norm.weight"

    def shrink(t, _):
        if name in t:
            t[name] = t[name][:255].clone()
    _edit(v4_copy, shrink)
    _no_data_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"'layers\.0\.attn_norm\.weight'.*expected BF16 \[256\]"
                                         r".*found BF16 \[255\]"):
        load_checkpoint(v4_copy, progress=False)


def test_wrong_dtype(v4_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "layers.2.attn.attn_sink"

    def cast(t, _):
        if name in t:
            t[name] = t[name].bfloat16()
    _edit(v4_copy, cast)
    _no_data_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"'layers\.2\.attn\.attn_sink'.*expected F32.*found BF16"):
        load_checkpoint(v4_copy, progress=False)


def test_missing_and_wrong_scale(v4_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def edit(t, _):
        t.pop("layers.3.attn.wkv.scale", None)
        if "layers.3.attn.wq_a.scale" in t:
            t["layers.3.attn.wq_a.scale"] = t["layers.3.attn.wq_a.scale"].float()
    _edit(v4_copy, edit)
    _no_data_reads(monkeypatch)
    with pytest.raises(ValueError) as err:
        load_checkpoint(v4_copy, progress=False)
    msg = str(err.value)
    assert "missing tensor 'layers.3.attn.wkv.scale'" in msg
    assert "'layers.3.attn.wq_a.scale'" in msg and "expected F8_E8M0" in msg
    assert "2 problems" in msg


def test_extra_scale_on_unquantized_weight(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "bf16"
    shutil.copytree(tiny_dirs["v4-bf16"], path)

    def add(t, shard):
        if "layers.0.attn.wq_a.weight" in t:
            t["layers.0.attn.wq_a.scale"] = torch.ones(1, 2)
    _edit(path, add)
    with pytest.raises(ValueError, match=r"unexpected tensor 'layers\.0\.attn\.wq_a\.scale'"):
        load_checkpoint(path, progress=False)


def test_index_names_missing_shard(v4_copy: Path) -> None:
    shard = _shard_of(v4_copy, "layers.4.attn.wq_a.weight")
    os.remove(v4_copy / shard)
    with pytest.raises(FileNotFoundError, match=shard):
        load_checkpoint(v4_copy, progress=False)


def test_index_maps_tensor_to_wrong_shard(v4_copy: Path) -> None:
    index = _index(v4_copy)
    shards = sorted(set(index["weight_map"].values()))
    name = "layers.0.attn_norm.weight"
    index["weight_map"][name] = next(s for s in shards if s != index["weight_map"][name])
    (v4_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"maps tensor 'layers\.0\.attn_norm\.weight'"):
        load_checkpoint(v4_copy, progress=False)


def test_truncated_shard(v4_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shard = v4_copy / _shard_of(v4_copy, "layers.4.attn.wq_a.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    _no_data_reads(monkeypatch)
    with pytest.raises(ValueError, match=rf"{shard.name}: truncated file"):
        load_checkpoint(v4_copy, progress=False)


def test_corrupt_header(v4_copy: Path) -> None:
    shard = v4_copy / _shard_of(v4_copy, "embed.weight")
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xfe{["
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{shard.name}: corrupt safetensors header"):
        load_checkpoint(v4_copy, progress=False)
    shard.write_bytes((10 ** 12).to_bytes(8, "little") + bytes(data[8:]))
    with pytest.raises(ValueError, match=rf"{shard.name}: corrupt or truncated"):
        load_checkpoint(v4_copy, progress=False)


def test_bad_or_missing_config(v4_copy: Path) -> None:
    cfg = json.loads((v4_copy / "config.json").read_text())
    cfg["compress_ratios"] = cfg["compress_ratios"][:-1]
    (v4_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="compress_ratios"):
        load_checkpoint(v4_copy, progress=False)
    cfg["model_type"] = "llama"
    (v4_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type"):
        load_checkpoint(v4_copy, progress=False)
    os.remove(v4_copy / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(v4_copy, progress=False)


def test_config_mismatch_names_tensors(tiny_dirs: dict[str, Path]) -> None:
    # A V4 checkpoint checked against the Base config: scales and experts disagree.
    cfg = ModelConfig.from_file(tiny_dirs["v4-base"])
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.wq_a\.scale'.*expected F32"):
        load_checkpoint(tiny_dirs["v4"], cfg, progress=False)


def test_missing_checkpoint_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "nope", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_checkpoint(tmp_path / "empty", progress=False)
