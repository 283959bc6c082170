"""The op table: every hot operation has a plain-torch twin and, where written, a Triton kernel
with the same signature (docs/ARCHITECTURE.md lists the signatures).

``get_ops("torch")`` returns the torch twins; ``get_ops("triton")`` returns the Triton kernels
where they exist and the torch twins elsewhere.

Kernels written without a GPU run (:data:`UNVERIFIED_ON_GPU`: checked in the Triton interpreter
and compiled for sm_90 offline, but their GPU checks at real shapes have not run yet) are left out
of the "triton" table unless ``DSV4_UNVERIFIED_KERNELS=1``: the engine then runs their torch
twins (the glue they replace, same results).  The test suite and
``bench/sessions/gpu_session.sh`` set it; an op leaves the set once a GPU session script
(``bench/sessions/``) has checked it on the H200.
"""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

# Modules holding torch twins, and the Triton modules that override them by name.
_TORCH_MODULES = ("dsv4.ops.torch_attn", "dsv4.ops.torch_dense", "dsv4.ops.torch_norm",
                  "dsv4.ops.torch_compress", "dsv4.ops.torch_index", "dsv4.ops.torch_records",
                  "dsv4.ops.torch_route")
_TRITON_MODULES = ("dsv4.ops.triton_attn", "dsv4.ops.triton_dense", "dsv4.ops.triton_moe",
                   "dsv4.ops.triton_norm", "dsv4.ops.triton_compress", "dsv4.ops.triton_index",
                   "dsv4.ops.triton_records", "dsv4.ops.triton_route", "dsv4.ops.triton_topk",
                   "dsv4.ops.triton_linear32", "dsv4.ops.triton_mhc")

OP_NAMES = (
    "rms_norm", "apply_rope", "hc_pre", "hc_post", "hc_head", "sparse_attn",
    "indexer_scores", "topk_indices", "fp8_linear", "moe_experts",
    "head_norm_rope", "norm_rope", "compress_entries", "compress_update_state",
    "indexer_queries", "encode_records", "write_records",
    "moe_route", "swiglu_act", "moe_combine", "hc_post_pre", "linear_fp32",
    "fp8_grouped_linear", "picked_rows", "moe_gate", "moe_experts_shared", "moe_gate_plan",
    "read_records", "moe_encode_ahead",
)

# Written in the second session, when no GPU time was left (docs/PERFORMANCE.md).
# Empty: every kernel written without a GPU (rms_norm, apply_rope, head_norm_rope, norm_rope,
# compress_entries, compress_update_state, indexer_queries, encode_records, write_records,
# moe_route, swiglu_act, moe_combine, hc_post_pre) passed its GPU checks on the H200
# (bench/sessions/gpu_session*.sh, 2026-11-29/30), and so did topk_indices and linear_fp32
# (2026-11-30), fp8_grouped_linear (2026-12-01, bench/sessions/gpu_session_s8e.sh) and
# picked_rows (2026-12-02, bench/sessions/gpu_session_s13a.sh).  A new kernel goes here until
# its GPU checks run.  moe_gate and moe_experts_shared (fifteenth session, 2026-12-03) passed
# theirs in bench/sessions/gpu_session_s15b.sh (bit-equal to their parts, in graphs too).
# moe_gate_plan (eighteenth session, 2026-12-04) passed in bench/sessions/gpu_session_s18f.sh
# (V4-Flash gate + 256 experts, eager and graph replays, bit-equal to moe_gate + the experts'
# own plan; the model's logits bit-equal across lanes).
# read_records (twenty-second session, 2026-12-06: a prefill's dense copy of a record source
# in one launch instead of ~15 torch ops) passed tests/kernels/test_triton_records.py's GPU
# checks on an H100 in bench/sessions/gpu_session_s23a.sh (twenty-third session).
UNVERIFIED_ON_GPU: frozenset[str] = frozenset()

# Twins that are compositions of other ops (hc_pre(hc_post(...)), moe_route(linear_fp32(...)),
# moe_combine(moe_experts(...)), moe_gate + the experts' plan): without their fused kernel the
# model calls the parts.
_COMPOSED_TWINS = frozenset({"hc_post_pre", "moe_gate", "moe_experts_shared", "moe_gate_plan"})

_cache: dict[tuple[str, bool], SimpleNamespace] = {}


def unverified_kernels_enabled() -> bool:
    """True when ``DSV4_UNVERIFIED_KERNELS=1``: kernels not yet checked on a GPU are used too."""
    return os.environ.get("DSV4_UNVERIFIED_KERNELS", "0") == "1"


def _collect(modules: tuple[str, ...], table: dict, required: bool,
             skip: frozenset[str] = frozenset()) -> None:
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            if required:
                raise
            continue
        for op in OP_NAMES:
            fn = getattr(mod, op, None)
            if fn is not None and op not in skip:
                table[op] = fn


def get_ops(backend: str = "torch") -> SimpleNamespace:
    """Return the op table for ``backend`` ("torch" or "triton")."""
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown op backend {backend!r}; allowed: 'torch', 'triton'")
    key = (backend, unverified_kernels_enabled())
    if key not in _cache:
        table: dict = {}
        _collect(_TORCH_MODULES, table, required=False)
        if backend == "triton":
            skip = frozenset() if key[1] else UNVERIFIED_ON_GPU
            _collect(_TRITON_MODULES, table, required=False, skip=skip)
            for op in _COMPOSED_TWINS & skip:
                # Its twin chains the torch twins of verified kernels: without the fused
                # kernel the model is faster calling those kernels one by one.
                table.pop(op, None)
        _cache[key] = SimpleNamespace(**table)
    return _cache[key]
