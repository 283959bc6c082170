"""A model with random weights in the checkpoint formats, made on the device rank by rank.

:class:`RandomCheckpoint` stands in for :class:`dsv4.checkpoint.CheckpointReader`: it yields
``(official name, value)`` pairs for :meth:`Transformer.load_stream`, where each value comes
from a *virtual checkpoint* instead of a file.  Every stored tensor (weight or scale) of the
virtual checkpoint is a pure function of ``(seed, name)``: it is generated whole on the device
from its own generator and then cut to this rank's slice (``dsv4.dist.sharding.shard_plan``)
by the loader's own conversion code (``dsv4.checkpoint``), so

* each rank holds exactly what a sharded load of a real checkpoint gives (shapes, dtypes,
  QuantWeight / dense choice), and nothing else (another rank's experts are never made);
* every rank sees the same replicated tensors, and the shards of all ranks put together are the
  single-process model of the same seed (a TP=2 run computes what a TP=1 run does).

The model is built on ``meta`` (:func:`dsv4.model.transformer.build_model`) and each tensor is
put in place before the next one is made, so the device peaks at the rank's model plus one
full checkpoint tensor (the 1 GB head of V4-Flash), never the whole model on one device or on
the host.

Value distributions (those of ``bench/flash_bench.py``'s ``fill_random``, so timings compare):
FP8 weights are e4m3 codes ``clamp(64·N(0,1), ±448)`` with e8m0 block scales around
``2^(−6 − log2 sqrt(K))`` (±1 octave), i.e. ``|W| ~ 1/sqrt(K)``; MXFP4 weights are uniform
random bytes (any two e2m1 codes) with scales around ``2^(−2 − log2 sqrt(K))``; norms are 1;
other dense matrices ``N(0,1)/sqrt(last dim)``, vectors ``0.1·N(0,1)``; hash-routing tables
(``tid2eid``) distinct random experts per token.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Iterator

import torch
from torch import Tensor

from dsv4.checkpoint import TensorSpec, _convert, _convert_shard, expected_tensors
from dsv4.config import ModelConfig
from dsv4.dist.parallel import SINGLE, Parallel
from dsv4.dist.sharding import shard_plan
from dsv4.formats import QuantWeight

__all__ = ["RandomCheckpoint", "build_random_model", "model_bytes"]

# fill_random's magnitudes: e4m3 codes of std 64, FP8 scale center 2^-6/sqrt(K), MXFP4 2^-2/sqrt(K).
_FP8_CODE_STD = 64.0
_FP8_SCALE_OCTAVE = 6
_FP4_SCALE_OCTAVE = 2


def _name_seed(seed: int, name: str) -> int:
    """A generator seed per (seed, tensor name): the same on every rank and in every order."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF


class _VirtualShards:
    """The ``_Shards`` interface of ``dsv4.checkpoint`` over generated tensors: ``read`` makes the
    whole stored tensor ``name`` from its own generator and returns the requested part."""

    def __init__(self, specs: dict[str, TensorSpec], cfg: ModelConfig, seed: int) -> None:
        self.cfg = cfg
        self.seed = seed
        # stored name (weight or its .scale) -> (spec, is the scale)
        self.stored: dict[str, tuple[TensorSpec, bool]] = {}
        for spec in specs.values():
            self.stored[spec.name] = (spec, False)
            if spec.scale_name is not None:
                self.stored[spec.scale_name] = (spec, True)

    def read(self, entry: Any, name: str, device: torch.device,
             part: tuple[int, int, int] | None = None) -> Tensor:
        spec, is_scale = self.stored[name]
        gen = torch.Generator(device=device).manual_seed(_name_seed(self.seed, name))
        t = (self._scale(spec, gen, device) if is_scale
             else self._values(spec, gen, device))
        if part is not None:
            d, lo, hi = part
            t = t.narrow(d, lo, hi - lo).contiguous()
        return t

    def close(self) -> None:
        return None

    # ------------------------------------------------------------------ distributions
    def _values(self, spec: TensorSpec, gen: torch.Generator, device: torch.device) -> Tensor:
        shape, name = spec.stored_shape, spec.name
        if spec.fmt in ("fp8", "mxfp8"):
            codes = torch.randn(shape, generator=gen, device=device) * _FP8_CODE_STD
            return codes.clamp_(-448, 448).to(torch.float8_e4m3fn)
        if spec.fmt == "fp4":  # two random e2m1 codes per byte
            return torch.randint(-128, 128, shape, generator=gen, device=device,
                                 dtype=torch.int8)
        if spec.fmt == "i64":
            if not name.endswith("tid2eid"):
                raise ValueError(f"RandomCheckpoint: no distribution for the int64 tensor {name}")
            # Distinct experts per token, as a real hash table gives.
            n_exp = self.cfg.n_routed_experts
            picks = torch.rand(shape[0], n_exp, generator=gen, device=device)
            return picks.topk(shape[1], dim=-1).indices.to(torch.int64)
        if name.endswith("norm.weight") or name.endswith("norm"):
            out = torch.ones(shape, device=device)
        elif len(shape) >= 2:
            out = torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5
        else:
            out = torch.randn(shape, generator=gen, device=device) * 0.1
        return out.to(spec.dtype)

    def _scale(self, spec: TensorSpec, gen: torch.Generator, device: torch.device) -> Tensor:
        assert spec.scale_shape is not None and spec.scale_dtype is not None
        k = spec.shape[-1]  # the logical K of the whole tensor (a column shard sums to it)
        if spec.name.endswith("embed.weight"):
            octave = _FP8_SCALE_OCTAVE                      # rows looked up, not summed
        elif spec.fmt == "fp4":
            octave = _FP4_SCALE_OCTAVE + int(math.log2(math.sqrt(k)))
        else:
            octave = _FP8_SCALE_OCTAVE + int(math.log2(math.sqrt(k)))
        center = 127 - octave
        exps = torch.randint(center - 1, center + 2, spec.scale_shape, generator=gen,
                             device=device)
        if spec.scale_dtype == torch.float8_e8m0fnu:
            return exps.to(torch.uint8).view(torch.float8_e8m0fnu)
        return torch.exp2((exps - 127).to(torch.float32)).to(spec.scale_dtype)


class RandomCheckpoint:
    """A virtual checkpoint of ``cfg`` read as one rank of ``parallel`` reads a real one.

    Iterating yields ``(official name, value)`` for every tensor this rank loads (``names``),
    values made on ``device`` and converted exactly as ``dsv4.checkpoint.open_checkpoint`` with
    ``keep_quantized`` and the rank's shard plan converts file tensors.  One pass.
    """

    def __init__(self, cfg: ModelConfig, *, parallel: Parallel = SINGLE,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 keep_quantized: bool = False, seed: int = 0) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.keep_quantized = keep_quantized
        self.specs = expected_tensors(cfg)
        self.plan = shard_plan(cfg, parallel)
        self.names: list[str] = [n for n in self.specs if self.plan.get(n, True) is not None]
        self._shards = _VirtualShards(self.specs, cfg, seed)
        self._used = False

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[tuple[str, Tensor | QuantWeight]]:
        if self._used:
            raise ValueError("RandomCheckpoint: already read (one pass only); make a new one")
        self._used = True
        return self._read()

    def _read(self) -> Iterator[tuple[str, Tensor | QuantWeight]]:
        entries: dict[str, Any] = dict.fromkeys(self._shards.stored)  # no files behind them
        for name in self.names:
            spec, piece = self.specs[name], self.plan.get(name)
            with torch.no_grad():
                if piece is None:
                    value = _convert(spec, self._shards, entries, self.device, self.dtype,
                                     self.keep_quantized)
                else:
                    value = _convert_shard(spec, piece, self._shards, entries, self.device,
                                           self.dtype, self.keep_quantized)
            yield name, value
            del value


def build_random_model(cfg: ModelConfig, *, parallel: Parallel = SINGLE,
                       device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                       numerics: str = "official", backend: str | None = None,
                       keep_quantized: bool | None = None, seed: int = 0) -> Any:
    """This rank's shard of ``cfg`` with random weights (see the module docstring).

    ``keep_quantized`` None means what ``load_model`` does: FP8 / MXFP4 storage on CUDA,
    dense dequantized weights elsewhere; ``backend`` None: "triton" on CUDA, else "torch".
    Raises ValueError when ``cfg`` does not split over the ranks (``ParallelConfig.check_model``).
    """
    from dsv4.dist.parallel import ParallelConfig
    from dsv4.model.transformer import build_model

    dev = torch.device(device)
    ParallelConfig(parallel.world_size, parallel.expert_parallel).check_model(cfg)
    if keep_quantized is None:
        keep_quantized = dev.type == "cuda"
    if backend is None:
        backend = "triton" if dev.type == "cuda" else "torch"
    if cfg.is_v41 and cfg.engram_layer_ids:
        raise ValueError("build_random_model: V4.1 Engram layers need the tokenizer's "
                         "compressed token map; not supported with random weights")
    model = build_model(cfg, numerics=numerics, backend=backend, dtype=dtype,
                        parallel=parallel, keep_quantized=keep_quantized)
    ckpt = RandomCheckpoint(cfg, parallel=parallel, device=dev, dtype=dtype,
                            keep_quantized=keep_quantized, seed=seed)
    model.load_stream(ckpt.names, ckpt)
    return model.eval()


def model_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes this rank's model holds: ``routed_experts``, ``other`` (everything else) and
    ``total`` (parameters and buffers, each storage counted once)."""
    from dsv4.model.moe import Experts

    expert_ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, Experts):
            expert_ids.update(id(t) for t in list(module.parameters()) + list(module.buffers()))
    out = {"routed_experts": 0, "other": 0}
    seen: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        key = "routed_experts" if id(t) in expert_ids else "other"
        out[key] += t.numel() * t.element_size()
    # Quantized Linears keep their codes / scales outside nn.Parameters.
    from dsv4.model.layers import Linear
    for module in model.modules():
        if isinstance(module, Linear) and getattr(module, "holds_quantized", False):
            qw = module.qweight
            if id(qw) not in seen:
                seen.add(id(qw))
                out["other"] += int(qw.nbytes)
    out["total"] = out["routed_experts"] + out["other"]
    return out
