"""The op table: every hot operation has a plain-torch twin and, where written, a Triton kernel
with the same signature (docs/ARCHITECTURE.md lists the signatures).

``get_ops("torch")`` returns the torch twins; ``get_ops("triton")`` returns the Triton kernels
where they exist and the torch twins elsewhere.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

# Modules holding torch twins, and the Triton modules that override them by name.
_TORCH_MODULES = ("dsv4.ops.torch_attn", "dsv4.ops.torch_dense", "dsv4.ops.torch_norm",
                  "dsv4.ops.torch_compress")
_TORCH_MODULES += ("dsv4.ops.torch_index", "dsv4.ops.torch_records")
_TORCH_MODULES += ("dsv4.ops.torch_route",)
_TRITON_MODULES = ("dsv4.ops.triton_attn", "dsv4.ops.triton_dense", "dsv4.ops.triton_moe",
                   "dsv4.ops.triton_norm", "dsv4.ops.triton_compress")
_TRITON_MODULES += ("dsv4.ops.triton_index", "dsv4.ops.triton_records")
_TRITON_MODULES += ("dsv4.ops.triton_route",)

OP_NAMES = (
    "rms_norm", "apply_rope", "hc_pre", "hc_post", "hc_head", "sparse_attn",
    "indexer_scores", "topk_indices", "fp8_linear", "moe_experts",
    "head_norm_rope", "norm_rope",
    "compress_entries", "compress_update_state",
)
OP_NAMES += ("indexer_queries", "encode_records", "write_records")
OP_NAMES += ("moe_route", "swiglu_act", "moe_combine")
OP_NAMES += ("hc_post_pre",)

_cache: dict[str, SimpleNamespace] = {}


def _collect(modules: tuple[str, ...], table: dict, required: bool) -> None:
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            if required:
                raise
            continue
        for op in OP_NAMES:
            fn = getattr(mod, op, None)
            if fn is not None:
                table[op] = fn


def get_ops(backend: str = "torch") -> SimpleNamespace:
    """Return the op table for ``backend`` ("torch" or "triton")."""
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown op backend {backend!r}; allowed: 'torch', 'triton'")
    if backend not in _cache:
        table: dict = {}
        _collect(_TORCH_MODULES, table, required=False)
        if backend == "triton":
            _collect(_TRITON_MODULES, table, required=False)
        _cache[backend] = SimpleNamespace(**table)
    return _cache[backend]
