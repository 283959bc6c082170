"""Tiny random checkpoints in the official layout and formats, for tests and demos.

``make_tiny_checkpoint(out_dir, variant)`` writes ``config.json`` (official HF keys),
``generation_config.json``, sharded safetensors with ``model.safetensors.index.json`` and the
tiny tokenizer.  Variants:

* ``"v4"``      — V4-Flash layout: FP8 block-128 weights with e8m0 scales, MXFP4 experts, 1 MTP
  layer, layers with ratios 0/4/128 and one hash-routed layer;
* ``"v4-base"`` — as "v4" with FP8 experts and float32 block scales (the *-Base format);
* ``"v41"``     — V4.1: ``text_config``, FP8 block 32, CSA2 schedule, Engram tables, 2 DSpark
  stages;
* ``"v4-bf16"`` — "v4" without ``quantization_config``: every weight plain bf16 (for comparisons
  with implementations that do not quantize, e.g. transformers).

Weights are random but scaled so a forward stays finite with logits of std ≈ 1.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import shutil
from typing import Any

import torch
from torch import Tensor

from dsv4.checkpoint import TensorSpec, expected_tensors
from dsv4.config import ModelConfig
from dsv4.formats import quant_fp8_block, quant_mxfp4, quant_mxfp8
from dsv4.tokenizer import (EOS, IMAGE_TOKEN, PAD, SPECIAL_TOKENS, build_tiny_tokenizer,
                            make_tiny_tokenizer)

__all__ = ["VARIANTS", "tiny_config", "make_tiny_checkpoint", "default_checkpoint"]

VARIANTS = ("v4", "v4-base", "v41", "v4-bf16")

_V4_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
             "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
_V41_QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
_COMMON_HF = {"attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
              "initializer_range": 0.02, "use_cache": True, "tie_word_embeddings": False}


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer() -> Any:
    return build_tiny_tokenizer()


def _vocab_size() -> int:
    return _tiny_tokenizer().get_vocab_size(with_added_tokens=True)


def _v4_config() -> dict:
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": _vocab_size(), "hidden_size": 256, "num_hidden_layers": 5,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128,
        "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128,
        "moe_intermediate_size": 128, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0, "sliding_window": 8, "index_n_heads": 32, "index_head_dim": 128,
        "index_topk": 4, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 4096, "num_nextn_predict_layers": 1,
        # 5 layers + 1 MTP: SWA, CSA, HCA, CSA, HCA (a 200-token prompt crosses a 128 group).
        "compress_ratios": [0, 4, 128, 4, 128, 0],
        "quantization_config": dict(_V4_QUANT), "expert_dtype": "fp4",
        "bos_token_id": 0, "eos_token_id": 1, **_COMMON_HF,
        "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
    }


def _v41_config() -> dict:
    tok = _tiny_tokenizer()
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": _vocab_size(), "hidden_size": 256,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 2,
        "o_lora_rank": 128, "moe_intermediate_size": 128, "n_routed_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "max_position_embeddings": 4096,
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 64},
        "sliding_window": 8, "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0],
        "kv_source_layer_ids": [2, 4], "index_source_layer_ids": [2, 4, 6],
        "index_n_heads": 32, "index_head_dim": 64, "index_topk": 4,
        "candidate_source_layer_id": 4, "candidate_topk_blocks": 2, "candidate_block_size": 2,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": [1, 3], "engram_max_ngram_size": 4, "engram_n_heads": 2,
        "engram_head_dim": 32, "engram_vocab_size": 1000, "engram_pad_token_id": 2,
        "num_nextn_predict_layers": 2, "dspark_block_size": 5,
        # The real drafter's noise id is <｜System｜>'s id (spec §5); keep that relation.
        "dspark_noise_token_id": tok.token_to_id("<｜System｜>"),
        "dspark_target_layer_ids": [5, 6, 7], "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 1, **_COMMON_HF,
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
        "dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "image_token_id": tok.token_to_id(IMAGE_TOKEN),
        "quantization_config": dict(_V41_QUANT), "text_config": text,
    }


def _fill_engram(text: dict, explicit: set[str]) -> None:
    """Derive engram_num_embeddings / engram_compressed_vocab_size unless given explicitly."""
    if not text.get("engram_layer_ids"):
        return
    from dsv4.model.engram import build_compressed_token_map, engram_primes

    if "engram_num_embeddings" not in explicit:
        primes = engram_primes(text["engram_layer_ids"], text["engram_max_ngram_size"],
                               text["engram_n_heads"], text["engram_vocab_size"])
        text["engram_num_embeddings"] = [sum(sum(p) for p in layer) for layer in primes]
    if "engram_compressed_vocab_size" not in explicit:
        text["engram_compressed_vocab_size"] = build_compressed_token_map(_tiny_tokenizer())[1]


def tiny_config(variant: str = "v4", **overrides: Any) -> dict:
    """The ``config.json`` content (official HF keys) of a tiny checkpoint of ``variant``.

    ``overrides`` replace keys (``None`` deletes one).  For "v41", a key present at the top
    level is set there, any other goes into ``text_config``; Engram sizes are recomputed from
    the (overridden) Engram settings unless given explicitly.
    """
    if variant not in VARIANTS:
        raise ValueError(f"tiny_config: variant {variant!r} is not supported; allowed: {VARIANTS}")
    if variant == "v41":
        cfg = _v41_config()
        text = cfg["text_config"]
        for key, value in overrides.items():
            target = cfg if key in cfg else text
            _set(target, key, value)
        _fill_engram(text, set(overrides))
        return cfg
    cfg = _v4_config()
    if variant == "v4-base":
        cfg["expert_dtype"] = "fp8"  # FP8 experts -> float32 block scales (spec §1.3)
    elif variant == "v4-bf16":
        del cfg["quantization_config"], cfg["expert_dtype"]
    for key, value in overrides.items():
        _set(cfg, key, value)
    return cfg


def _set(d: dict, key: str, value: Any) -> None:
    if value is None:
        d.pop(key, None)
    else:
        d[key] = copy.deepcopy(value)


# ---------------------------------------------------------------------------------- weights
def _init(spec: TensorSpec, cfg: ModelConfig, g: torch.Generator) -> Tensor:
    """A random fp32 (or int64) tensor of the spec's logical shape with a sane scale."""
    name, shape = spec.name, spec.shape
    randn = functools.partial(torch.randn, *shape, generator=g, dtype=torch.float32)
    if name.endswith("gate.tid2eid"):
        # Distinct experts per token, as a real hash table would give.
        return torch.rand(shape[0], cfg.n_routed_experts, generator=g).argsort(-1)[:, :shape[1]]
    if name.endswith("attn_sink"):
        return randn()
    if "hc_" in name:
        if name.endswith("_fn"):  # mixes of an RMS-normalized stream stay O(0.5)
            return randn() * (0.5 / math.sqrt(shape[1]))
        if name.endswith("_scale"):
            return 0.5 + 0.1 * randn()
        return 0.1 * randn()  # base
    if name.endswith(("gate.bias", "gate.bias_vl", ".ape")):
        return 0.1 * randn()
    if name.endswith(("norm.weight", "q_weight", "k_weight")):
        return 1.0 + 0.05 * randn()
    if name in ("embed.weight",) or name.endswith(("markov_head.embed.weight",
                                                   "engram.embed.weight")):
        return randn()
    # Every projection [out, in]: N(0, 1/in) keeps activations O(1) (and logits std ≈ 1).
    return randn() / math.sqrt(shape[-1])


def _encode(spec: TensorSpec, w: Tensor) -> dict[str, Tensor]:
    """The file entries of one tensor in its official storage format."""
    if spec.fmt == "fp8":
        q, s = quant_fp8_block(w, spec.block, spec.scale_dtype)  # type: ignore[arg-type]
    elif spec.fmt == "fp4":
        q, s = quant_mxfp4(w)
    elif spec.fmt == "mxfp8":
        q, s = quant_mxfp8(w)
    else:
        return {spec.name: w.to(spec.dtype).contiguous()}
    return {spec.name: q.contiguous(), spec.scale_name: s.contiguous()}  # type: ignore[dict-item]


def _shards(groups: list[dict[str, Tensor]], num_shards: int) -> list[dict[str, Tensor]]:
    """Split tensor groups (a weight with its scale) into ``num_shards`` contiguous shards of
    roughly equal byte size."""
    sizes = [sum(t.numel() * t.element_size() for t in grp.values()) for grp in groups]
    total = sum(sizes)
    shards: list[dict[str, Tensor]] = [{} for _ in range(num_shards)]
    acc = 0
    for grp, size in zip(groups, sizes):
        idx = min(num_shards - 1, acc * num_shards // max(total, 1))
        shards[idx].update(grp)
        acc += size
    return shards


def make_tiny_checkpoint(out_dir: str | os.PathLike, variant: str = "v4", seed: int = 0,
                         num_shards: int = 2, **overrides: Any) -> str:
    """Write a tiny random checkpoint of ``variant`` to ``out_dir`` and return its path.

    Deterministic per ``seed``.  ``num_shards == 1`` writes a single ``model.safetensors``
    (no index); more write ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``.  ``overrides`` go to :func:`tiny_config`.
    """
    from safetensors.torch import save_file

    if num_shards < 1:
        raise ValueError(f"make_tiny_checkpoint: num_shards must be >= 1, found {num_shards}")
    cfg_dict = tiny_config(variant, **overrides)
    cfg = ModelConfig.from_dict(cfg_dict)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)

    g = torch.Generator().manual_seed(seed)
    groups = [_encode(spec, _init(spec, cfg, g)) for spec in expected_tensors(cfg).values()]
    shards = [s for s in _shards(groups, num_shards) if s] if num_shards > 1 else [
        {k: v for grp in groups for k, v in grp.items()}]
    if len(shards) == 1 and num_shards == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
    else:
        n = len(shards)
        weight_map: dict[str, str] = {}
        total = 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), {"format": "pt"})
            for k, t in shard.items():
                weight_map[k] = fname
                total += t.numel() * t.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)

    _write_json(os.path.join(out_dir, "config.json"), cfg_dict)
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "do_sample": True,
        "temperature": 1.0, "top_p": 1.0, "transformers_version": "4.57.1"})
    make_tiny_tokenizer(out_dir, pad_token=PAD if cfg.is_v41 else EOS)
    return out_dir


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def default_checkpoint(variant: str = "v4") -> str:
    """The embedded tiny checkpoint: generated once (seed 0) into
    ``$XDG_CACHE_HOME/dsv4`` (default ``~/.cache/dsv4``) and reused; returns its path.

    The directory name carries a hash of the tiny config, so a changed generator never serves a
    stale checkpoint.  Concurrent callers race safely (write to a temporary directory, rename).
    """
    import hashlib
    import tempfile

    digest = hashlib.sha256(json.dumps(tiny_config(variant), sort_keys=True).encode()).hexdigest()
    root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dsv4")
    path = os.path.join(root, f"tiny-{variant}-{digest[:12]}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=root, prefix=".tiny-")
        make_tiny_checkpoint(os.path.join(tmp, "ckpt"), variant=variant, seed=0)
        try:
            os.replace(os.path.join(tmp, "ckpt"), path)
        except OSError:
            pass  # another process installed it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path
