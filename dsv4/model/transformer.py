"""The V4 model body (spec §3.3–3.11): embedding, mHC blocks, final collapse, head; and
``load_model``.

Module paths spell the official tensor names (``embed``, ``layers.{L}.attn.*``,
``layers.{L}.ffn.*``, ``norm``, ``head``, ``mtp.0.*``), so loading is a name-for-name
assignment. Two groups of tensors are held differently from their spelling and are mapped by
the modules themselves: the mHC triples (``hc_attn_fn`` -> ``hc_attn.fn``, see ``mhc.py``) and
the routed experts (``experts.{e}.w1.weight`` -> row e of the stacked ``experts.w1``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import ModelConfig
from dsv4.model.layers import Linear, RMSNorm, check_numerics
from dsv4.model.mhc import HyperConnection, HyperHead, expand_streams
from dsv4.model.moe import Gate, MoE
from dsv4.ops import get_ops

log = logging.getLogger("dsv4")

DEFAULT_PAGE_SIZE = 256


class Embedding(nn.Module):
    """``embed.weight`` [vocab, D]: token ids -> [T, D]."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab_size, dim, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class Head(nn.Module):
    """``head.weight`` [vocab, D], held in fp32: the reference computes logits in fp32."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab_size, dim, dtype=torch.float32),
                                   requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight)


class Block(nn.Module):
    """One V4 block (spec §3.5): mHC around attention, then mHC around the MoE.

    ``forward(x [T, n_hc, D], ctx, cache) -> [T, n_hc, D]``.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, numerics: str, ops: Any,
                 dtype: torch.dtype) -> None:
        super().__init__()
        from dsv4.model.attention import Attention  # owned by the attention engineer

        self.layer_id = layer_id
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.hc_attn = HyperConnection(cfg, ops)
        self.hc_ffn = HyperConnection(cfg, ops)
        self.attn = Attention(cfg, layer_id, numerics, ops, dtype)
        self.ffn = MoE(cfg, layer_id, numerics, ops, dtype)

    def forward(self, x: torch.Tensor, ctx: Any, cache: Any) -> torch.Tensor:
        residual = x
        y, post, comb = self.hc_attn.pre(x)
        y = self.attn(self.attn_norm(y), ctx, cache)
        x = self.hc_attn.post(y, residual, post, comb)

        residual = x
        y, post, comb = self.hc_ffn.pre(x)
        y = self.ffn(self.ffn_norm(y), ctx.input_ids)
        return self.hc_ffn.post(y, residual, post, comb)


class MTPBlock(Block):
    """V4 multi-token-prediction stage ``mtp.{k}`` (spec §3.11): a ratio-0 block plus
    ``e_proj``/``h_proj``/``enorm``/``hnorm``/``norm`` and its own ``hc_head``.
    Loaded and validated; not run yet (speculative decoding comes later)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, numerics: str, ops: Any,
                 dtype: torch.dtype) -> None:
        super().__init__(cfg, layer_id, numerics, ops, dtype)
        fmt = "fp8" if cfg.quantized else "bf16"
        b, d = cfg.weight_block_size, cfg.dim
        self.e_proj = Linear(d, d, fmt=fmt, block=b, numerics=numerics, dtype=dtype)
        self.h_proj = Linear(d, d, fmt=fmt, block=b, numerics=numerics, dtype=dtype)
        self.enorm = RMSNorm(d, cfg.norm_eps, ops)
        self.hnorm = RMSNorm(d, cfg.norm_eps, ops)
        self.norm = RMSNorm(d, cfg.norm_eps, ops)
        self.hc_head = HyperHead(cfg, ops)

    def forward(self, x: torch.Tensor, ctx: Any, cache: Any) -> torch.Tensor:
        raise NotImplementedError("MTP stages are loaded but not run by this version of dsv4")


class Transformer(nn.Module):
    """DeepSeek-V4 (Flash / Flash-Base / Pro) text model.

    ``forward(ctx, cache) -> hidden [N, D]`` for the rows ``ctx.logits_indices`` (after
    ``hc_head`` and the final norm); ``compute_logits(hidden) -> [N, vocab]`` fp32;
    ``forward_full(input_ids) -> [S, vocab]`` runs one sequence with a fresh cache.
    """

    def __init__(self, cfg: ModelConfig, numerics: str = "bf16", backend: str = "torch",
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if cfg.is_v41:
            # V4.1 adds Engram, CSA2 layer roles and the single-pass mHC (spec §4): not built yet.
            raise NotImplementedError(
                "DeepSeek-V4.1 (model_type deepseek_v41) is not supported yet by "
                "dsv4.model.transformer; only V4 (deepseek_v4) checkpoints load for now")
        self.cfg = cfg
        self.numerics = check_numerics(numerics)
        self.backend = backend
        self.dtype = dtype
        self.ops = get_ops(backend)
        self.embed = Embedding(cfg.vocab_size, cfg.dim, dtype)
        self.layers = nn.ModuleList(
            [Block(cfg, i, numerics, self.ops, dtype) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, self.ops)
        self.head = Head(cfg.vocab_size, cfg.dim)
        self.hc_head = HyperHead(cfg, self.ops)
        self.mtp = nn.ModuleList([MTPBlock(cfg, cfg.n_layers + k, numerics, self.ops, dtype)
                                  for k in range(cfg.n_mtp_layers)])

    # ------------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, ctx: Any, cache: Any) -> torch.Tensor:
        """Run the step ``ctx`` against ``cache``; hidden states [N, D] of ctx.logits_indices."""
        x = expand_streams(self.embed(ctx.input_ids), self.cfg.hc_mult)
        for layer in self.layers:
            x = layer(x, ctx, cache)
        x = x[ctx.logits_indices]
        return self.norm(self.hc_head(x))

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, vocab] in fp32 (fp32 head)."""
        return self.head(hidden)

    @torch.no_grad()
    def forward_full(self, input_ids: torch.Tensor | Sequence[int],
                     token_types: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """Un-batched forward of one whole sequence from position 0: logits [S, vocab] fp32."""
        from dsv4.cache.tensors import HybridCache
        from dsv4.model.context import StepContext, pages_needed

        device = self.embed.weight.device
        ids = torch.as_tensor(input_ids, dtype=torch.int64, device=device)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"forward_full: input_ids must be a non-empty 1-D sequence; found "
                             f"shape {tuple(ids.shape)}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"forward_full: token ids must be in 0..{self.cfg.vocab_size - 1}; "
                             f"found the range {lo}..{hi}")
        if token_types is not None:
            raise ValueError("forward_full: token_types (image marks) are a V4.1 input; "
                             "V4 models take None")
        ctx = StepContext.single(ids, start_pos=0, page_size=DEFAULT_PAGE_SIZE, all_logits=True)
        cache = HybridCache.allocate(self.cfg, num_pages=pages_needed(ids.numel(),
                                                                      DEFAULT_PAGE_SIZE),
                                     num_slots=1, page_size=DEFAULT_PAGE_SIZE, dtype=self.dtype,
                                     device=device)
        return self.compute_logits(self.forward(ctx, cache))

    # ------------------------------------------------------------------------ loading
    def load_targets(self) -> dict[str, Callable[[Any], None]]:
        """Every official tensor name this model expects -> a function that loads it."""
        out: dict[str, Callable[[Any], None]] = {}
        _collect_targets(self, "", out)
        return out

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, Any], consume: bool = False) -> None:
        """Assign checkpoint tensors by official name; every expected name must be present and
        no other name may be (ValueError listing them). ``consume`` pops entries as they load
        (keeps peak memory at one copy)."""
        targets = self.load_targets()
        missing = sorted(n for n in targets if n not in tensors)
        unexpected = sorted(n for n in tensors if n not in targets)
        if missing or unexpected:
            raise ValueError("checkpoint does not match the model: "
                             f"{len(missing)} missing ({_preview(missing)}), "
                             f"{len(unexpected)} unexpected ({_preview(unexpected)})")
        for name, load in targets.items():
            try:
                load(tensors.pop(name) if consume else tensors[name])
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        for module in self.modules():
            if isinstance(module, Gate):
                module.check_tid2eid()
        if self.cfg.n_mtp_layers:
            log.info("dsv4: %d MTP stage(s) loaded and validated; not run (no speculative "
                     "decoding yet)", self.cfg.n_mtp_layers)


def _preview(names: list[str], k: int = 8) -> str:
    return ", ".join(names[:k]) + (", ..." if len(names) > k else "") if names else "none"


def _param_setter(module: nn.Module, attr: str) -> Callable[[Any], None]:
    """A loader for the plain parameter/buffer ``module.attr``: same shape, cast to its dtype."""
    def load(value: Any) -> None:
        current: torch.Tensor = getattr(module, attr)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"expected a dense tensor; got {type(value).__name__}")
        if tuple(value.shape) != tuple(current.shape):
            raise ValueError(f"expected shape {tuple(current.shape)}; found {tuple(value.shape)}")
        if value.is_floating_point() != current.is_floating_point():
            raise ValueError(f"expected a {current.dtype} tensor; found {value.dtype}")
        current.copy_(value.to(device=current.device, dtype=current.dtype))
    return load


def _collect_targets(module: nn.Module, prefix: str, out: dict[str, Callable[[Any], None]]
                     ) -> None:
    # A Linear loads its (possibly quantized) weight itself; modules whose storage differs from
    # the official spelling describe their names (mHC triples) or loaders (stacked experts).
    if isinstance(module, Linear):
        out[f"{prefix}weight"] = module.load_weight
        return
    if hasattr(module, "official_targets"):
        out.update(module.official_targets(prefix))
        return
    if hasattr(module, "official_names"):
        for official, attr in module.official_names(prefix).items():
            out[official] = _param_setter(module, attr)
        return
    for name, _ in module.named_parameters(recurse=False):
        out[prefix + name] = _param_setter(module, name)
    for name, _ in module.named_buffers(recurse=False):
        if name not in module._non_persistent_buffers_set:
            out[prefix + name] = _param_setter(module, name)
    for name, child in module.named_children():
        _collect_targets(child, f"{prefix}{name}.", out)


def load_model(path: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               numerics: str = "bf16", backend: str = "torch") -> Transformer:
    """Build the model of the checkpoint at ``path`` and load every tensor.

    ``dtype`` defaults to float32 on CPU and bfloat16 elsewhere. Raises ValueError on a
    missing, unexpected or mis-shaped tensor and NotImplementedError for V4.1 checkpoints.
    """
    from dsv4.checkpoint import load_checkpoint  # owned by the checkpoint engineer

    cfg = ModelConfig.from_file(path)
    dev = torch.device(device)
    if dtype is None:
        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    check_numerics(numerics)
    with dev:
        model = Transformer(cfg, numerics=numerics, backend=backend, dtype=dtype)
    # GPU kernels read the quantized weights; the torch path works on dense ones.
    tensors = load_checkpoint(path, cfg, device=dev, dtype=dtype, keep_quantized=dev.type != "cpu")
    model.load_tensors(tensors, consume=True)
    return model.eval()
