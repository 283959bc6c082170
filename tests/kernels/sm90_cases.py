"""Offline sm_90 (H200) compilation of every Triton kernel launch of the dsv4 ops, without a GPU.

The Triton interpreter does not type-check like the GPU compiler does (it accepted a helper whose
constexpr branches returned different dtypes, which the sm_90 compiler rejected), so CI also
compiles every launch for the H200 on the CPU machine.

How: a *scenario* calls the public op wrappers with CPU tensors at real model shapes (big
buffers come from ``torch.empty``, which costs no memory until touched).  While it runs,
:class:`Recorder` replaces ``JITFunction.run``: each launch goes through Triton's own binder and
``_pack_args`` with the CUDA backend of sm_90 (the same signature, constexprs, divisibility
attributes and options a launch on the H200 would compile with) and is recorded, not launched.
The recorder also makes the ops plan tiles for the H200 (``sm_count`` = 132) and makes the
``torch_twin_off_gpu`` wrappers take the kernel path for CPU tensors.  Every distinct launch is
then compiled to a cubin with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``.

Adding a case (a new kernel, a new configuration):

1. write a function that calls the op wrapper(s) with CPU tensors whose shapes, dtypes and
   options are those of the real launch (``torch.empty`` for large buffers; pass explicit tile
   configs where the GPU would pick them by shape);
2. decorate it with ``@scenario("area/what")`` (the name shows in the pytest id);
3. to also cover a constexpr that the GPU path picks differently from the CPU path, wrap the
   call in ``with RECORDER.override(kernel, NAME=value):``;
4. if a launch cannot compile and the fix is elsewhere, add a :class:`KnownFailure` (scenario,
   strings of the launch description, reason) to :data:`KNOWN_FAILURES`: the test then xfails.

Run it by hand: ``python tests/kernels/sm90_cases.py --list`` (scenarios and launches) or
``python tests/kernels/sm90_cases.py --out r.json`` (compile all; ``--only NAME``).
TRITON_INTERPRET must be unset (the kernels branch on it).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import pkgutil
import resource
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ARCH = 90                # the H200 (Hopper)
H200_SMS = 132           # streaming multiprocessors of the H200: the ops plan tiles by it
REPO = Path(__file__).resolve().parents[2]

# name -> function that calls op wrappers; filled by @scenario below.
SCENARIOS: dict[str, Callable[[], None]] = {}
# The machinery's own check (test_sm90_compile.py): a launch that must fail to compile and its
# twin that must compile; run with --canaries only.
CANARIES: dict[str, Callable[[], None]] = {}


@dataclass(frozen=True)
class KnownFailure:
    """Launches of ``scenario`` whose description (:meth:`Launch.describe`) contains every
    string of ``match`` are known not to compile / load on the H200: the test xfails on them
    (and still fails on any other launch).  Remove the entry once the op is fixed."""

    scenario: str
    match: tuple[str, ...]
    reason: str

    def covers(self, scenario: str, config: str) -> bool:
        return scenario == self.scenario and all(m in config for m in self.match)


KNOWN_FAILURES: list[KnownFailure] = []
# (An example of an entry, fixed since: KnownFailure("moe_experts/v4_flash/dense/prefill",
#  ("_moe_up_kernel[FMT=0,", "BM=64, BN=128, BK=128"), "needs 240 KB of shared memory ..."))


def scenario(name: str, canary: bool = False) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register ``fn`` as the scenario ``name`` (``canary``: one that must fail to compile)."""
    def deco(fn: Callable[[], None]) -> Callable[[], None]:
        table = CANARIES if canary else SCENARIOS
        if name in SCENARIOS or name in CANARIES:
            raise ValueError(f"sm90 scenario {name!r} is registered twice")
        table[name] = fn
        return fn
    return deco


# ------------------------------------------------------------------------------ recording
@dataclass
class Launch:
    """One kernel launch as the sm_90 compiler would see it."""

    kernel: Any                      # the JITFunction
    signature: dict[str, str]
    constexprs: dict[tuple, Any]
    attrs: dict[tuple, Any]
    options: Any                     # the backend's CUDAOptions

    @property
    def kernel_name(self) -> str:
        return self.kernel.fn.__name__

    def describe(self) -> str:
        """Kernel name, constexprs by name, and the launch options (for failure messages)."""
        names = self.kernel.arg_names
        ce = ", ".join(f"{names[p[0]]}={v!r}" for p, v in sorted(self.constexprs.items())
                       if len(p) == 1)
        types = ", ".join(f"{k}:{v}" for k, v in self.signature.items() if v != "constexpr")
        o = self.options
        return (f"{self.kernel.fn.__module__}.{self.kernel_name}[{ce}] "
                f"num_warps={o.num_warps} num_stages={o.num_stages} ({types})")

    def key(self) -> str:
        """Identity for deduplication: kernel, argument types (ints specialized to constexpr 1
        included), constexprs and options.  The divisibility hints (``attrs``) are left out: they
        only refine address analysis, and keeping them would multiply the compiles; the first
        launch seen (real shapes) supplies them."""
        text = repr((self.kernel.fn.__module__, self.kernel_name, sorted(self.signature.items()),
                     sorted(self.constexprs.items()), sorted(self.options.__dict__.items())))
        return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass
class Recorder:
    """Records the launches of the scenarios instead of running them (see the module doc)."""

    launches: list[Launch] = field(default_factory=list)
    overrides: dict[Any, dict[str, Any]] = field(default_factory=dict)

    @contextlib.contextmanager
    def override(self, kernel: Any, **constexprs: Any) -> Iterator[None]:
        """Launches of ``kernel`` inside the block get these constexpr values instead (for
        choices the ops make by device type, e.g. a precision tried on CUDA only)."""
        before = self.overrides.get(kernel)
        self.overrides[kernel] = {**(before or {}), **constexprs}
        try:
            yield
        finally:
            if before is None:
                del self.overrides[kernel]
            else:
                self.overrides[kernel] = before

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Patch the launch path and the device queries of the ops while the block runs."""
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime import jit as jit_mod

        import dsv4.ops
        from dsv4.ops import triton_dense

        backend = make_backend(GPUTarget("cuda", ARCH, 32))
        binders: dict[Any, Callable] = {}
        recorder = self

        def record_run(kernel: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            # The same steps as JITFunction.run up to the compile, with the sm_90 backend.
            kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
            kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
            kwargs.update(recorder.overrides.get(kernel, {}))
            if kernel not in binders:
                binders[kernel] = jit_mod.create_function_from_signature(
                    kernel.signature, kernel.params, backend)
            bound, spec, opts = binders[kernel](*args, **kwargs)
            options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                                      spec, opts)
            recorder.launches.append(Launch(kernel, signature, constexprs, attrs, options))

        # Every ops module (new ones too) is imported so that its copies of sm_count and of
        # _INTERPRET_HOST (True: the kernel path for CPU tensors) are patched.
        modules = [importlib.import_module(f"dsv4.ops.{m.name}")
                   for m in pkgutil.iter_modules(dsv4.ops.__path__)]
        real_sm_count = triton_dense.sm_count
        patches = [(m, "sm_count", lambda device: H200_SMS) for m in modules
                   if getattr(m, "sm_count", None) is real_sm_count]
        patches += [(m, "_INTERPRET_HOST", True) for m in modules if hasattr(m, "_INTERPRET_HOST")]
        # The H200 launches with programmatic dependent launch (dsv4.ops.pdl): compile that.
        patches.append((importlib.import_module("dsv4.ops.pdl"), "_FORCE", True))
        saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
        saved_run = jit_mod.JITFunction.run
        jit_mod.JITFunction.run = record_run
        for m, name, value in patches:
            setattr(m, name, value)
        try:
            yield
        finally:
            jit_mod.JITFunction.run = saved_run
            for m, name, value in saved:
                setattr(m, name, value)


RECORDER = Recorder()


def record(names: list[str]) -> tuple[dict[str, list[str]], dict[str, Launch], dict[str, str]]:
    """Run the scenarios ``names``; returns (scenario -> launch keys, key -> launch,
    scenario -> recording error)."""
    table = {**SCENARIOS, **CANARIES}
    per_scenario: dict[str, list[str]] = {}
    launches: dict[str, Launch] = {}
    errors: dict[str, str] = {}
    with RECORDER.active():
        for name in names:
            RECORDER.launches.clear()
            try:
                table[name]()
            except Exception:
                errors[name] = traceback.format_exc(limit=6)
            keys = []
            for launch in RECORDER.launches:
                k = launch.key()
                launches.setdefault(k, launch)
                if k not in keys:
                    keys.append(k)
            per_scenario[name] = keys
    return per_scenario, launches, errors


# Largest shared memory one block may use on the H200 (227 KB, opt-in): a kernel needing more
# compiles, then fails at load time on the GPU ("out of resource: shared memory").
H200_MAX_SHARED = 232448


def compile_launch(launch: Launch) -> Any:
    """Compile one recorded launch for sm_90 down to a cubin; raises on a compile error and when
    the kernel needs more shared memory than an H200 block has."""
    import triton
    from triton.backends.compiler import GPUTarget

    source = triton.compiler.ASTSource
    if getattr(launch.kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=launch.kernel, signature=launch.signature, constexprs=launch.constexprs,
                 attrs=launch.attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", ARCH, 32),
                            options=launch.options.__dict__)
    shared = kernel.metadata.shared
    if shared > H200_MAX_SHARED:
        raise RuntimeError(f"needs {shared} bytes of shared memory per block; the H200 has "
                           f"{H200_MAX_SHARED} (lower num_stages or the tile sizes)")
    return kernel


def toolchain_problem() -> str | None:
    """Why sm_90 cannot be compiled here (no NVIDIA backend / ptxas), or None."""
    try:
        import triton.backends
        if "nvidia" not in triton.backends.backends:
            return "the installed triton has no NVIDIA backend"
        from triton.backends.nvidia.compiler import get_ptxas
        path = get_ptxas(ARCH).path
        if not path or not os.path.exists(path):
            return f"ptxas not found ({path!r})"
    except Exception as e:  # an unusual triton build: report, do not crash the suite
        return f"triton's NVIDIA toolchain is unusable: {type(e).__name__}: {e}"
    return None


# ------------------------------------------------------------------------------ scenarios
@dataclass(frozen=True)
class ModelDims:
    """The dims of a real checkpoint that the kernels see (spec §1; tests/checkpoint)."""

    name: str
    dim: int
    heads: int
    q_lora: int
    o_groups: int
    o_lora: int
    index_heads: int
    inter: int
    experts: int
    block: int              # weight / act-quant block (V4.1: 32)
    head_dim: int = 512
    index_dim: int = 128
    topk: int = 6
    window: int = 128
    index_topk: int = 512

    def fp8_shapes(self) -> list[tuple[int, int]]:
        """(N, K) of the FP8 Linears: wq_a, wq_b, wkv, wo_b, indexer wq_b, shared w1/w3, w2."""
        return [(self.q_lora, self.dim), (self.heads * self.head_dim, self.q_lora),
                (self.head_dim, self.dim), (self.dim, self.o_groups * self.o_lora),
                (self.index_heads * self.index_dim, self.q_lora), (self.inter, self.dim),
                (self.dim, self.inter)]


V4_FLASH = ModelDims("v4_flash", 4096, 64, 1024, 8, 1024, 64, 2048, 256, 128)
V4_PRO = ModelDims("v4_pro", 7168, 128, 1536, 16, 1024, 64, 3072, 384, 128, index_topk=1024)
V41_FLASH = ModelDims("v41_flash", 5120, 64, 1280, 8, 1024, 32, 2304, 384, 32)
MODELS = (V4_FLASH, V4_PRO, V41_FLASH)
# Token counts: single decode, odd and 16-aligned decode batches, and prefill (the ops' tile
# plans and Triton's int specialization (== 1, % 16) both depend on them).
DECODE_T = (1, 5, 16, 32, 64)
PREFILL_T = 2048
# Experts actually allocated: the kernels see E only as an int (same % 16 class as 256/384),
# while the tile plans are picked for the real expert count.
E_ALLOC = 16


def _empty(*shape: int, dtype: Any) -> Any:
    """An uninitialized CPU tensor; byte dtypes (e4m3, e8m0) are made as uint8 and viewed."""
    import torch
    if dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        return torch.empty(*shape, dtype=torch.uint8).view(dtype)
    return torch.empty(*shape, dtype=dtype)


def _fp8_linear(m: ModelDims, Ms: tuple[int, ...], x_dtype: Any = None,
                scale_fp32: bool = False) -> None:
    import torch

    from dsv4.ops import triton_dense as td
    x_dtype = x_dtype or torch.bfloat16
    for N, K in m.fp8_shapes():
        w = _empty(N, K, dtype=torch.float8_e4m3fn)
        sdt = torch.float32 if scale_fp32 else torch.float8_e8m0fnu
        s = _empty(-(-N // m.block), K // m.block, dtype=sdt)
        for M in Ms:
            td.fp8_linear(_empty(M, K, dtype=x_dtype), w, s, m.block, x_dtype)


for _m in MODELS:
    scenario(f"fp8_linear/{_m.name}/decode")(lambda m=_m: _fp8_linear(m, DECODE_T))
    scenario(f"fp8_linear/{_m.name}/prefill")(lambda m=_m: _fp8_linear(m, (PREFILL_T,)))


@scenario("fp8_linear/v4_flash/fp32_scales_and_fp32_act")
def _fp8_linear_fp32() -> None:
    import torch
    _fp8_linear(V4_FLASH, (1, PREFILL_T), scale_fp32=True)
    _fp8_linear(V4_FLASH, (1, 16, PREFILL_T), x_dtype=torch.float32)


@scenario("act_quant")
def _act_quant() -> None:
    import torch

    from dsv4.ops import triton_dense as td
    for dtype in (torch.bfloat16, torch.float32):
        for block in (128, 32):
            td.act_quant(_empty(PREFILL_T, 4096, dtype=dtype), block)


def _mhc(m: ModelDims, Ts: tuple[int, ...], dtype: Any = None) -> None:
    import torch

    from dsv4.ops import triton_mhc
    dtype = dtype or torch.bfloat16
    n, D = 4, m.dim
    f32 = torch.float32
    for T in Ts:
        x = _empty(T, n, D, dtype=dtype)
        # On CUDA the mixes try tf32x3 first and fall back to ieee: both must compile.
        for prec in ("tf32x3", "ieee"):
            with RECORDER.override(triton_mhc._hc_mix_partial_kernel, PRECISION=prec):
                triton_mhc.hc_pre(x, _empty((2 + n) * n, n * D, dtype=f32), _empty(3, dtype=f32),
                          _empty((2 + n) * n, dtype=f32), 1e-6, 1e-6, 20)
                triton_mhc.hc_head(x, _empty(n, n * D, dtype=f32), _empty(1, dtype=f32),
                           _empty(n, dtype=f32), 1e-6, 1e-6)
        triton_mhc.hc_post(_empty(T, D, dtype=dtype), x, _empty(T, n, dtype=f32),
                   _empty(T, n, n, dtype=f32))


for _m in MODELS:
    scenario(f"mhc/{_m.name}/bf16")(lambda m=_m: _mhc(m, DECODE_T[:3] + (PREFILL_T,)))
scenario("mhc/v4_flash/fp32")(lambda: _mhc(V4_FLASH, (1, PREFILL_T), __import__("torch").float32))


def _mhc_fused(m: ModelDims, Ts: tuple[int, ...], dtype: Any = None) -> None:
    """hc_post fused with the next hc_pre (dsv4.ops.triton_mhc.hc_post_pre): the post + mixes
    kernel in both precisions the GPU may pick, then the shared collapse kernel."""
    import torch

    from dsv4.ops import triton_mhc
    dtype = dtype or torch.bfloat16
    n, D = 4, m.dim
    f32 = torch.float32
    for T in Ts:
        for prec in ("tf32x3", "ieee"):
            with RECORDER.override(triton_mhc._hc_post_mix_kernel, PRECISION=prec):
                triton_mhc.hc_post_pre(_empty(T, D, dtype=dtype), _empty(T, n, D, dtype=dtype),
                               _empty(T, n, dtype=f32), _empty(T, n, n, dtype=f32),
                               _empty((2 + n) * n, n * D, dtype=f32), _empty(3, dtype=f32),
                               _empty((2 + n) * n, dtype=f32), 1e-6, 1e-6, 20)


for _m in MODELS:
    scenario(f"mhc_fused/{_m.name}/bf16")(lambda m=_m: _mhc_fused(m, DECODE_T[:3] + (PREFILL_T,)))
scenario("mhc_fused/v4_flash/fp32")(
    lambda: _mhc_fused(V4_FLASH, (1, PREFILL_T), __import__("torch").float32))


@scenario("glue_plans/v4_flash")
def _glue_plans() -> None:
    """The mHC prefill default plans by name (bf16x3 mixes; fp32 ones on fp32 streams) and the
    sweep's other plan families (bench/sweep_glue.py), and the expert prep at its default and
    a wide plan (issue #5)."""
    from dataclasses import replace

    import torch

    from dsv4.ops import triton_mhc
    from dsv4.ops import triton_moe as tm
    n, D, T = 4, 4096, 8192
    f32, bf16 = torch.float32, torch.bfloat16
    fn, scale, base = _empty(24, n * D, dtype=f32), _empty(3, dtype=f32), _empty(24, dtype=f32)
    P = triton_mhc.HcPlan
    with RECORDER.override(triton_mhc._hc_post_mix_kernel, PRECISION="tf32x3"), \
            RECORDER.override(triton_mhc._hc_mix_partial_kernel, PRECISION="tf32x3"):
        wide = triton_mhc.pick_hc_plan("post_pre", T, n, D, bf16)
        for plan in (wide, P(128, 32, 8, 2, 2, "bf16x3"),
                     P(32, 32, 4, 2, 4, "bf16x3"), P(64, 32, 4, 3, 2),
                     triton_mhc.pick_hc_plan("post_pre", 128, n, D, bf16),   # 2 warps
                     replace(wide, gates_once=not wide.gates_once)):   # (same bits)
            triton_mhc.hc_post_pre_with_plan(_empty(T, D, dtype=bf16), _empty(T, n, D, dtype=bf16),
                                     _empty(T, n, dtype=f32), _empty(T, n, n, dtype=f32), fn,
                                     scale, base, 1e-6, 1e-6, 20, plan=plan)
        for plan in (triton_mhc.pick_hc_plan("pre", T, n, D, bf16), P(128, 32, 8, 3, 2, "bf16x3")):
            triton_mhc.hc_pre_with_plan(_empty(T, n, D, dtype=bf16), fn, scale, base, 1e-6, 1e-6, 20,
                                plan=plan)
    triton_mhc.hc_post_with_plan(_empty(T, D, dtype=bf16), _empty(T, n, D, dtype=bf16),
                         _empty(T, n, dtype=f32), _empty(T, n, n, dtype=f32),
                         plan=P(1, 2048, 8, 3))
    pairs = torch.zeros(64 * 128, dtype=torch.int32)
    bexp = torch.zeros(64, dtype=torch.int32)
    for plan in (None, tm.PrepPlan(128, 8)):
        tm.moe_prep(_empty(T, D, dtype=bf16), pairs, bexp, _empty(64 * 128, D, dtype=bf16),
                    T * 6, 256, 6, True, 1, True, 128, 128, plan)


def _kv_sources(kind: str, m: ModelDims) -> tuple[Any, Any]:
    """(window source, compressed source) of a cache kind: dense bf16 pools or record pools."""
    import torch

    from dsv4.cache import formats as cf
    rows = 4096
    if kind == "dense":
        return (_empty(rows, m.head_dim, dtype=torch.bfloat16),
                _empty(rows, m.head_dim, dtype=torch.bfloat16))
    if kind == "v4_record":                      # 584-byte records for both pools
        f = cf.v4_kv_record(m.head_dim, 64)
        return (cf.PackedRows(_empty(rows, f.record_bytes, dtype=torch.uint8), f),) * 2
    fw = cf.fp8_record(m.head_dim, cf.V41_WINDOW_BLOCK)              # V4.1: 528 B window
    fc = cf.fp4_record(m.head_dim, cf.V41_LATENT_BLOCK, "e4m3")      # 288 B compressed
    return (cf.PackedRows(_empty(rows, fw.record_bytes, dtype=torch.uint8), fw),
            cf.PackedRows(_empty(rows, fc.record_bytes, dtype=torch.uint8), fc))


def _sparse_attn(kind: str, m: ModelDims, Ts: tuple[int, ...], heads: int | None = None) -> None:
    """bf16 queries over window-only (ratio-0 layers) and window + compressed sources.  The
    compressed list is the CSA top-k; the HCA's all-entries list only changes an int.  p_dtype
    (official numerics) is left at None here: with bf16 rows its constexpr branch is dead code,
    so the binary compiles the same code (the live fp32 case is in the fp32 scenario)."""
    import torch

    from dsv4.ops import triton_attn as ta
    H = heads or m.heads
    win, comp = _kv_sources(kind, m)
    i32 = torch.int32
    for T in Ts:
        q = _empty(T, H, m.head_dim, dtype=torch.bfloat16)
        sink = _empty(H, dtype=torch.float32)
        idx_w = _empty(T, m.window, dtype=i32)
        for kv_b, idx_b in ((None, None), (comp, _empty(T, m.index_topk, dtype=i32))):
            ta.sparse_attn(q, win, idx_w, kv_b, idx_b, sink, 0.04)


# Decode (one token: T specialized to 1, split-KV plan) and prefill (one-pass plan) per cache
# kind; a 16-token decode batch (split-KV, T not 1) for the V4 records; the 16-head prefill plan
# at 64 tokens and the 64-head bf16-row one (DENSE_WIDE_MIN_T) at 512.  sparse_attn compiles
# are the slowest (~3-5 s of CPU each): keep this list lean.
for _kind, _m, _ts in (("dense", V4_FLASH, (1, 64, 512)), ("v4_record", V4_FLASH, (1, 16, 512)),
                       ("v41_records", V41_FLASH, (1, 512))):
    scenario(f"sparse_attn/{_kind}")(lambda k=_kind, m=_m, ts=_ts: _sparse_attn(k, m, ts))
scenario("sparse_attn/v4_record/tp8_heads")(
    lambda: _sparse_attn("v4_record", V4_FLASH, (1, 512), heads=8))


@scenario("sparse_attn/fp32_and_split_dv")
def _sparse_attn_variants() -> None:
    import torch

    from dsv4.ops import triton_attn as ta
    win, comp = _kv_sources("dense", V4_FLASH)
    T = 512
    q = _empty(T, 64, 512, dtype=torch.float32)
    idx_w, idx_c = _empty(T, 128, dtype=torch.int32), _empty(T, 512, dtype=torch.int32)
    sink = _empty(64, dtype=torch.float32)
    # fp32 queries (the GPU tests' dtype): ieee dots, and P rounded to bf16 is live code here.
    # (fp32 launches take 12-20 s of CPU each to compile: one only.)
    ta.sparse_attn(q, win.float(), idx_w, comp.float(), idx_c, sink, 0.04, torch.bfloat16)
    # Plans the benches sweep: the head dim split across programs (N_DV > 1).
    for dv in (128, 256):
        cfg = ta.AttnConfig(BH=64, BN=32, num_warps=8, num_stages=2, dv=dv)
        ta.sparse_attn_with_config(q.bfloat16(), win, idx_w, comp, idx_c, sink, 0.04, None, cfg)
    # The 64-head bf16-row plan with its two sources in two loops (one_loop False; the default
    # is one loop, which ptxas gives no spills where the two loops spill 152 bytes).
    cfg = ta.AttnConfig(BH=64, BN=64, num_warps=8, num_stages=2, one_loop=False)
    ta.sparse_attn_with_config(q.bfloat16(), win, idx_w, comp, idx_c, sink, 0.04, None, cfg)


def _indexer(m: ModelDims, keys_kind: str) -> None:
    import torch

    from dsv4.cache import formats as cf
    from dsv4.ops import triton_attn as ta
    h, dI, L = m.index_heads, m.index_dim, 2048
    if keys_kind == "fp4_records":               # 68-byte e2m1 keys, ue8m0 per 32
        f = cf.fp4_record(dI, cf.V4_INDEX_BLOCK, "e8m0")
        keys = cf.PackedRows(_empty(8192, f.record_bytes, dtype=torch.uint8), f)
    else:
        keys = _empty(8192, dI, dtype=torch.bfloat16)
    for T in (1, 5, 512):
        ta.indexer_scores(_empty(T, h, dI, dtype=torch.bfloat16), _empty(T, h, dtype=torch.float32),
                          keys, torch.zeros(T, L, dtype=torch.int64),
                          torch.full((T,), L, dtype=torch.int64))


for _m in (V4_FLASH, V41_FLASH):
    for _k in ("fp4_records", "dense"):
        scenario(f"indexer_scores/{_m.name}/{_k}")(lambda m=_m, k=_k: _indexer(m, k))


def _experts(m: ModelDims, fmt: str, official: bool, scale_fp32: bool = False,
             E: int = E_ALLOC) -> Any:
    """ExpertWeights of E (E_ALLOC) experts at the real widths of ``m``, as the model stores
    them."""
    import torch

    from dsv4.ops.torch_dense import ExpertWeights
    D, inter, b = m.dim, m.inter, m.block
    act = b if official else None
    if fmt == "dense":
        return ExpertWeights(*(_empty(E, a, c, dtype=torch.bfloat16)
                               for a, c in ((inter, D), (inter, D), (D, inter))), act)
    if fmt == "fp4":
        w = [_empty(E, a, c // 2, dtype=torch.int8)
             for a, c in ((inter, D), (inter, D), (D, inter))]
        s = [_empty(E, a, c // 32, dtype=torch.float8_e8m0fnu)
             for a, c in ((inter, D), (inter, D), (D, inter))]
        return ExpertWeights(w[0], w[1], w[2], act, "fp4", s[0], s[1], s[2], b)
    sdt = torch.float32 if scale_fp32 else torch.float8_e8m0fnu
    w = [_empty(E, a, c, dtype=torch.float8_e4m3fn)
         for a, c in ((inter, D), (inter, D), (D, inter))]
    s = [_empty(E, -(-a // b), c // b, dtype=sdt) for a, c in ((inter, D), (inter, D), (D, inter))]
    return ExpertWeights(w[0], w[1], w[2], act, "fp8", s[0], s[1], s[2], b)


def _moe(m: ModelDims, fmt: str, phase: str, scale_fp32: bool = False) -> None:
    from dataclasses import replace

    import torch

    from dsv4.ops import triton_moe as tm
    # (tokens run here, tokens whose real-E plan is used): decode 1 / 16 tokens, a 1K batch
    # (32-row blocks), a 2K prefill (64-row blocks, two stages), an 8K prefill (128-row).
    plans = ((1, 1), (5, 16)) if phase == "decode" else ((64, 1024), (64, 2048), (64, 8192))
    for official in (False, True):
        ex = _experts(m, fmt, official, scale_fp32)
        bk = tm._block_k(ex, m.dim, m.inter)
        for T, T_real in plans:
            cfg = tm.pick_moe_config(T_real * m.topk, m.experts, m.dim, m.inter, bk)
            gen = torch.Generator().manual_seed(T)
            ids = torch.randint(0, E_ALLOC, (T, m.topk), generator=gen)
            tm.moe_experts_with_config(_empty(T, m.dim, dtype=torch.bfloat16), ids,
                                       torch.rand(T, m.topk), ex, 10.0, cfg)
            # The routing plan's constexprs follow the real expert and pair counts.
            plan_ids = torch.randint(0, m.experts, (T_real, m.topk), generator=gen)
            tm.moe_plan(plan_ids, m.experts, cfg.BM)
            tm.moe_plan(plan_ids, m.experts, cfg.BM, chunked=True)
        if phase == "decode":
            # The split-K path (fp32 partials, arrival atomics) whatever the default rule picks.
            cfg = tm.pick_moe_config(m.topk, m.experts, m.dim, m.inter, bk)
            cfg = replace(cfg, split_up=2, split_down=2)
            tm.moe_experts_with_config(_empty(1, m.dim, dtype=torch.bfloat16),
                                       torch.randint(0, E_ALLOC, (1, m.topk)),
                                       torch.rand(1, m.topk), ex, 10.0, cfg)
            # K-chunk-major MXFP4 stacks (the GPU layout) at one and 16 tokens, the second
            # with the shared expert's sum in the combine (moe_experts_shared).
            if fmt == "fp4":
                chunked = replace(ex, kchunk=bk)
                for T in (1, 16):
                    cfg = tm.pick_moe_config(T * m.topk, m.experts, m.dim, m.inter, bk)
                    x = _empty(T, m.dim, dtype=torch.bfloat16)
                    tm.moe_experts_with_config(x, torch.randint(0, E_ALLOC, (T, m.topk)),
                                               torch.rand(T, m.topk), chunked, 10.0, cfg,
                                               shared=x if T == 16 else None)
        elif fmt == "fp4":
            # The prefill plans on K-chunk-major stacks.
            cfg = tm.pick_moe_config(8192 * m.topk, m.experts, m.dim, m.inter, bk)
            tm.moe_experts_with_config(_empty(64, m.dim, dtype=torch.bfloat16),
                                       torch.randint(0, E_ALLOC, (64, m.topk)),
                                       torch.rand(64, m.topk), replace(ex, kchunk=bk), 10.0,
                                       cfg)


# MXFP4 experts (V4-Flash / Pro, V4.1-Flash), FP8 experts (the *-Base checkpoints), dense
# experts (bf16 stacks: tiny and unquantized models).
for _m, _f in ((V4_FLASH, "fp4"), (V41_FLASH, "fp4"), (V4_FLASH, "fp8"), (V4_FLASH, "dense")):
    for _ph in ("decode", "prefill"):
        scenario(f"moe_experts/{_m.name}/{_f}/{_ph}")(lambda m=_m, f=_f, ph=_ph: _moe(m, f, ph))
scenario("moe_experts/v4_flash/fp8_fp32_scales")(
    lambda: (_moe(V4_FLASH, "fp8", "decode", True), _moe(V4_FLASH, "fp8", "prefill", True)))


@scenario("moe_experts/v4_flash/fp4_fold")
def _moe_fold() -> None:
    """The one-multiply MXFP4 decode (SCALE_LE_128: every scale byte <= 128, checked on CUDA
    tensors only) of the expert kernels at the decode and prefill plans."""
    from dsv4.ops import triton_moe as tm
    with RECORDER.override(tm._moe_up_kernel, SCALE_LE_128=True), \
            RECORDER.override(tm._moe_down_kernel, SCALE_LE_128=True):
        _moe(V4_FLASH, "fp4", "decode")
        _moe(V4_FLASH, "fp4", "prefill")


@scenario("moe_experts/v4_flash/fp4_prep_in_up")
def _moe_prep_in_up() -> None:
    """The up kernel storing the activation GEMM-ready (UP_PREP_ACT: official act quant +
    MXFP4 split in its epilogue) and the down kernel doing the combine (DOWN_COMBINE, with
    the shared expert at 16 tokens), K-chunk-major stacks, the one-token split-K plan and the
    16-token one."""
    import torch

    from dsv4.ops import triton_moe as tm
    m = V4_FLASH
    old = tm.UP_PREP_ACT, tm.DOWN_COMBINE
    tm.UP_PREP_ACT = tm.DOWN_COMBINE = 1
    try:
        ex = _experts(m, "fp4", True, False)
        bk = tm._block_k(ex, m.dim, m.inter)
        from dataclasses import replace
        for T in (1, 16):
            cfg = tm.pick_moe_config(T * m.topk, m.experts, m.dim, m.inter, bk)
            x = _empty(T, m.dim, dtype=torch.bfloat16)
            tm.moe_experts_with_config(x, torch.randint(0, E_ALLOC, (T, m.topk)),
                                       torch.rand(T, m.topk), replace(ex, kchunk=bk), 10.0, cfg,
                                       shared=x if T == 16 else None)
    finally:
        tm.UP_PREP_ACT, tm.DOWN_COMBINE = old


@scenario("moe_experts/v4_flash/fp4_wgmma_decode")
def _moe_wgmma_decode() -> None:
    """The decode experts on FP8 wgmma with the MXFP4 codes decoded in registers
    (dsv4.ops.gluon_moe_decode, Gluon: this is its only CPU check): K-chunk-major V4-Flash
    stacks, official numerics, 1 and 10 tokens (8- and 16-column products), with the shared
    expert at 10; the GEMMs quantizing their own activation (the default) and the five-launch
    chain."""
    import torch

    from dsv4.ops import gluon_moe_decode as gm
    from dsv4.ops import triton_moe as tm
    m = V4_FLASH
    ex = _experts(m, "fp4", True, False)
    ex = replace(ex, kchunk=tm._block_k(ex, m.dim, m.inter))
    old = gm.FUSED_FILL
    try:
        # The default also at ten tokens (16-column products); the five launches at one.
        for gm.FUSED_FILL, tokens in ((True, (1, 10)), (False, (1,))):
            for T in tokens:
                x = _empty(T, m.dim, dtype=torch.bfloat16)
                gm.moe_experts_wgmma(x, torch.randint(0, E_ALLOC, (T, m.topk)),
                                     torch.rand(T, m.topk), ex, 10.0,
                                     shared=x if T == 10 else None)
    finally:
        gm.FUSED_FILL = old


@scenario("sparse_attn/v4_record/rope_out")
def _sparse_attn_rope_out() -> None:
    """The split-KV merge with the output's inverse RoPE (explicit-rounding PTX multiplies) at
    one and 16 decode tokens."""
    import torch

    from dsv4.ops import triton_attn as ta
    m = V4_FLASH
    win, comp = _kv_sources("v4_record", m)
    for T in (1, 16):
        q = _empty(T, m.heads, m.head_dim, dtype=torch.bfloat16)
        cos = _empty(T, 32, dtype=torch.float32)
        ta.sparse_attn(q, win, _empty(T, m.window, dtype=torch.int32), comp,
                       _empty(T, m.index_topk, dtype=torch.int32),
                       _empty(m.heads, dtype=torch.float32), 0.04, rope_out=(cos, cos))


@scenario("index/picked_rows")
def _picked_rows() -> None:
    """Top-k entry ids -> pool rows (dsv4.ops.triton_index.picked_rows) at decode and prefill
    shapes, int64 and int32 ids."""
    import torch

    from dsv4.ops import triton_index as ti
    for T, L, k in ((1, 2048, 512), (4096, 8192, 512)):
        table = _empty(T, L + 1, dtype=torch.int32)
        for dt in (torch.int64, torch.int32):
            ti.picked_rows(table, _empty(T, k, dtype=dt))


@scenario("prefetch/l2")
def _l2_prefetch() -> None:
    """The L2 warm-up reads (dsv4.ops.triton_prefetch, bench/l2_prefetch.py) over a 32 MB
    weight, both cache hints."""
    import torch

    from dsv4.ops import triton_prefetch as tp
    w = _empty(32768, 1024, dtype=torch.uint8)
    for programs in (16, 132):
        for evict_last in (False, True):
            tp.l2_prefetch(w, programs, evict_last=evict_last)


@scenario("prefetch/l2_bulk")
def _l2_bulk_prefetch() -> None:
    """The bulk L2 prefetches (cp.async.bulk.prefetch.L2): a 32 MB weight and the picked
    experts' stacks of V4-Flash (K-chunk-major MXFP4), both cache policies."""
    import torch

    from dsv4.ops import triton_prefetch as tp
    from dsv4.ops.torch_dense import ExpertWeights
    w = _empty(32768, 1024, dtype=torch.uint8)
    for evict_last in (False, True):
        tp.l2_bulk_prefetch(w, 8, evict_last=evict_last)
    m = V4_FLASH
    E, D, inter = E_ALLOC, m.dim, m.inter

    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _empty(E, n, k // 2, dtype=torch.int8), _empty(E, n, k // 32, dtype=torch.uint8)

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, D), stack(inter, D), stack(D, inter)
    ex = ExpertWeights(w1, w3, w2, 128, "fp4", s1, s3, s2, 128, 128)
    ids = torch.zeros(1, 6, dtype=torch.int32)
    for which in (("w1", "w3", "s1", "s3"), ("w2", "s2")):
        tp.moe_l2_prefetch(ids, ex, which)
    tp.moe_l2_prefetch(ids, ex, evict_last=True)


@scenario("moe_experts/grouped_and_dequant")
def _moe_grouped() -> None:
    import torch

    from dsv4.ops import triton_moe as tm
    m = V4_FLASH
    real_grouped_mm = torch._grouped_mm

    def shape_only(a: Any, b: Any, offs: Any) -> Any:   # the CPU GEMM itself is not under test
        return torch.empty(a.shape[0], b.shape[-1], dtype=a.dtype)

    torch._grouped_mm = shape_only
    try:
        for fmt, fp32 in (("fp4", False), ("fp8", False), ("fp8", True)):
            gen = torch.Generator().manual_seed(0)
            ids = torch.randint(0, E_ALLOC, (64, m.topk), generator=gen)
            tm.moe_experts_grouped(_empty(64, m.dim, dtype=torch.bfloat16), ids,
                                   torch.rand(64, m.topk), _experts(m, fmt, False, fp32), 10.0)
    finally:
        torch._grouped_mm = real_grouped_mm


@scenario("moe_experts/v4_flash/fp4_fp8mma/prefill")
def _moe_fp8mma() -> None:
    """The FP8-MMA expert path (dsv4.ops.triton_moe_fp8, MXFP4 under official numerics, bf16)
    with the default tile plans of a 2,048- and an 8,192-token prefill (64- and 128-row blocks)
    and the --sweep plans of bench/moe_prefill_fp8.py: one fp8 dot per 128-wide K step of
    scale-folded, register-decoded weights (the inline-PTX decode, and the ALU one that
    DSV4_FP8MMA_DECODE=alu picks), and the predecoded form (the re-encoding kernel, the GEMMs
    streaming its FP8 codes), their shared-memory needs; V4.1-Flash (act block 32: 32-wide
    steps).  The scale-spread check is bypassed (the empty scale tensors hold no real values).
    ptxas at the defaults (sm_90): up 196 / down 227 registers, 72 / 57 KB shared (BM 64); up
    195 / down 226, 72 / 80 KB (BM 128); no spills."""
    import torch

    from dsv4.ops import triton_moe_fp8 as tf8
    real_ok = tf8.fold_spread_ok
    tf8.fold_spread_ok = lambda experts, ks: True
    try:
        m = V4_FLASH
        ex = _experts(m, "fp4", True)
        plans = [tf8.pick_fp8mma_config(T * m.topk, m.experts) for T in (2048, 8192)]
        assert plans == [tf8.PLAN_SMALL, tf8.PLAN_LARGE]
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, E_ALLOC, (64, m.topk), generator=gen)
        x = _empty(64, m.dim, dtype=torch.bfloat16)
        from dataclasses import replace
        for cfg in plans:
            for predecode in (False, True):
                for stacks in (ex, replace(ex, kchunk=128)):   # row-major, K-chunk-major
                    tf8.moe_experts_fp8mma(x, ids, torch.rand(64, m.topk), stacks, 10.0, cfg,
                                           predecode=predecode)
            with RECORDER.override(tf8._fp8mma_up_kernel, ASM_DECODE=False), \
                    RECORDER.override(tf8._fp8mma_down_kernel, ASM_DECODE=False):
                tf8.moe_experts_fp8mma(x, ids, torch.rand(64, m.topk), ex, 10.0, cfg,
                                       predecode=False)
        with RECORDER.override(tf8._fp8_predecode_kernel, ASM_DECODE=False):
            tf8.moe_experts_fp8mma(x, ids, torch.rand(64, m.topk), ex, 10.0, tf8.PLAN_LARGE,
                                   predecode=True)
        # The re-encoding tiles of bench/moe_prefill_fp8.py --sweep.
        from dsv4.ops import triton_moe as tm
        w2, s2, _ = tm._weight_args(ex, "w2")
        q = torch.empty(2, m.dim, m.inter, dtype=torch.float8_e4m3fn)
        f = torch.empty(2, m.inter // 128, m.dim)
        for tile in _bench_module("moe_prefill_fp8").PREDECODE_TILES:
            for kchunk in (False, True):
                tf8._predecode(w2, s2, q, f, 0, 2, True, 128, tile, kchunk)
        m = V41_FLASH
        ex = _experts(m, "fp4", True)
        for predecode in (False, True):
            tf8.moe_experts_fp8mma(_empty(64, m.dim, dtype=torch.bfloat16),
                                   torch.randint(0, E_ALLOC, (64, m.topk), generator=gen),
                                   torch.rand(64, m.topk), ex, 10.0, tf8.PLAN_SMALL,
                                   predecode=predecode)
    finally:
        tf8.fold_spread_ok = real_ok


@scenario("moe_experts/v4_flash/fp8_codes_gluon/prefill")
def _moe_fp8_codes_gluon() -> None:
    """The prefill expert GEMMs on FP8 codes in Gluon (dsv4.ops.gluon_moe_prefill, TMA ring;
    no interpreter: this is its only CPU check): the default up / down plans and every plan of
    bench/moe_gluon_prefill.py (plain, lagged, warp-specialized; the last also skipping other
    chunks' blocks), V4-Flash widths, 64-row blocks of an 8,192-token call's plan."""
    import torch

    from dsv4.ops import gluon_moe_prefill as gp
    m, E, P = V4_FLASH, E_ALLOC, 8192 * V4_FLASH.topk
    nb = P // 64 + E
    rows = nb * 64
    pairs = _empty(rows, dtype=torch.int32)
    bexp = _empty(nb, dtype=torch.int32)
    e4m3 = torch.float8_e4m3fn
    xq, xs = _empty(rows, m.dim, dtype=e4m3), _empty(rows, m.dim // 128, dtype=torch.float32)
    q1, q3 = _empty(E, m.inter, m.dim, dtype=e4m3), _empty(E, m.inter, m.dim, dtype=e4m3)
    f1 = _empty(E, m.dim // 128, m.inter, dtype=torch.float32)
    act = _empty(rows, m.inter, dtype=torch.bfloat16)
    aq, as_ = _empty(rows, m.inter, dtype=e4m3), _empty(rows, m.inter // 128, dtype=torch.float32)
    q2 = _empty(E, m.dim, m.inter, dtype=e4m3)
    f2 = _empty(E, m.inter // 128, m.dim, dtype=torch.float32)
    y = _empty(P, m.dim, dtype=torch.bfloat16)
    plans = [("up", gp.PLAN_UP), ("down", gp.PLAN_DOWN)]
    bench = _bench_module("moe_gluon_prefill")
    plans += bench.parse_plans(bench.DEFAULT_PLANS)
    for gemm, plan in plans:
        if gemm == "up":
            gp.gemm_up(xq, xs, q1, q3, f1, f1, pairs, bexp, _empty(P, dtype=torch.float32),
                       act, P, 0, E, 10.0, 128, 128, plan)
        else:
            gp.gemm_down(aq, as_, q2, f2, pairs, bexp, y, P, 0, E, 128, 128, plan)
    # The warp-specialized tiles skipping other chunks' blocks (DSV4_GLUON_WS_SKIP).
    with RECORDER.override(gp._gemm_ws_kernel, SKIP=True):
        gp.gemm_up(xq, xs, q1, q3, f1, f1, pairs, bexp, _empty(P, dtype=torch.float32), act, P,
                   0, E, 10.0, 128, 128)
        gp.gemm_down(aq, as_, q2, f2, pairs, bexp, y, P, 0, E, 128, 128)


@scenario("moe_experts/v4_flash/fp4_gluon_mx/prefill")
def _moe_gluon_mx() -> None:
    """The prefill expert GEMMs on the MXFP4 stacks in Gluon, decoded in registers
    (dsv4.ops.gluon_moe_mxfp4; no interpreter: this is its only CPU check): the default up /
    down plans and the other plans of bench/moe_gluon_mx.py, V4-Flash widths, an 8,192-token
    call's plan."""
    import torch

    from dsv4.ops import gluon_moe_mxfp4 as mx
    m, E, P = V4_FLASH, E_ALLOC, 8192 * V4_FLASH.topk
    e4m3 = torch.float8_e4m3fn
    w13 = _empty(E, m.inter, m.dim // 2, dtype=torch.uint8)
    s13 = _empty(E, m.inter, m.dim // 32, dtype=torch.uint8)
    w2 = _empty(E, m.dim, m.inter // 2, dtype=torch.uint8)
    s2 = _empty(E, m.dim, m.inter // 32, dtype=torch.uint8)
    plans = [("up", mx.PLAN_UP), ("down", mx.PLAN_DOWN)]
    bench = _bench_module("moe_gluon_mx")
    plans += bench.parse_plans(bench.DEFAULT_PLANS)
    for gemm, plan in plans:
        nb = P // plan.BM + E
        rows = nb * plan.BM
        pairs = _empty(rows, dtype=torch.int32)
        bexp = _empty(nb, dtype=torch.int32)
        if gemm == "up":
            xq = _empty(rows, m.dim, dtype=e4m3)
            xs = _empty(rows, m.dim // 128, dtype=torch.float32)
            act = _empty(rows, m.inter, dtype=torch.bfloat16)
            mx.gemm_up(xq, xs, w13, s13, w13, s13, pairs, bexp, _empty(P, dtype=torch.float32),
                       act, P, 10.0, 128, plan)
        else:
            aq = _empty(rows, m.inter, dtype=e4m3)
            as_ = _empty(rows, m.inter // 128, dtype=torch.float32)
            mx.gemm_down(aq, as_, w2, s2, pairs, bexp, _empty(P, m.dim, dtype=torch.bfloat16), P,
                         128, plan)


def _bench_module(name: str):
    """bench/<name>.py as a module (the plan and tile lists its sweeps time)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"{name}_bench", REPO / "bench" / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@scenario("moe_experts/v4_flash/fp4_fp8mma/sweep")
def _moe_fp8mma_sweep() -> None:
    """The other tile plans of bench/moe_prefill_fp8.py --sweep (they must compile and fit)."""
    import torch

    from dsv4.ops import triton_moe_fp8 as tf8
    bench = _bench_module("moe_prefill_fp8")
    real_ok = tf8.fold_spread_ok
    tf8.fold_spread_ok = lambda experts, ks: True
    try:
        m = V4_FLASH
        ex = _experts(m, "fp4", True)
        ids = torch.randint(0, E_ALLOC, (64, m.topk), generator=torch.Generator().manual_seed(1))
        x = _empty(64, m.dim, dtype=torch.bfloat16)
        for cfg in bench.SWEEP:
            if cfg not in (tf8.PLAN_SMALL, tf8.PLAN_LARGE):
                tf8.moe_experts_fp8mma(x, ids, torch.rand(64, m.topk), ex, 10.0, cfg)
    finally:
        tf8.fold_spread_ok = real_ok


@scenario("moe_experts/gemv")
def _moe_gemv() -> None:
    """The GEMV expert path for 1-4 tokens (dsv4.ops.triton_moe_gemv, MXFP4, bf16 x): the
    default plans of V4-Flash (official and bf16 numerics) and V4.1-Flash (act block 32) at
    T = 1, 2, 4, a split-heavy and an unsplit plan, every plan of the first H200 sweep (issue
    #5: BK 256 / 512 at 4 warps), the ALU decode (DSV4_GEMV_DECODE=alu)."""
    import torch

    from dsv4.ops import triton_moe_gemv as gv
    for m, official in ((V4_FLASH, True), (V4_FLASH, False), (V41_FLASH, True)):
        ex = _experts(m, "fp4", official)
        for T in (1, 2, 4):
            gen = torch.Generator().manual_seed(T)
            ids = torch.randint(0, E_ALLOC, (T, m.topk), generator=gen)
            gv.moe_experts_gemv(_empty(T, m.dim, dtype=torch.bfloat16), ids,
                                torch.rand(T, m.topk), ex, 10.0)
    m = V4_FLASH
    ex = _experts(m, "fp4", True)
    x = _empty(1, m.dim, dtype=torch.bfloat16)
    ids = torch.randint(0, E_ALLOC, (1, m.topk))
    sweep = [(32, 32, 256, 2, 8, 4), (32, 32, 256, 1, 4, 4), (32, 32, 256, 4, 8, 4),
             (16, 32, 256, 4, 8, 4), (16, 16, 256, 4, 8, 4), (32, 64, 256, 2, 4, 4),
             (64, 64, 256, 2, 4, 8), (32, 32, 128, 4, 8, 4), (16, 32, 512, 2, 4, 4),
             (64, 64, 128, 4, 8, 4)]
    for cfg in (gv.GemvConfig(BN_up=16, BN_down=64, BK=128, split_up=8, split_down=8),
                gv.GemvConfig(BN_up=64, BN_down=64, BK=256, warps_up=8, warps_down=8),
                *(gv.GemvConfig(bu, bd, bk, su, sd, wp, wp) for bu, bd, bk, su, sd, wp in sweep)):
        gv.moe_experts_gemv(x, ids, torch.rand(1, m.topk), ex, 10.0, cfg)
    with RECORDER.override(gv._gemv_up_kernel, ASM=False), \
            RECORDER.override(gv._gemv_down_kernel, ASM=False):
        gv.moe_experts_gemv(x, ids, torch.rand(1, m.topk), ex, 10.0)
    # K-chunk-major stacks (the GPU layout): bench/moe_gemv.py's plans, inputs quantized once
    # per call (the default) and in the K loop.
    from dataclasses import replace
    bench = _bench_module("moe_gemv")
    exk = replace(ex, kchunk=128)
    before = gv.GEMV_PREQUANT
    try:
        for pre in (True, False):
            gv.GEMV_PREQUANT = pre
            for T in (1, 2, 4):
                gv.moe_experts_gemv(_empty(T, m.dim, dtype=torch.bfloat16),
                                    torch.randint(0, E_ALLOC, (T, m.topk)),
                                    torch.rand(T, m.topk), exk, 10.0)
            for bu, bd, bk, su, sd, wp in bench.SWEEP_KCHUNK:
                gv.moe_experts_gemv(x, ids, torch.rand(1, m.topk), exk, 10.0,
                                    gv.GemvConfig(bu, bd, bk, su, sd, wp, wp))
    finally:
        gv.GEMV_PREQUANT = before


def _norm_rope(m: ModelDims) -> None:
    """RMSNorm / RoPE kernels (dsv4.ops.triton_norm) at the attention's and indexer's widths;
    the row tile follows the row count, so decode and prefill both run."""
    import torch
    tn = importlib.import_module("dsv4.ops.triton_norm")
    bf16, f32 = torch.bfloat16, torch.float32
    for T in (1, 16, PREFILL_T):
        cos, sin = _empty(T, 32, dtype=f32), _empty(T, 32, dtype=f32)
        for d in (m.dim, m.q_lora, m.head_dim):
            tn.rms_norm(_empty(T, d, dtype=bf16), _empty(d, dtype=f32), 1e-6)
        q = _empty(T, m.heads, m.head_dim, dtype=bf16)
        for inverse in (False, True):
            tn.apply_rope(q, cos, sin, inverse)
        for inplace in (False, True):                   # the attention runs it in place
            tn.head_norm_rope(q, cos, sin, 1e-6, not m.name.startswith("v41"), inplace)
        tn.rms_norm(_empty(T, m.head_dim, dtype=f32), _empty(m.head_dim, dtype=f32), 1e-6)
        tn.apply_rope(_empty(T, m.index_heads, m.index_dim, dtype=bf16), cos, sin)
        for fp8_block in (0, 64):                       # bf16 / official numerics
            tn.norm_rope(_empty(T, m.head_dim, dtype=bf16), _empty(m.head_dim, dtype=f32),
                         cos, sin, 1e-6, fp8_block)


for _m in (V4_FLASH, V41_FLASH):
    scenario(f"norm_rope/{_m.name}")(lambda m=_m: _norm_rope(m))


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Environment variables set for the block (restored after it)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _compress(ratio: int, overlap: bool, d: int, rope: bool, compact: bool = False) -> None:
    """The compressor's two kernels (dsv4.ops.triton_compress): finished entries (pool, norm,
    RoPE, bf16 out; both plans) and the carry-over state update, for a decode step (one token,
    one entry, a static-shape valid mask) and a prefill (2048 tokens); V4's at decode also with
    the fused ``ape`` add (HAS_APE; DSV4_UNVERIFIED_KERNELS=1 makes the wrappers fuse it until
    APE_FUSED_VERIFIED).  ``compact``: the C128 state in its compact form (one float64
    pseudo-row a slot: the kernels' COMPACT, run with DSV4_UNVERIFIED_KERNELS=1 until
    COMPACT_KERNELS_VERIFIED)."""
    import torch
    tc = importlib.import_module("dsv4.ops.triton_compress")
    f32, i64 = torch.float32, torch.int64
    coff = 2 if overlap else 1
    W = coff * d
    rows, sdt = (1, torch.float64) if compact else (coff * ratio, f32)
    state_kv = _empty(64, rows, W, dtype=sdt)
    state_score = _empty(64, rows, W, dtype=sdt)
    ape = _empty(ratio, W, dtype=f32)
    for T, valid in ((1, True), (PREFILL_T, False)):
        E = max(1, T // ratio)
        kv, score = _empty(T, W, dtype=f32), _empty(T, W, dtype=f32)
        start, cu = torch.zeros(1, dtype=i64), torch.tensor([0, T], dtype=i64)
        slots = torch.zeros(1, dtype=i64)
        cos = _empty(E, 32, dtype=f32) if rope else None
        sin = _empty(E, 32, dtype=f32) if rope else None
        # The fused ape add (V4's compressors only) at the decode size: each kernel's
        # HAS_APE form once (fewer float64-heavy compiles in CI).
        for a in (None, ape) if T == 1 and ratio in (4, 128) else (None,):
            # Both plans of compress_entries (loop; split, whose decode tiles differ by d) at
            # both sizes: DSV4_COMPRESS_PLAN picks one on the GPU too.
            for plan in ("loop", "split"):
                with _env(DSV4_COMPRESS_PLAN=plan, DSV4_UNVERIFIED_KERNELS="1"):
                    tc.compress_entries(kv, score, state_kv, state_score,
                                        torch.zeros(E, dtype=i64), torch.arange(E, dtype=i64),
                                        torch.ones(E, dtype=torch.bool) if valid else None,
                                        start, cu, slots, ratio, overlap, _empty(d, dtype=f32),
                                        1e-6, cos, sin, torch.bfloat16, ape=a)
            with _env(DSV4_UNVERIFIED_KERNELS="1"):
                tc.compress_update_state(kv, score, state_kv, state_score, start, cu, slots,
                                         ratio, overlap, ape=a)


# V4: the overlapping ratio-4 KV and indexer compressors, the ratio-128 one; V4.1: ratios 2, 1.
for _r, _ov, _d, _rope in ((4, True, 512, True), (128, False, 512, True), (4, True, 128, True),
                           (2, False, 512, True), (1, False, 512, True)):
    scenario(f"compress/r{_r}{'_overlap' if _ov else ''}_d{_d}")(
        lambda r=_r, ov=_ov, d=_d, rp=_rope: _compress(r, ov, d, rp))
# V4's C128 compressor with the compact carry-over (the cache's default form for it).
scenario("compress/r128_d512_compact")(lambda: _compress(128, False, 512, True, compact=True))


def _moe_glue(m: ModelDims) -> None:
    """The MoE glue kernels (dsv4.ops.triton_route): routing after the gate GEMM (learned and
    hash layers), the shared expert's SwiGLU (whole and a tensor-parallel eighth) and the
    routed + shared combine, at decode and prefill token counts."""
    import torch
    tr = importlib.import_module("dsv4.ops.triton_route")
    f32, bf16, i64 = torch.float32, torch.bfloat16, torch.int64
    for T in DECODE_T + (PREFILL_T,):
        logits = _empty(T, m.experts, dtype=f32)
        tr.moe_route(logits, _empty(m.experts, dtype=f32), None, None, m.topk, 1.5)
        tr.moe_route(logits, None, torch.zeros(1000, m.topk, dtype=i64),
                     torch.zeros(T, dtype=i64), m.topk, 1.5)
        for inter in (m.inter, m.inter // 8):
            tr.swiglu_act(_empty(T, inter, dtype=bf16), _empty(T, inter, dtype=bf16), 10.0, bf16)
        tr.swiglu_act(_empty(T, m.inter, dtype=f32), _empty(T, m.inter, dtype=f32), 0.0, f32)
        tr.moe_combine(_empty(T, m.dim, dtype=f32), _empty(T, m.dim, dtype=bf16), bf16)
        # The gate GEMM with the routing in its last tile (bf16 gate weight, as on the GPU).
        x, w = _empty(T, m.dim, dtype=bf16), _empty(m.experts, m.dim, dtype=bf16)
        tr.moe_gate(x, w, _empty(m.experts, dtype=f32), None, None, m.topk, 1.5)
        tr.moe_gate(x, w, None, torch.zeros(1000, m.topk, dtype=i64),
                    torch.zeros(T, dtype=i64), m.topk, 1.5)


def _gate_plan(m: ModelDims) -> None:
    """moe_gate_plan (the gate launch that also makes the experts' decode plan: learned and
    hash layers) and the up kernel reading its per-token rows, at the decode token counts
    whose pairs it serves; MXFP4 K-chunk-major (the GPU layout) and FP8 stacks."""
    from dataclasses import replace

    import torch
    tr = importlib.import_module("dsv4.ops.triton_route")
    tm = importlib.import_module("dsv4.ops.triton_moe")
    f32, bf16, i64 = torch.float32, torch.bfloat16, torch.int64
    w = _empty(m.experts, m.dim, dtype=bf16)
    for fmt in ("fp4", "fp8"):
        # The gate's expert count (uninitialized CPU stacks: never touched offline).
        ex = _experts(m, fmt, True, E=m.experts)
        if fmt == "fp4":
            ex = replace(ex, kchunk=tm._block_k(ex, m.dim, m.inter))
        made = 0
        for T in (t for t in DECODE_T if t * m.topk <= 64):
            x = _empty(T, m.dim, dtype=bf16)
            for args in ((_empty(m.experts, dtype=f32), None, None),
                         (None, torch.zeros(1000, m.topk, dtype=i64), torch.zeros(T, dtype=i64))):
                wts, ids, plan = tr.moe_gate_plan(x, w, *args, m.topk, 1.5, ex)
            # (None where the gate's K splits cut the experts' K steps: V4-Pro from 3 rows.)
            if plan is not None:
                made += 1
                tm.moe_experts_with_config(x, ids, wts, ex, 10.0, None, plan=plan)
        assert made, (m.name, fmt)


for _m in MODELS:
    scenario(f"moe_glue/{_m.name}")(lambda m=_m: _moe_glue(m))
    scenario(f"moe_gate_plan/{_m.name}")(lambda m=_m: _gate_plan(m))


def _indexer_queries(m: ModelDims) -> None:
    """The indexer's fused query path (dsv4.ops.triton_index): RoPE + Hadamard (V4) + FP4 fake
    quant (official) + head weights, at decode and prefill token counts; bf16 (GPU) and fp32
    (the GPU tests' dtype)."""
    import torch
    ti = importlib.import_module("dsv4.ops.triton_index")
    bf16, f32 = torch.bfloat16, torch.float32
    h, dI = m.index_heads, m.index_dim
    v4 = not m.name.startswith("v41")
    # V4: official (Hadamard + FP4), bf16 with fp4 record keys (Hadamard), plain; V4.1: no
    # Hadamard.
    sites = ((True, 32), (True, 0), (False, 0)) if v4 else ((False, 32), (False, 0))
    for T in DECODE_T + (PREFILL_T,):
        cos, sin = _empty(T, 32, dtype=f32), _empty(T, 32, dtype=f32)
        for dt in (bf16, f32) if T == 1 else (bf16,):
            q, w = _empty(T, h, dI, dtype=dt), _empty(T, h, dtype=dt)
            for hadamard, fp4_block in sites:
                ti.indexer_queries(q, w, cos, sin, dI ** -0.5 * h ** -0.5, hadamard, fp4_block)


for _m in (V4_FLASH, V4_PRO, V41_FLASH):
    scenario(f"indexer_queries/{_m.name}")(lambda m=_m: _indexer_queries(m))


def _records(v41: bool) -> None:
    """The fused cache writes (dsv4.ops.triton_records): encode rows into the record formats
    (V4: 584-byte window / compressed, fp4 index keys; V4.1: fp8 window, fp4 compressed latent,
    fp4 index keys) or a plain bf16 / fp32 pool, scattered into pool rows; a decode step (one
    row per request, gathered) and a prefill (2048 rows, encode only and scatter)."""
    import torch
    from dsv4.cache import formats as cf
    tr = importlib.import_module("dsv4.ops.triton_records")
    bf16, f32, i64 = torch.bfloat16, torch.float32, torch.int64
    if v41:
        fmts = [cf.fp8_record(512, cf.V41_WINDOW_BLOCK),
                cf.fp4_record(512, cf.V41_LATENT_BLOCK, "e4m3"),
                cf.fp4_record(128, cf.V41_INDEX_BLOCK, "e8m0")]
    else:
        fmts = [cf.v4_kv_record(512, 64), cf.fp4_record(128, cf.V4_INDEX_BLOCK, "e8m0")]
    for T in DECODE_T + (PREFILL_T,):
        idx = torch.arange(T, dtype=i64)
        for fmt in fmts:
            pool = _empty(8192, fmt.record_bytes, dtype=torch.uint8)
            for dt in (bf16, f32) if T == 1 else (bf16,):
                rows = _empty(T, fmt.dim, dtype=dt)
                tr.write_records(pool, idx, rows, idx, fmt)
                tr.write_records(pool, idx, rows, None, fmt)
                tr.encode_records(rows, fmt, torch.uint8)
        for dt in (bf16, f32):                          # plain rings (kv_cache_dtype "auto")
            tr.write_records(_empty(8192, 512, dtype=dt), idx, _empty(T, 512, dtype=dt), idx,
                             None)
    # A prefill's dense copies (read_records): whole sources and gathered entries, bf16 / fp32.
    for fmt in fmts:
        pool = _empty(8192, fmt.record_bytes, dtype=torch.uint8)
        for dt in (bf16, f32):
            tr.read_records(pool, None, fmt, dt)
            tr.read_records(pool, torch.arange(PREFILL_T, dtype=i64), fmt, dt)


scenario("records/v4")(lambda: _records(False))
scenario("records/v41")(lambda: _records(True))


def _records_hadamard() -> None:
    """The V4 indexer compressor's index keys: Hadamard rotation fused into the fp4 record write
    (``write_records(..., hadamard=True)``), bf16 entries (the model's) and fp32, decode and
    prefill entry counts; a plain fp32 pool (kv_cache_dtype "auto" keeps the twin's path in
    the model, compiled here for completeness)."""
    import torch
    from dsv4.cache import formats as cf
    tr = importlib.import_module("dsv4.ops.triton_records")
    fmt = cf.fp4_record(128, cf.V4_INDEX_BLOCK, "e8m0")
    for T in DECODE_T + (PREFILL_T,):
        idx = torch.arange(T, dtype=torch.int64)
        for dt in (torch.bfloat16, torch.float32):
            tr.write_records(_empty(8192, fmt.record_bytes, dtype=torch.uint8), idx,
                             _empty(T, 128, dtype=dt), None, fmt, hadamard=True)
    tr.write_records(_empty(8192, 128, dtype=torch.float32), torch.arange(4),
                     _empty(4, 128, dtype=torch.float32),
                     None, None, hadamard=True)


scenario("records/hadamard")(_records_hadamard)


def _linear32() -> None:
    """The fp32 skinny GEMM (dsv4.ops.triton_linear32): the compressors' wkv / wgate widths
    (1024, 512, 256) and the MoE gate (256 experts; V4.1: 384 at D 5120) at every decode token
    count (broadcast products up to 4 rows, an ieee fp32 dot above), fp32 and bf16 inputs;
    forced plans cover one split and the dot's widest tiles."""
    import torch
    tl32 = importlib.import_module("dsv4.ops.triton_linear32")
    shapes = [(1024, 4096), (512, 4096), (256, 4096), (384, 5120)]
    for N, K in shapes:
        w = _empty(N, K, dtype=torch.float32)
        for T in DECODE_T + (2, 3, 4):
            tl32.linear_fp32(_empty(T, K, dtype=torch.float32), w)
        tl32.linear_fp32(_empty(16, K, dtype=torch.bfloat16), w)
    w = _empty(1024, 4096, dtype=torch.float32)
    for cfg in (tl32.Linear32Config(BM=1, BN=64, BK=64, split_k=1),
                tl32.Linear32Config(BM=64, BN=128, BK=32, split_k=1),
                tl32.Linear32Config(BM=64, BN=128, BK=32, split_k=4)):
        tl32.linear_fp32_with_config(_empty(cfg.BM, 4096, dtype=torch.float32), w, cfg)
    # Prefill rows with a bf16 x: the bf16x3 tensor-core path (the compressors' stacked wkv +
    # wgate widths and the gate), its picked plans.
    for N in (2048, 1024, 512, 256):
        wp = _empty(N, 4096, dtype=torch.float32)
        tl32.linear_fp32_with_config(_empty(8192, 4096, dtype=torch.bfloat16), wp,
                                     tl32.pick_prefill_config(8192, N, 4096))
    # bf16-held weights (the GPU default): the kernel at every T, bf16 and fp32 x.
    for N in (2048, 1024, 512, 256):
        wb = _empty(N, 4096, dtype=torch.bfloat16)
        for T in (1, 2, 4, 16, 64, 8192):
            tl32.linear_fp32(_empty(T, 4096, dtype=torch.bfloat16), wb)
        tl32.linear_fp32(_empty(16, 4096, dtype=torch.float32), wb)
        # The wide one-row plans (BF16W_WIDE_ONE_ROW, off by default).
        wide = tl32.Linear32Config(BM=1, BN=16, BK=512, split_k=max(1, 4096 // N // 2),
                                   num_warps=4, num_stages=2)
        tl32.linear_fp32_with_config(_empty(1, 4096, dtype=torch.bfloat16), wb, wide)


scenario("linear_fp32/v4_flash")(_linear32)


# ------------------------------------------------------------------------------ canaries
# A helper that returns a different dtype from a constexpr branch than after it: the sm_90
# compiler rejects it (the interpreter runs it), as it rejected load_rows once.
_CANARY_SRC: dict[str, Any] = {}


def _canary_kernel() -> Any:
    """The canary kernel (defined on first use: this module must import without triton)."""
    if not _CANARY_SRC:
        import triton
        import triton.language as tl

        @triton.jit
        def _load_either(ptr, offs, AS_F32: tl.constexpr):
            if AS_F32:
                return tl.load(ptr + offs).to(tl.float32)
            return tl.load(ptr + offs)

        @triton.jit
        def canary_mixed_return_kernel(x_ptr, y_ptr, AS_F32: tl.constexpr):
            offs = tl.arange(0, 16)
            tl.store(y_ptr + offs, _load_either(x_ptr, offs, AS_F32).to(tl.float32))

        _CANARY_SRC["kernel"] = canary_mixed_return_kernel
    return _CANARY_SRC["kernel"]


def _launch_canary(as_f32: bool) -> None:
    import torch
    _canary_kernel()[(1,)](torch.empty(16, dtype=torch.bfloat16),
                           torch.empty(16, dtype=torch.float32), AS_F32=as_f32)


@scenario("topk/v4_flash")
def _topk() -> None:
    """Every launch plan of the indexer top-k (k 512 / 1024): decode rows in registers, many
    rows with compaction, streamed and split long rows (chunks + merge), a row shorter than k."""
    import torch

    from dsv4.ops.triton_topk import topk_indices
    for T, L, k in [(1, 2048, 512), (2048, 2048, 512), (16, 16384, 512), (256, 16384, 512),
                    (128, 16384, 512), (4, 65536, 1024), (1, 300, 1024)]:
        topk_indices(_empty(T, L, dtype=torch.float32), torch.zeros(T, dtype=torch.int64), k)


def _fp8_gemv(m: ModelDims, Ms: tuple[int, ...], alternates: bool = False) -> None:
    """The CUDA-core GEMV plans of fp8_linear (1-4 rows, triton_dense._fp8_gemv_kernel, off by
    default: GEMV_MAX_M): the default plan of every FP8 Linear at ``Ms`` rows; with
    ``alternates`` fp32 weight scales and activations, the sweep's other BN / BK / warps and
    the per-row form of 2-4 rows (GEMV_SPLIT_ROWS off)."""
    import torch

    from dsv4.ops import triton_dense as td
    for N, K in m.fp8_shapes():
        w = _empty(N, K, dtype=torch.float8_e4m3fn)
        s = _empty(-(-N // m.block), K // m.block, dtype=torch.float8_e8m0fnu)
        for M in Ms:
            cfg = td.pick_fp8_gemv_config(M, N, K, m.block, w.device)
            td.fp8_linear_with_config(_empty(M, K, dtype=torch.bfloat16), w, s, m.block,
                                      torch.bfloat16, cfg)
    if alternates:
        N, K = m.dim, m.o_groups * m.o_lora                               # wo_b
        w = _empty(N, K, dtype=torch.float8_e4m3fn)
        s32 = _empty(N // m.block, K // m.block, dtype=torch.float32)
        s8 = _empty(N // m.block, K // m.block, dtype=torch.float8_e8m0fnu)
        for M in (1, 4):
            td.fp8_linear_with_config(_empty(M, K, dtype=torch.float32), w, s32, m.block,
                                      torch.float32, td.pick_fp8_gemv_config(M, N, K, m.block,
                                                                             w.device))
            for bn, bk, warps in ((16, 512, 2), (32, 256, 4), (64, 1024, 8), (64, 512, 4),
                                  (128, 1024, 8)):
                cfg = td.Fp8GemmConfig(BM=M, BN=bn, split_k=8, num_warps=warps, num_stages=1,
                                       gemv=True, BK=bk)
                td.fp8_linear_with_config(_empty(M, K, dtype=torch.bfloat16), w, s8, m.block,
                                          torch.bfloat16, cfg)
        with RECORDER.override(td._fp8_gemv_kernel, SPLIT_ROWS=False):   # GEMV_SPLIT_ROWS=0
            for M in (2, 4):
                td.fp8_linear_with_config(_empty(M, K, dtype=torch.bfloat16), w, s8, m.block,
                                          torch.bfloat16, td.pick_fp8_gemv_config(
                                              M, N, K, m.block, w.device))


def _wo_a_gemv(m: ModelDims) -> None:
    """attn.wo_a through fp8_grouped_linear (the GEMV with groups, no activation quantization)
    at 1 and 2 tokens, all groups and a TP=2 shard, bf16 and fp32 out."""
    import torch

    from dsv4.ops import triton_dense as td
    K = m.heads * m.head_dim // m.o_groups
    for G in (m.o_groups, m.o_groups // 2):
        w = _empty(G * m.o_lora, K, dtype=torch.float8_e4m3fn)
        s = _empty(G * m.o_lora // m.block, K // m.block, dtype=torch.float8_e8m0fnu)
        for T in (1, 2):
            for out in (torch.bfloat16, torch.float32):
                td.fp8_grouped_linear(_empty(T, G, K, dtype=torch.bfloat16), w, s, m.block, out)


scenario("fp8_linear/v4_flash/gemv")(lambda: _fp8_gemv(V4_FLASH, (1, 2, 3, 4), True))
scenario("fp8_linear/v4_flash/wo_a_gemv")(lambda: _wo_a_gemv(V4_FLASH))
scenario("fp8_linear/v41_flash/wo_a_gemv")(lambda: _wo_a_gemv(V41_FLASH))
scenario("fp8_linear/v4_pro/gemv")(lambda: _fp8_gemv(V4_PRO, (1,)))
scenario("fp8_linear/v41_flash/gemv")(lambda: _fp8_gemv(V41_FLASH, (4,)))


@contextlib.contextmanager
def _comb_lane_on(tm: Any) -> Iterator[None]:
    """triton_mhc's collapse launches as inside a CUDA model step (the comb lane active), with
    the lane's stream switch left out (CPU tensors)."""
    saved = tm.comb_lane_active, tm.comb_lane
    tm.comb_lane_active = lambda device: True
    tm.comb_lane = lambda device, keep: contextlib.nullcontext()
    try:
        yield
    finally:
        tm.comb_lane_active, tm.comb_lane = saved


def _mhc_norm(m: ModelDims, Ts: tuple[int, ...], dtype: Any = None) -> None:
    """The mHC collapse with the sublayer input norm (triton_mhc ``norm_weight``): the n = 4
    collapse fused with the norm (one program per token; V4-Flash) and split + norm kernel
    (every model), for hc_pre, hc_post_pre and hc_head; iters 1 and 20; and the general-n
    collapse (n = 2)."""
    import torch

    from dsv4.ops import triton_mhc as tm
    dtype = dtype or torch.bfloat16
    n, D, f32 = 4, m.dim, torch.float32
    fn, scale, base = _empty(24, n * D, dtype=f32), _empty(3, dtype=f32), _empty(24, dtype=f32)
    w = _empty(D, dtype=f32)
    for T in Ts:
        x = _empty(T, n, D, dtype=dtype)
        for fuse in (True, False):
            for iters in (1, 20):
                tm.hc_pre_with_plan(x, fn, scale, base, 1e-6, 1e-6, iters, None, w, 1e-6, fuse)
            tm.hc_post_pre_with_plan(_empty(T, D, dtype=dtype), x, _empty(T, n, dtype=f32),
                                     _empty(T, n, n, dtype=f32), fn, scale, base, 1e-6, 1e-6,
                                     20, None, w, 1e-6, fuse)
            tm.hc_head_with_plan(x, fn[:n], scale[:1], base[:n], 1e-6, 1e-6, None, w, 1e-6, fuse)
            if T == 1 and fuse:
                # The comb lane's two launches (dsv4.ops.streams.deferred_comb), as on the GPU.
                with _comb_lane_on(tm):
                    tm.hc_pre_with_plan(x, fn, scale, base, 1e-6, 1e-6, 20, None, w, 1e-6, fuse)
    # Other stream counts keep the general collapse kernel (then the norm kernel): n = 2.
    x2 = _empty(Ts[0], 2, D, dtype=dtype)
    tm.hc_pre(x2, _empty(8, 2 * D, dtype=f32), scale, base[:8], 1e-6, 1e-6, 20, w)
    tm.hc_head(x2, _empty(2, 2 * D, dtype=f32), scale[:1], base[:2], 1e-6, 1e-6, w)


for _m in MODELS:
    scenario(f"mhc_norm/{_m.name}/bf16")(lambda m=_m: _mhc_norm(m, (1, 64, PREFILL_T)))
scenario("mhc_norm/v4_flash/fp32")(
    lambda: _mhc_norm(V4_FLASH, (1, PREFILL_T), __import__("torch").float32))


scenario("canary/mixed_return_dtypes", canary=True)(lambda: _launch_canary(True))
scenario("canary/single_return_dtype", canary=True)(lambda: _launch_canary(False))


# ------------------------------------------------------------------------------ command line
# Rough CPU seconds of one compile by kernel (measured here), to balance the shards.
_COST = {"_sparse_attn_kernel": 5.0, "_moe_up_kernel": 1.0, "_moe_down_kernel": 0.6}


def shard_keys(launches: dict[str, Launch], i: int, n: int) -> set[str]:
    """The launches shard i of n compiles: longest first onto the least loaded shard (the same
    deterministic split in every shard)."""
    load = [0.0] * n
    mine: set[str] = set()
    order = sorted(launches, key=lambda k: (-_COST.get(launches[k].kernel_name, 0.3), k))
    for key in order:
        s = load.index(min(load))
        load[s] += _COST.get(launches[key].kernel_name, 0.3)
        if s == i:
            mine.add(key)
    return mine


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas runs as one)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv: list[str] | None = None) -> int:
    """Record the scenarios and compile this shard's share of the distinct launches."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", action="append", default=[], help="scenario name (repeatable)")
    p.add_argument("--canaries", action="store_true", help="also run the must-fail scenarios")
    p.add_argument("--shard", default="0/1", help="i/n: compile launches i, i+n, ...")
    p.add_argument("--list", action="store_true", help="list scenarios and launches, compile none")
    p.add_argument("--out", help="write the JSON results here")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("sm90_cases: unset TRITON_INTERPRET (the GPU compiler must see the real kernels)")
        return 2
    sys.path.insert(0, str(REPO))
    names = a.only or list(SCENARIOS) + (list(CANARIES) if a.canaries else [])
    unknown = [n for n in names if n not in SCENARIOS and n not in CANARIES]
    if unknown:
        print(f"sm90_cases: unknown scenarios {unknown}")
        return 2
    result: dict[str, Any] = {"toolchain": toolchain_problem()}
    per_scenario, launches, errors = record(names)
    result.update(scenarios=per_scenario, record_errors=errors, launches={})
    i, n = (int(v) for v in a.shard.split("/"))
    mine = shard_keys(launches, i, n)
    for key, launch in launches.items():
        entry = {"kernel": launch.kernel_name, "config": launch.describe(), "error": None}
        if not a.list and key in mine and result["toolchain"] is None:
            t0, c0 = time.perf_counter(), _cpu_seconds()
            try:
                compile_launch(launch)
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {e}"[-4000:]
            entry["seconds"] = round(time.perf_counter() - t0, 2)
            entry["cpu_seconds"] = round(_cpu_seconds() - c0, 2)  # incl. ptxas
        result["launches"][key] = entry
    if a.list:
        for name, keys in per_scenario.items():
            print(name + (f"  RECORDING FAILED: {errors[name]}" if name in errors else ""))
            for k in keys:
                print("   ", result["launches"][k]["config"])
        print(f"{len(launches)} distinct launches")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.modules.setdefault("sm90_cases", sys.modules["__main__"])
    raise SystemExit(main())
