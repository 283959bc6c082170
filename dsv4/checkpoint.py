"""The official checkpoint layout (spec §2.2, §2.3) and a validating safetensors loader.

``expected_tensors(cfg)`` lists every tensor a checkpoint of ``cfg`` must hold: official name,
logical shape, storage dtype, format and the companion ``.scale``.  ``load_checkpoint`` reads the
safetensors headers of every shard first, checks them against that list (names, dtypes, shapes,
scales, shard files and their sizes) and only then reads the data, memory-mapped, each tensor
once.  ``open_checkpoint`` streams the tensors one at a time (what ``load_model`` uses: the
peak is the model plus one tensor); ``load_checkpoint`` returns them all in a dict.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4.config import ModelConfig
from dsv4.formats import FP4_BLOCK, MX_BLOCK, QuantWeight, dequant_fp8_block

__all__ = ["TensorSpec", "TensorShard", "expected_tensors", "checkpoint_entries",
           "load_checkpoint", "open_checkpoint", "CheckpointReader", "read_safetensors_header",
           "is_ignored_tensor", "SAFETENSORS_DTYPES"]

# safetensors dtype strings <-> torch dtypes (those the family uses, plus common ones so a wrong
# dtype is reported by name).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "BOOL": torch.bool,
}
_ST_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_FORMAT_DTYPE = {"fp8": torch.float8_e4m3fn, "mxfp8": torch.float8_e4m3fn, "fp4": torch.int8,
                 "bf16": torch.bfloat16, "f32": torch.float32, "i64": torch.int64}
# The V4.1 vision tower is not implemented: its tensors are recognised and skipped.
_VISION_PREFIXES = ("vision.", "aligner.")
_VISION_NAMES = ("image_start", "image_end", "image_newline")


@dataclass(frozen=True)
class TensorSpec:
    """One official tensor: ``fmt`` is "fp8", "fp4", "mxfp8", "bf16", "f32" or "i64".

    ``shape`` is the logical shape ([N, K] for weights); ``stored_shape`` what the file holds
    ([N, K/2] for fp4).  Quantized formats have a ``<name-without-.weight>.scale`` companion of
    ``scale_shape`` / ``scale_dtype``; ``block`` is the FP8 block size (32 for fp4/mxfp8).
    """

    name: str
    shape: tuple[int, ...]
    fmt: str
    dtype: torch.dtype
    stored_shape: tuple[int, ...]
    scale_shape: tuple[int, ...] | None = None
    scale_dtype: torch.dtype | None = None
    block: int = 0

    @property
    def scale_name(self) -> str | None:
        """File name of the companion scale (``x.weight`` -> ``x.scale``), None if unquantized."""
        if self.scale_shape is None:
            return None
        return _scale_name(self.name)

    def describe(self) -> str:
        s = f"{self.fmt} {_ST_NAME[self.dtype]} {list(self.stored_shape)}"
        if self.scale_shape is not None:
            s += f" + scale {_ST_NAME[self.scale_dtype]} {list(self.scale_shape)}"
        return s


@dataclass(frozen=True)
class TensorShard:
    """The part ``[start, stop)`` along logical dim ``dim`` (0 rows, 1 columns) of a tensor that
    one rank of a tensor / expert parallel launch loads (``dsv4.dist.sharding``)."""

    dim: int
    start: int
    stop: int


def _scale_name(name: str) -> str:
    return (name[: -len(".weight")] if name.endswith(".weight") else name) + ".scale"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Builder:
    """Collects the TensorSpecs of one config in a fixed, readable order."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.specs: dict[str, TensorSpec] = {}
        self.scale_dtype = torch.float8_e8m0fnu if cfg.scale_dtype == "e8m0" else torch.float32

    def plain(self, name: str, shape: tuple[int, ...], fmt: str) -> None:
        shape = tuple(int(s) for s in shape)
        self.specs[name] = TensorSpec(name, shape, fmt, _FORMAT_DTYPE[fmt], shape)

    def linear(self, name: str, out_f: int, in_f: int, kind: str = "fp8") -> None:
        """A (possibly) quantized [out, in] weight; ``kind``: "fp8", "expert" or "mxfp8"."""
        cfg = self.cfg
        if not cfg.quantized:
            return self.plain(name, (out_f, in_f), "bf16")
        if kind == "expert":
            kind = "fp4" if cfg.expert_dtype == "fp4" else "fp8"
        if kind == "fp4":
            spec = TensorSpec(name, (out_f, in_f), "fp4", torch.int8, (out_f, in_f // 2),
                              (out_f, in_f // FP4_BLOCK), torch.float8_e8m0fnu, FP4_BLOCK)
        elif kind == "mxfp8":
            spec = TensorSpec(name, (out_f, in_f), "mxfp8", torch.float8_e4m3fn, (out_f, in_f),
                              (out_f, in_f // MX_BLOCK), torch.float8_e8m0fnu, MX_BLOCK)
        else:
            b = cfg.weight_block_size
            spec = TensorSpec(name, (out_f, in_f), "fp8", torch.float8_e4m3fn, (out_f, in_f),
                              (_cdiv(out_f, b), _cdiv(in_f, b)), self.scale_dtype, b)
        self.specs[name] = spec

    # ------------------------------------------------------------------ pieces
    def hc_head(self, p: str) -> None:
        n, d = self.cfg.hc_mult, self.cfg.dim
        self.plain(f"{p}hc_head_fn", (n, n * d), "f32")
        self.plain(f"{p}hc_head_base", (n,), "f32")
        self.plain(f"{p}hc_head_scale", (1,), "f32")

    def block(self, p: str, layer: int, is_mtp: bool) -> None:
        """Norms, mHC, attention and MoE of backbone layer / MTP stage ``layer``."""
        cfg = self.cfg
        d, n = cfg.dim, cfg.hc_mult
        mix = (2 + n) * n
        self.plain(f"{p}attn_norm.weight", (d,), "bf16")
        self.plain(f"{p}ffn_norm.weight", (d,), "bf16")
        for side in ("attn", "ffn"):
            self.plain(f"{p}hc_{side}_fn", (mix, n * d), "f32")
            self.plain(f"{p}hc_{side}_base", (mix,), "f32")
            self.plain(f"{p}hc_{side}_scale", (3,), "f32")
        self.attention(f"{p}attn.", layer, is_mtp)
        if cfg.is_v41 and not is_mtp and layer in cfg.engram_layer_ids:
            self.engram(f"{p}engram.", cfg.engram_layer_ids.index(layer))
        self.moe(f"{p}ffn.", layer, is_mtp)

    def attention(self, p: str, layer: int, is_mtp: bool) -> None:
        cfg = self.cfg
        d, hd, h, g = cfg.dim, cfg.head_dim, cfg.n_heads, cfg.o_groups
        self.linear(f"{p}wq_a.weight", cfg.q_lora_rank, d)
        self.plain(f"{p}q_norm.weight", (cfg.q_lora_rank,), "bf16")
        self.linear(f"{p}wq_b.weight", h * hd, cfg.q_lora_rank)
        self.linear(f"{p}wkv.weight", hd, d)
        self.plain(f"{p}kv_norm.weight", (hd,), "bf16")
        self.linear(f"{p}wo_a.weight", g * cfg.o_lora_rank, h * hd // g)
        self.linear(f"{p}wo_b.weight", d, g * cfg.o_lora_rank)
        self.plain(f"{p}attn_sink", (h,), "f32")
        r = 0 if is_mtp else cfg.ratio(layer)
        if r == 0:
            return
        n_i, d_i = cfg.index_n_heads, cfg.index_head_dim
        if not cfg.is_v41:
            coff = 2 if r == 4 else 1
            self.compressor(f"{p}compressor.", r, coff, hd)
            if r == 4:
                self.linear(f"{p}indexer.wq_b.weight", n_i * d_i, cfg.q_lora_rank)
                self.plain(f"{p}indexer.weights_proj.weight", (n_i, d), "bf16")
                self.compressor(f"{p}indexer.compressor.", 4, 2, d_i)
            return
        if layer in cfg.kv_source_layers:
            self.plain(f"{p}compressor.wkv.weight", (hd, d), "bf16")
            if r > 1:  # ratio 1 has no pooling, hence no gate (spec §4.3)
                self.plain(f"{p}compressor.wgate.weight", (hd, d), "bf16")
            self.plain(f"{p}compressor.norm.weight", (hd,), "bf16")
            self.plain(f"{p}indexer.wk.weight", (d_i, hd), "bf16")
            self.plain(f"{p}indexer.k_norm.weight", (d_i,), "bf16")
        if layer in cfg.index_source_layers:
            self.linear(f"{p}indexer.wq_b.weight", n_i * d_i, cfg.q_lora_rank)
            self.plain(f"{p}indexer.weights_proj.weight", (n_i, d), "bf16")

    def compressor(self, p: str, ratio: int, coff: int, width: int) -> None:
        d = self.cfg.dim
        self.plain(f"{p}wkv.weight", (coff * width, d), "bf16")
        self.plain(f"{p}wgate.weight", (coff * width, d), "bf16")
        self.plain(f"{p}ape", (ratio, coff * width), "f32")
        self.plain(f"{p}norm.weight", (width,), "bf16")

    def engram(self, p: str, index: int) -> None:
        cfg = self.cfg
        d, n = cfg.dim, cfg.hc_mult
        self.linear(f"{p}embed.weight", cfg.engram_num_embeddings[index], cfg.engram_head_dim,
                    kind="mxfp8")
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        self.linear(f"{p}wkv.weight", d * (n + 1), cols)
        self.plain(f"{p}q_weight", (n, d), "bf16")
        self.plain(f"{p}k_weight", (n, d), "bf16")

    def moe(self, p: str, layer: int, is_mtp: bool) -> None:
        cfg = self.cfg
        d, inter = cfg.dim, cfg.moe_inter_dim
        n_exp = cfg.n_routed_experts
        if cfg.is_v41 and is_mtp and cfg.dspark_n_routed_experts:
            n_exp = cfg.dspark_n_routed_experts
        self.plain(f"{p}gate.weight", (n_exp, d), "bf16")
        if not cfg.is_v41 and not is_mtp and cfg.is_hash_layer(layer):
            self.plain(f"{p}gate.tid2eid", (cfg.vocab_size, cfg.n_activated_experts), "i64")
        else:
            self.plain(f"{p}gate.bias", (n_exp,), "f32")
        if cfg.is_v41:
            self.plain(f"{p}gate.bias_vl", (n_exp,), "f32")
        for e in range(n_exp):
            self.linear(f"{p}experts.{e}.w1.weight", inter, d, kind="expert")
            self.linear(f"{p}experts.{e}.w2.weight", d, inter, kind="expert")
            self.linear(f"{p}experts.{e}.w3.weight", inter, d, kind="expert")
        self.linear(f"{p}shared_experts.w1.weight", inter, d)
        self.linear(f"{p}shared_experts.w2.weight", d, inter)
        self.linear(f"{p}shared_experts.w3.weight", inter, d)

    def mtp_extras(self, p: str, stage: int) -> None:
        cfg = self.cfg
        d = cfg.dim
        if not cfg.is_v41:  # V4 MTP block (spec §3.11)
            self.linear(f"{p}e_proj.weight", d, d)
            self.linear(f"{p}h_proj.weight", d, d)
            for nm in ("enorm", "hnorm", "norm"):
                self.plain(f"{p}{nm}.weight", (d,), "bf16")
            self.hc_head(p)
            return
        # V4.1 DSpark stage (spec §4.10): input projection on stage 0, heads on the last stage.
        if stage == 0:
            self.linear(f"{p}main_proj.weight", d, d * len(cfg.dspark_target_layer_ids))
            self.plain(f"{p}main_norm.weight", (d,), "bf16")
        if stage == cfg.n_mtp_layers - 1:
            rank = cfg.dspark_markov_rank
            self.plain(f"{p}norm.weight", (d,), "bf16")
            self.plain(f"{p}markov_head.embed.weight", (cfg.vocab_size, rank), "bf16")
            self.plain(f"{p}markov_head.head.weight", (cfg.vocab_size, rank), "bf16")
            self.plain(f"{p}confidence_head.proj.weight", (1, d + rank), "bf16")


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every official tensor of a checkpoint of ``cfg`` (without the vision tower), by name.

    ``.scale`` companions are described inside their weight's spec, not listed separately; see
    :func:`checkpoint_entries` for the flat list of file entries.
    """
    b = _Builder(cfg)
    b.plain("embed.weight", (cfg.vocab_size, cfg.dim), "bf16")
    b.plain("head.weight", (cfg.vocab_size, cfg.dim), "bf16")
    b.plain("norm.weight", (cfg.dim,), "bf16")
    if not cfg.is_v41:
        b.hc_head("")
    for layer in range(cfg.n_layers):
        b.block(f"layers.{layer}.", layer, is_mtp=False)
    for k in range(cfg.n_mtp_layers):
        p = f"mtp.{k}."
        b.block(p, cfg.n_layers + k, is_mtp=True)
        b.mtp_extras(p, k)
    return b.specs


def checkpoint_entries(specs: dict[str, TensorSpec]) -> dict[str, tuple[torch.dtype,
                                                                       tuple[int, ...]]]:
    """The flat file entries (weights and ``.scale`` tensors): name -> (dtype, stored shape)."""
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for s in specs.values():
        out[s.name] = (s.dtype, s.stored_shape)
        if s.scale_name is not None:
            out[s.scale_name] = (s.scale_dtype, s.scale_shape)  # type: ignore[assignment]
    return out


def is_ignored_tensor(name: str, cfg: ModelConfig) -> bool:
    """True for official tensors this engine does not load (the V4.1 vision tower)."""
    return cfg.is_v41 and (name.startswith(_VISION_PREFIXES) or name in _VISION_NAMES)


# ---------------------------------------------------------------------------------- files
@dataclass(frozen=True)
class _Entry:
    file: str
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(path: str) -> dict[str, _Entry]:
    """Parse and check one safetensors header (no tensor data is read).

    Raises ``ValueError`` naming the file for a corrupt header, an unknown dtype, data offsets
    that do not match the shape, or a file shorter than its header says.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (only {size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{path}: corrupt or truncated safetensors file: header claims "
                             f"{n} bytes but the file has {size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_size = size - 8 - n
    out: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: corrupt safetensors header entry for tensor {name!r}: "
                             f"{info!r}") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * SAFETENSORS_DTYPES[dtype].itemsize
        if end - start != nbytes or start < 0:
            raise ValueError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) has data offsets "
                             f"[{start}, {end}]: {end - start} bytes for {nbytes} expected")
        if end > data_size:
            raise ValueError(f"{path}: truncated file: tensor {name!r} ends at byte {end} of the "
                             f"data section but the file holds only {data_size} data bytes")
        out[name] = _Entry(path, dtype, tuple(int(s) for s in shape))
    return out


def _shard_files(path: str) -> tuple[str, list[str], dict[str, str] | None]:
    """(checkpoint dir, shard files, index weight_map or None) of a checkpoint path."""
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise ValueError(f"{path}: expected a checkpoint directory or a .safetensors file")
        return os.path.dirname(os.path.abspath(path)), [path], None
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index (needs a 'weight_map' "
                             f"object): {e!r}") from None
        files = []
        for shard in dict.fromkeys(weight_map.values()):
            fp = os.path.join(path, shard)
            if not os.path.isfile(fp):
                first = next(k for k, v in weight_map.items() if v == shard)
                raise FileNotFoundError(f"{index} names shard {shard!r} (e.g. for tensor "
                                        f"{first!r}) but {fp} does not exist")
            files.append(fp)
        return path, files, weight_map
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return path, [single], None
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no model.safetensors.index.json, model.safetensors or "
                                f"*.safetensors files")
    return path, files, None


def _scan(files: list[str], weight_map: dict[str, str] | None, ckpt_dir: str
          ) -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for fp in files:
        for name, e in read_safetensors_header(fp).items():
            if name in entries:
                raise ValueError(f"tensor {name!r} appears in two shards: {entries[name].file} "
                                 f"and {fp}")
            entries[name] = e
    if weight_map is not None:
        for name, shard in weight_map.items():
            fp = os.path.join(ckpt_dir, shard)
            if name not in entries or os.path.abspath(entries[name].file) != os.path.abspath(fp):
                where = "absent from every shard" if name not in entries else \
                    f"found in {entries[name].file}"
                raise ValueError(f"model.safetensors.index.json maps tensor {name!r} to {shard} "
                                 f"but it is {where}")
        extra = [n for n in entries if n not in weight_map]
        if extra:
            raise ValueError(f"tensor {extra[0]!r} (in {entries[extra[0]].file}) is not listed "
                             f"in model.safetensors.index.json ({len(extra)} such tensors)")
    return entries


def _validate(entries: dict[str, _Entry], specs: dict[str, TensorSpec], cfg: ModelConfig,
              strict_mtp: bool) -> list[TensorSpec]:
    """Check the headers against the specs; return the specs to load.  Collects every problem."""
    problems: list[str] = []
    known: set[str] = set()
    to_load: list[TensorSpec] = []
    for spec in specs.values():
        known.add(spec.name)
        if spec.scale_name:
            known.add(spec.scale_name)
        if spec.name not in entries:
            if strict_mtp or not spec.name.startswith("mtp."):
                problems.append(f"missing tensor {spec.name!r} (expected {spec.describe()})")
            continue
        e = entries[spec.name]
        want_dt = _ST_NAME[spec.dtype]
        if e.dtype != want_dt or e.shape != spec.stored_shape:
            problems.append(f"tensor {spec.name!r} in {os.path.basename(e.file)}: expected "
                            f"{want_dt} {list(spec.stored_shape)} ({spec.fmt}), found {e.dtype} "
                            f"{list(e.shape)}")
        sname = spec.scale_name
        if sname is not None:
            se = entries.get(sname)
            want_sdt = _ST_NAME[spec.scale_dtype]  # type: ignore[index]
            if se is None:
                problems.append(f"missing tensor {sname!r}: the scale of {spec.fmt} weight "
                                f"{spec.name!r} (expected {want_sdt} {list(spec.scale_shape)})")
            elif se.dtype != want_sdt or se.shape != spec.scale_shape:
                problems.append(f"tensor {sname!r} in {os.path.basename(se.file)}: expected "
                                f"{want_sdt} {list(spec.scale_shape)}, found {se.dtype} "
                                f"{list(se.shape)}")
        else:
            extra_scale = _scale_name(spec.name)
            if extra_scale in entries and extra_scale not in specs:
                problems.append(f"unexpected tensor {extra_scale!r}: weight {spec.name!r} is "
                                f"{spec.fmt} and has no scale in this config")
                known.add(extra_scale)
        to_load.append(spec)
    for name, e in entries.items():
        if name not in known and not is_ignored_tensor(name, cfg):
            problems.append(f"unexpected tensor {name!r} ({e.dtype} {list(e.shape)} in "
                            f"{os.path.basename(e.file)}) for a {_cfg_label(cfg)} config")
    if problems:
        shown = "\n  - ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(f"checkpoint does not match config.json ({len(problems)} problem"
                         f"{'s' if len(problems) > 1 else ''}):\n  - {shown}{more}")
    return to_load


def _cfg_label(cfg: ModelConfig) -> str:
    q = (f"fp8 block {cfg.weight_block_size}, {cfg.scale_dtype} scales, {cfg.expert_dtype} "
         "experts") if cfg.quantized else "bf16"
    return f"{cfg.variant} ({cfg.n_layers} layers + {cfg.n_mtp_layers} mtp, {q})"


def _progress(total: int, enabled: bool) -> "_Bar":
    return _Bar(total, enabled and sys.stderr.isatty())


class _Bar:
    """A tqdm bar when enabled (and tqdm is installed), else a no-op."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc="loading checkpoint", unit="tensor")
            except ImportError:  # pragma: no cover
                self.bar = None

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class CheckpointReader:
    """A validated checkpoint whose tensors are read one at a time (:func:`open_checkpoint`).

    ``names`` lists the official names it yields, in read order (shard by shard).  Iterating
    yields ``(name, value)`` pairs: each value is read from the memory-mapped file on the host,
    moved to ``device`` and converted there, and the reader drops its reference before it reads
    the next, so a consumer that puts each value in place before asking for the next never
    holds more than one tensor outside its own storage (spec §2.2; docs/MEMORY_PLAN.md
    finding 1).  One pass: a second iteration raises.
    """

    def __init__(self, cfg: ModelConfig, specs: list[TensorSpec],
                 plan: Mapping[str, TensorShard | None], entries: dict[str, _Entry],
                 device: torch.device, dtype: torch.dtype, keep_quantized: bool,
                 progress: bool) -> None:
        self.cfg = cfg
        self._specs = specs
        self._plan = plan
        self._entries = entries
        self.device = device
        self.dtype = dtype
        self.keep_quantized = keep_quantized
        self._progress = progress
        self._used = False
        self.names: list[str] = [spec.name for spec in specs]

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self) -> Iterator[tuple[str, Tensor | QuantWeight]]:
        if self._used:
            raise ValueError("CheckpointReader: the tensors were already read (one pass only); "
                             "open the checkpoint again")
        self._used = True
        return self._read()

    def _read(self) -> Iterator[tuple[str, Tensor | QuantWeight]]:
        shards = _Shards()
        bar = _progress(len(self._specs), self._progress)
        try:
            for spec in self._specs:
                piece = self._plan.get(spec.name)
                if piece is None:
                    value = _convert(spec, shards, self._entries, self.device, self.dtype,
                                     self.keep_quantized)
                else:
                    value = _convert_shard(spec, piece, shards, self._entries, self.device,
                                           self.dtype, self.keep_quantized)
                bar.update()
                yield spec.name, value
                del value  # the consumer has it now; never two values alive here
        finally:
            bar.close()
            shards.close()


def open_checkpoint(path: str | os.PathLike, cfg: ModelConfig | None = None, *,
                    device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                    keep_quantized: bool = False, strict_mtp: bool = True,
                    progress: bool = True,
                    shard_plan: Mapping[str, TensorShard | None] | None = None
                    ) -> CheckpointReader:
    """Validate a checkpoint (every check of :func:`load_checkpoint`, before any tensor is read)
    and return a :class:`CheckpointReader` that streams its tensors one at a time.

    The arguments mean what they mean for :func:`load_checkpoint`.  Use it to put each tensor
    in place as it arrives (``dsv4.model.transformer.load_model``): the peak is then the
    consumer's own storage plus one tensor, where ``load_checkpoint`` holds them all at once.
    """
    path = os.fspath(path)
    ckpt_dir, files, weight_map = _shard_files(path)
    if cfg is None:
        cfg = ModelConfig.from_file(ckpt_dir)
    entries = _scan(files, weight_map, ckpt_dir)
    specs = expected_tensors(cfg)
    to_load = _validate(entries, specs, cfg, strict_mtp)
    plan = _check_plan(shard_plan or {}, specs)
    to_load = [spec for spec in to_load if plan.get(spec.name, True) is not None]
    # One shard file at a time (stable: official order inside a file).
    to_load.sort(key=lambda s: entries[s.name].file)
    return CheckpointReader(cfg, to_load, plan, entries, torch.device(device), dtype,
                            keep_quantized, progress)


def load_checkpoint(path: str | os.PathLike, cfg: ModelConfig | None = None, *,
                    device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                    keep_quantized: bool = False, strict_mtp: bool = True,
                    progress: bool = True,
                    shard_plan: Mapping[str, TensorShard | None] | None = None
                    ) -> dict[str, Tensor | QuantWeight]:
    """Load and validate an official-format checkpoint (directory or single .safetensors file).

    Returns official names (no ``.scale`` entries).  A quantized weight (fp8 / fp4) becomes a
    :class:`QuantWeight` when ``keep_quantized``, else its dense dequantization in ``dtype``.
    Two exceptions follow the reference: ``attn.wo_a`` is always dense (convert.py dequantizes
    it, spec §2.4), and the V4.1 Engram tables (``engram.embed``, mxfp8) always stay quantized
    (rows are dequantized on lookup; a dense table would be ~200 GB per layer).  bf16
    tensors come in ``dtype``; f32 tensors (hc_*, attn_sink, ape, gate.bias*) stay float32;
    ``tid2eid`` int64.  ``strict_mtp=False`` lets ``mtp.*`` tensors be absent (those present are
    still checked).  Every check (files, headers, names, dtypes, shapes, scales) runs before any
    tensor is read; problems raise ``ValueError`` / ``FileNotFoundError`` naming the tensor or file.

    ``shard_plan`` (tensor / expert parallel, ``dsv4.dist.sharding.shard_plan``): a name mapped to
    a :class:`TensorShard` is read only in that slice (safetensors ``get_slice``: the other rows
    are never read); a name mapped to None is not loaded.  A quantized slice keeps its format
    when it starts and ends on the format's scale blocks; otherwise the covering blocks are read
    and dequantized (a ValueError when ``keep_quantized`` asks for the quantized format).

    Every tensor is held at once: to fill a model use :func:`open_checkpoint`, which streams.
    """
    reader = open_checkpoint(path, cfg, device=device, dtype=dtype,
                             keep_quantized=keep_quantized, strict_mtp=strict_mtp,
                             progress=progress, shard_plan=shard_plan)
    out = dict(reader)
    # Keep the official order (the files' order is arbitrary).
    return {name: out[name] for name in expected_tensors(reader.cfg) if name in out}


class _Shards:
    """Memory-mapped safetensors handles, opened on first use."""

    def __init__(self) -> None:
        self.handles: dict[str, object] = {}

    def read(self, entry: _Entry, name: str, device: torch.device,
             part: tuple[int, int, int] | None = None) -> Tensor:
        """The tensor ``name``, or only ``[lo, hi)`` along dim d of its stored shape when
        ``part = (d, lo, hi)`` (memory-mapped: the rest is never read)."""
        h = self.handles.get(entry.file)
        if h is None:
            from safetensors import safe_open
            h = self.handles[entry.file] = safe_open(entry.file, framework="pt", device="cpu")
        if part is None:
            return h.get_tensor(name).to(device)  # type: ignore[attr-defined]
        d, lo, hi = part
        sl = h.get_slice(name)  # type: ignore[attr-defined]
        t = sl[lo:hi] if d == 0 else sl[:, lo:hi]
        return t.to(device)

    def close(self) -> None:
        self.handles.clear()


def _convert(spec: TensorSpec, shards: _Shards, entries: dict[str, _Entry], device: torch.device,
             dtype: torch.dtype, keep_quantized: bool) -> Tensor | QuantWeight:
    t = shards.read(entries[spec.name], spec.name, device)
    if spec.fmt == "f32" or spec.fmt == "i64":
        return t
    if spec.fmt == "bf16":
        return t.to(dtype)
    sname: str = spec.scale_name  # type: ignore[assignment]
    scale = shards.read(entries[sname], sname, device)
    if spec.name.endswith("attn.wo_a.weight"):
        # The reference's convert.py stores wo_a dense (bf16); keep it so in every mode.
        return dequant_fp8_block(t, scale, spec.block, dtype)
    qw = QuantWeight(t, scale, spec.fmt, spec.block, spec.shape)  # type: ignore[arg-type]
    return qw if keep_quantized or spec.fmt == "mxfp8" else qw.dequantize(dtype)


# ---------------------------------------------------------------------------------- shards
def _check_plan(plan: Mapping[str, TensorShard | None], specs: dict[str, TensorSpec]
                ) -> dict[str, TensorShard | None]:
    """Raise ValueError for a plan entry naming no tensor or outside its tensor's shape."""
    for name, piece in plan.items():
        spec = specs.get(name)
        if spec is None:
            raise ValueError(f"shard plan: tensor {name!r} is not in this checkpoint's layout")
        if piece is None:
            continue
        if not 0 <= piece.dim < len(spec.shape):
            raise ValueError(f"shard plan: tensor {name!r} has {len(spec.shape)} dims; the shard "
                             f"splits dim {piece.dim}")
        size = spec.shape[piece.dim]
        if not 0 <= piece.start <= piece.stop <= size:
            raise ValueError(f"shard plan: tensor {name!r}: [{piece.start}, {piece.stop}) is not "
                             f"a range of its dim {piece.dim} of size {size}")
    return dict(plan)


def _granularity(spec: TensorSpec, dim: int) -> int:
    """Logical elements per scale along ``dim`` of a quantized spec."""
    if spec.fmt == "fp8":
        return spec.block
    return 1 if dim == 0 else spec.block  # fp4 / mxfp8: one scale per row and 32 columns


def _convert_shard(spec: TensorSpec, piece: TensorShard, shards: _Shards,
                   entries: dict[str, _Entry], device: torch.device, dtype: torch.dtype,
                   keep_quantized: bool) -> Tensor | QuantWeight:
    """The slice ``piece`` of ``spec`` (as :func:`_convert` returns whole tensors)."""
    d, lo, hi = piece.dim, piece.start, piece.stop
    if spec.scale_name is None:
        t = shards.read(entries[spec.name], spec.name, device, (d, lo, hi))
        return t.to(dtype) if spec.fmt == "bf16" else t
    g = _granularity(spec, d)
    size = spec.shape[d]
    aligned = lo % g == 0 and (hi % g == 0 or hi == size)
    # fp8 rows / columns inside one block keep that block's scale.
    one_block = spec.fmt == "fp8" and hi > lo and lo // g == (hi - 1) // g
    is_wo_a = spec.name.endswith("attn.wo_a.weight")
    if aligned or one_block:
        qw = _read_quant(spec, shards, entries, device, d, lo, hi)
        if is_wo_a:
            return qw.dequantize(dtype)
        return qw if keep_quantized or spec.fmt == "mxfp8" else qw.dequantize(dtype)
    if (keep_quantized and not is_wo_a) or spec.fmt == "mxfp8":
        raise ValueError(f"tensor {spec.name!r}: the shard [{lo}, {hi}) of dim {d} does not "
                         f"fall on its {spec.fmt} scale blocks of {g}; a quantized shard needs "
                         f"block-aligned bounds (use another tensor_parallel_size)")
    # Read the covering blocks, dequantize, cut: the torch path holds dense weights anyway.
    lo0, hi0 = lo // g * g, min(size, -(-hi // g) * g)
    dense = _read_quant(spec, shards, entries, device, d, lo0, hi0).dequantize(dtype)
    return dense.narrow(d, lo - lo0, hi - lo).contiguous()


def _read_quant(spec: TensorSpec, shards: _Shards, entries: dict[str, _Entry],
                device: torch.device, d: int, lo: int, hi: int) -> QuantWeight:
    """A QuantWeight of logical ``[lo, hi)`` along ``d`` (bounds on scale blocks, or inside
    one fp8 block)."""
    g = _granularity(spec, d)
    packed = spec.fmt == "fp4" and d == 1  # two e2m1 codes per byte along K
    wpart = (d, lo // 2, hi // 2) if packed else (d, lo, hi)
    spart = (d, lo // g, -(-hi // g))
    sname: str = spec.scale_name  # type: ignore[assignment]
    w = shards.read(entries[spec.name], spec.name, device, wpart)
    scale = shards.read(entries[sname], sname, device, spart)
    shape = list(spec.shape)
    shape[d] = hi - lo
    return QuantWeight(w, scale, spec.fmt, spec.block, tuple(shape))  # type: ignore[arg-type]
