"""Model configuration of the DeepSeek-V4 family, read from a checkpoint's ``config.json``.

The official HF keys are mapped onto the names of DeepSeek's reference ``ModelArgs`` (spec §1.1),
which is what the model code uses.  V4 (``deepseek_v4``: Flash, Flash-Base, Pro) and V4.1
(``deepseek_v41``: a top level with ``text_config``) share one frozen dataclass; fields that only
one variant has are empty/None for the other.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

V4_MODEL_TYPES = ("deepseek_v4",)
V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
V4_RATIOS = (0, 4, 128)
V41_RATIOS = (0, 1, 2)


def _bad(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"config.json: {key}={value!r} is not supported; allowed: {allowed}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters (reference ``ModelArgs`` names).

    ``compress_ratios`` has one entry per backbone layer followed by one per MTP/DSpark stage,
    as in the official configs.
    """

    variant: str  # "v4" or "v41"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_inter_dim: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    score_func: str
    route_scale: float
    swiglu_limit: float
    norm_eps: float
    window_size: int
    rope_theta: float
    compress_rope_theta: float
    compress_ratios: tuple[int, ...]
    original_seq_len: int
    rope_factor: float
    beta_fast: float
    beta_slow: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_mtp_layers: int
    max_position_embeddings: int
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int | None = None
    # quantization (spec §2.4)
    weight_block_size: int = 128
    scale_fmt: str | None = "ue8m0"
    scale_dtype: str = "e8m0"  # "e8m0" (Flash/Pro/V4.1) or "fp32" (*-Base)
    expert_dtype: str = "fp4"  # "fp4" (MXFP4) or "fp8" (block FP8, *-Base)
    quantized: bool = True  # False: a bf16 checkpoint without quantization_config
    # V4 only
    n_hash_layers: int = 0
    # V4.1 only
    kv_source_layers: tuple[int, ...] = ()
    index_source_layers: tuple[int, ...] = ()
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_vocab_size: int = 0
    engram_pad_id: int = 0
    engram_compressed_vocab_size: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0
    image_token_id: int | None = None
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ derived facts
    @property
    def is_v41(self) -> bool:
        return self.variant == "v41"

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def ratio(self, layer: int) -> int:
        """Compression ratio of layer ``layer`` (MTP/DSpark stages follow the backbone)."""
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    def attn_mode(self, layer: int) -> str:
        """V4: ``swa`` (ratio 0), ``csa`` (4) or ``hca`` (128).

        V4.1 (spec §4.4): ``swa``, ``full`` (KV source: own compressor and indexer), ``reindex``
        (own indexer query over the latest source's keys) or ``reuse`` (latest source's KV and the
        latest index source's top-k).
        """
        r = self.ratio(layer)
        if r == 0:
            return "swa"
        if not self.is_v41:
            return "csa" if r == 4 else "hca"
        if layer in self.kv_source_layers:
            return "full"
        if layer in self.index_source_layers:
            return "reindex"
        return "reuse"

    def kv_source_of(self, layer: int) -> int:
        """V4.1: the most recent KV-source layer at or below ``layer`` (-1 if none)."""
        srcs = [s for s in self.kv_source_layers if s <= layer]
        return max(srcs) if srcs else -1

    def index_source_of(self, layer: int) -> int:
        """V4.1: the most recent index-source layer at or below ``layer`` (-1 if none)."""
        srcs = [s for s in self.index_source_layers if s <= layer]
        return max(srcs) if srcs else -1

    def uses_candidates(self, layer: int) -> bool:
        """V4.1: index sources after the candidate source restrict their scores to its blocks."""
        return (self.is_v41 and layer in self.index_source_layers
                and 0 <= self.candidate_source_layer < layer)

    def compressor_ratio(self, layer: int) -> int:
        """Ratio of the layer's own compressor, 0 when it has none."""
        r = self.ratio(layer)
        if r == 0:
            return 0
        if self.is_v41:
            return r if layer in self.kv_source_layers else 0
        return r

    def has_indexer(self, layer: int) -> bool:
        if self.is_v41:
            return layer in self.index_source_layers
        return self.ratio(layer) == 4

    @property
    def all_ratios(self) -> tuple[int, ...]:
        return tuple(sorted({r for r in self.compress_ratios[: self.n_layers] if r > 0}))

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read ``config.json`` (a file, or a checkpoint directory holding one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        """Build and validate a config from the official HF ``config.json`` content."""
        if not isinstance(data, dict):
            raise ValueError("config.json: the top level must be a JSON object")
        model_type = data.get("model_type")
        if model_type in V41_MODEL_TYPES:
            return cls._from_v41(data)
        if model_type in V4_MODEL_TYPES:
            return cls._from_v4(data)
        raise _bad("model_type", model_type, f"one of {V4_MODEL_TYPES + V41_MODEL_TYPES}")

    @staticmethod
    def _req(d: dict, key: str, where: str = "") -> Any:
        if key not in d:
            raise ValueError(f"config.json: missing required key {where}{key!r}")
        return d[key]

    @classmethod
    def _common(cls, t: dict, where: str) -> dict:
        req = lambda k: cls._req(t, k, where)  # noqa: E731
        rs = t.get("rope_scaling") or {}
        if rs and rs.get("type", rs.get("rope_type")) not in ("yarn", None):
            raise _bad(f"{where}rope_scaling.type", rs.get("type", rs.get("rope_type")), "'yarn'")
        return dict(
            vocab_size=int(req("vocab_size")),
            dim=int(req("hidden_size")),
            n_layers=int(req("num_hidden_layers")),
            n_heads=int(req("num_attention_heads")),
            head_dim=int(req("head_dim")),
            rope_head_dim=int(req("qk_rope_head_dim")),
            q_lora_rank=int(req("q_lora_rank")),
            o_groups=int(req("o_groups")),
            o_lora_rank=int(req("o_lora_rank")),
            moe_inter_dim=int(req("moe_intermediate_size")),
            n_routed_experts=int(req("n_routed_experts")),
            n_shared_experts=int(t.get("n_shared_experts", 1)),
            n_activated_experts=int(req("num_experts_per_tok")),
            score_func=str(t.get("scoring_func", "sqrtsoftplus")),
            route_scale=float(t.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(t.get("swiglu_limit", 0.0)),
            window_size=int(t.get("sliding_window", 128)),
            rope_theta=float(t.get("rope_theta", 10000.0)),
            compress_rope_theta=float(t.get("compress_rope_theta", 160000.0)),
            compress_ratios=tuple(int(r) for r in req("compress_ratios")),
            original_seq_len=int(rs.get("original_max_position_embeddings", 0) or 0),
            rope_factor=float(rs.get("factor", 1.0)),
            beta_fast=float(rs.get("beta_fast", 32)),
            beta_slow=float(rs.get("beta_slow", 1)),
            index_n_heads=int(t.get("index_n_heads", 64)),
            index_head_dim=int(t.get("index_head_dim", 128)),
            index_topk=int(t.get("index_topk", 512)),
            hc_mult=int(t.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(t.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(t.get("hc_eps", 1e-6)),
            n_mtp_layers=int(t.get("num_nextn_predict_layers", 0)),
            max_position_embeddings=int(t.get("max_position_embeddings", 1 << 20)),
            norm_topk_prob=bool(t.get("norm_topk_prob", True)),
        )

    @staticmethod
    def _quant(q: dict | None, expert_dtype: Any, default_block: int) -> dict:
        if not q:
            return dict(quantized=False, weight_block_size=default_block, scale_fmt=None,
                        scale_dtype="fp32", expert_dtype=str(expert_dtype or "bf16"))
        if q.get("quant_method", "fp8") != "fp8":
            raise _bad("quantization_config.quant_method", q.get("quant_method"), "'fp8'")
        wbs = q.get("weight_block_size", [default_block, default_block])
        if (not isinstance(wbs, (list, tuple)) or len(wbs) != 2 or wbs[0] != wbs[1]
                or wbs[0] not in (32, 128)):
            raise _bad("quantization_config.weight_block_size", wbs, "[128, 128] or [32, 32]")
        scale_fmt = q.get("scale_fmt")
        expert_dtype = expert_dtype or q.get("expert_dtype") or "fp4"
        if expert_dtype not in ("fp4", "fp8"):
            raise _bad("expert_dtype", expert_dtype, "'fp4' or 'fp8'")
        if scale_fmt not in (None, "ue8m0"):
            raise _bad("quantization_config.scale_fmt", scale_fmt, "'ue8m0' or absent")
        # *-Base checkpoints carry float32 block scales (spec §1.3); they have FP8 experts.
        scale_dtype = "e8m0" if scale_fmt == "ue8m0" and expert_dtype == "fp4" else "fp32"
        return dict(quantized=True, weight_block_size=int(wbs[0]), scale_fmt=scale_fmt,
                    scale_dtype=scale_dtype, expert_dtype=expert_dtype)

    @classmethod
    def _from_v4(cls, d: dict) -> "ModelConfig":
        kw = cls._common(d, "")
        kw.update(cls._quant(d.get("quantization_config"), d.get("expert_dtype"), 128))
        kw.update(variant="v4", n_hash_layers=int(d.get("num_hash_layers", 0)),
                  norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                  bos_token_id=int(d.get("bos_token_id", 0) or 0),
                  eos_token_id=_first_id(d.get("eos_token_id", 1)),
                  pad_token_id=d.get("pad_token_id"), raw=d)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    @classmethod
    def _from_v41(cls, d: dict) -> "ModelConfig":
        top = d
        t = d.get("text_config", d) if d.get("model_type") == "deepseek_v41" else d
        if not isinstance(t, dict):
            raise _bad("text_config", t, "a JSON object")
        kw = cls._common(t, "text_config." if t is not top else "")
        q = top.get("quantization_config") or t.get("quantization_config")
        kw.update(cls._quant(q, top.get("expert_dtype") or t.get("expert_dtype"), 32))
        g = lambda k, default=None: t.get(k, top.get(k, default))  # noqa: E731
        kw.update(
            variant="v41", norm_eps=float(t.get("rms_norm_eps", 1e-20)),
            bos_token_id=int(g("bos_token_id", 0) or 0), eos_token_id=_first_id(g("eos_token_id", 1)),
            pad_token_id=g("pad_token_id", 2),
            kv_source_layers=tuple(int(x) for x in g("kv_source_layer_ids", ())),
            index_source_layers=tuple(int(x) for x in g("index_source_layer_ids", ())),
            candidate_source_layer=int(g("candidate_source_layer_id", -1)),
            candidate_topk_blocks=int(g("candidate_topk_blocks", 0)),
            candidate_block_size=int(g("candidate_block_size", 0)),
            engram_layer_ids=tuple(int(x) for x in g("engram_layer_ids", ())),
            engram_num_embeddings=tuple(int(x) for x in g("engram_num_embeddings", ())),
            engram_max_ngram_size=int(g("engram_max_ngram_size", 0)),
            engram_n_heads=int(g("engram_n_heads", 0)),
            engram_head_dim=int(g("engram_head_dim", 0)),
            engram_vocab_size=int(g("engram_vocab_size", 0)),
            engram_pad_id=int(g("engram_pad_token_id", g("engram_pad_id", 2))),
            engram_compressed_vocab_size=int(g("engram_compressed_vocab_size", 0)),
            dspark_block_size=int(g("dspark_block_size", 0)),
            dspark_noise_token_id=int(g("dspark_noise_token_id", 0)),
            dspark_target_layer_ids=tuple(int(x) for x in g("dspark_target_layer_ids", ())),
            dspark_markov_rank=int(g("dspark_markov_rank", 0)),
            dspark_n_routed_experts=int(g("dspark_n_routed_experts", 0)),
            dspark_n_activated_experts=int(g("dspark_num_experts_per_tok",
                                             g("dspark_n_activated_experts", 0))),
            image_token_id=g("image_token_id"),
            gate_temp=float(g("gate_temp", 1.0)),
            raw=d,
        )
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``ValueError`` naming the key, the value and what is allowed."""
        n_total = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) != n_total:
            raise ValueError(
                f"config.json: compress_ratios has {len(self.compress_ratios)} entries; expected "
                f"num_hidden_layers + num_nextn_predict_layers = {self.n_layers} + "
                f"{self.n_mtp_layers} = {n_total}")
        allowed = V41_RATIOS if self.is_v41 else V4_RATIOS
        for i, r in enumerate(self.compress_ratios):
            if r not in allowed:
                raise _bad(f"compress_ratios[{i}]", r, f"one of {allowed}")
        for i in range(self.n_layers, n_total):
            if self.compress_ratios[i] != 0:
                raise _bad(f"compress_ratios[{i}] (MTP stage)", self.compress_ratios[i], "0")
        for key, val in (("hidden_size", self.dim), ("num_attention_heads", self.n_heads),
                         ("head_dim", self.head_dim), ("q_lora_rank", self.q_lora_rank),
                         ("vocab_size", self.vocab_size), ("num_hidden_layers", self.n_layers),
                         ("moe_intermediate_size", self.moe_inter_dim),
                         ("n_routed_experts", self.n_routed_experts),
                         ("num_experts_per_tok", self.n_activated_experts),
                         ("hc_mult", self.hc_mult), ("sliding_window", self.window_size)):
            if val <= 0:
                raise _bad(key, val, "a positive integer")
        if self.rope_head_dim <= 0 or self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise _bad("qk_rope_head_dim", self.rope_head_dim,
                       f"an even number in (0, head_dim={self.head_dim}]")
        if self.n_heads % self.o_groups:
            raise _bad("o_groups", self.o_groups,
                       f"a divisor of num_attention_heads={self.n_heads}")
        if self.n_activated_experts > self.n_routed_experts:
            raise _bad("num_experts_per_tok", self.n_activated_experts,
                       f"<= n_routed_experts={self.n_routed_experts}")
        if self.n_shared_experts != 1:
            raise _bad("n_shared_experts", self.n_shared_experts, "1")
        if self.score_func != "sqrtsoftplus":
            raise _bad("scoring_func", self.score_func, "'sqrtsoftplus'")
        if self.index_head_dim < self.rope_head_dim or self.index_head_dim % 2:
            raise _bad("index_head_dim", self.index_head_dim,
                       f"an even number >= qk_rope_head_dim={self.rope_head_dim}")
        if self.quantized:
            b = self.weight_block_size
            for key, val in (("hidden_size", self.dim), ("q_lora_rank", self.q_lora_rank),
                             ("moe_intermediate_size", self.moe_inter_dim)):
                if val % b:
                    raise _bad(key, val, f"a multiple of the FP8 block size {b}")
            if self.expert_dtype == "fp4" and (self.dim % 32 or self.moe_inter_dim % 32):
                raise ValueError("config.json: MXFP4 experts need hidden_size and "
                                 "moe_intermediate_size to be multiples of 32")
        if self.is_v41:
            self._validate_v41()
        elif self.n_hash_layers < 0 or self.n_hash_layers > self.n_layers:
            raise _bad("num_hash_layers", self.n_hash_layers, f"0..{self.n_layers}")

    def _validate_v41(self) -> None:
        L = self.n_layers
        for key, ids in (("kv_source_layer_ids", self.kv_source_layers),
                         ("index_source_layer_ids", self.index_source_layers),
                         ("engram_layer_ids", self.engram_layer_ids)):
            bad = [i for i in ids if not 0 <= i < L]
            if bad:
                raise _bad(key, list(ids), f"layer ids in 0..{L - 1}")
        for i in self.kv_source_layers:
            if self.ratio(i) == 0:
                raise _bad("kv_source_layer_ids", list(self.kv_source_layers),
                           f"layers with a compress ratio > 0 (layer {i} has ratio 0)")
            if i not in self.index_source_layers:
                raise _bad("index_source_layer_ids", list(self.index_source_layers),
                           f"a list containing every KV source (missing {i})")
        for i in range(L):
            r = self.ratio(i)
            if r == 0:
                continue
            src = self.kv_source_of(i)
            if src < 0 or self.ratio(src) != r:
                raise _bad("kv_source_layer_ids", list(self.kv_source_layers),
                           f"a source with ratio {r} at or before layer {i}")
            if self.index_source_of(i) < 0:
                raise _bad("index_source_layer_ids", list(self.index_source_layers),
                           f"an index source at or before layer {i}")
        for i in self.index_source_layers:
            if self.ratio(i) == 0:
                raise _bad("index_source_layer_ids", list(self.index_source_layers),
                           f"layers with a compress ratio > 0 (layer {i} has ratio 0)")
        if self.candidate_source_layer >= 0:
            if self.candidate_source_layer not in self.kv_source_layers:
                raise _bad("candidate_source_layer_id", self.candidate_source_layer,
                           f"one of kv_source_layer_ids {list(self.kv_source_layers)}")
            if self.candidate_block_size <= 0 or self.candidate_topk_blocks <= 0:
                raise _bad("candidate_block_size/candidate_topk_blocks",
                           (self.candidate_block_size, self.candidate_topk_blocks),
                           "positive integers")
        if self.engram_layer_ids:
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                raise _bad("engram_num_embeddings", list(self.engram_num_embeddings),
                           f"one entry per engram layer ({len(self.engram_layer_ids)})")
            if self.engram_max_ngram_size < 2 or self.engram_n_heads <= 0 or self.engram_head_dim <= 0:
                raise _bad("engram_max_ngram_size/engram_n_heads/engram_head_dim",
                           (self.engram_max_ngram_size, self.engram_n_heads, self.engram_head_dim),
                           "ngram >= 2 and positive heads/dims")
            if self.engram_compressed_vocab_size <= 0:
                raise _bad("engram_compressed_vocab_size", self.engram_compressed_vocab_size,
                           "a positive integer")

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg


def _first_id(v: Any) -> int:
    if isinstance(v, (list, tuple)):
        return int(v[0])
    return int(v)
