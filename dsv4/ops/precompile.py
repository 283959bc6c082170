"""Triton kernels compiled ahead of the engine's first steps, in parallel worker processes.

On a machine whose Triton disk cache is empty, an engine start compiles every kernel
specialization its profiling pass, graph captures and warm-up meet, one after another: ~100-400
of them for V4-Flash at 1-3 s each (LLVM in process, ``ptxas`` in a subprocess), so a fresh
H100 took ~225 s to serve where a warm one takes 10-35 s (docs/PERFORMANCE.md, twenty-sixth
session).  None of that needs the GPU or the model's weights.

A *kernel manifest* lists specializations in Triton's own serialized form (the one
``JITFunction.preload`` reads: signature, constexprs, divisibility attributes, options), as a
GPU run recorded them (:class:`KernelRecorder`, ``DSV4_RECORD_KERNELS=path``).  At start the
engine checks which of them are missing from the disk cache and compiles those in worker
processes (:func:`start`) while it builds or loads the model; its own first uses then load the
binaries from disk.  The kernels' current source is compiled (the manifest holds no code), so
a manifest recorded on older code only costs the compiles of specializations nobody asks for
any more; entries whose kernel no longer exists or whose arguments changed are skipped.

The package ships :data:`SHIPPED_MANIFEST` (recorded on an H100: V4-Flash widths, the engine's
default options).  A manifest names the hidden sizes of the models it was recorded with: an
engine of another width (a tiny test model, V4-Pro) does not spend its start compiling kernels
it would never launch; nor does one of another compute capability or Triton version.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("dsv4")

__all__ = ["SHIPPED_MANIFEST", "KernelRecorder", "record_to", "load_manifest", "missing",
           "compile_entry", "start", "Precompile", "default_workers"]

SHIPPED_MANIFEST = Path(__file__).with_name("kernels_sm90.json")

# Options that parse_options derives from the target and the Triton install (the libdevice
# path): recomputed where the manifest is compiled, so that machines with Triton elsewhere
# produce the same cache keys.
_DERIVED_OPTIONS = ("extern_libs", "arch")


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _entry(module: str, qualname: str, specialization_data: str) -> dict[str, Any]:
    """A manifest entry from what Triton's compile hooks pass (module, qualified name, the
    serialized specialization)."""
    spec = json.loads(specialization_data)
    spec["options"] = {k: v for k, v in spec["options"].items() if k not in _DERIVED_OPTIONS}
    spec.pop("key", None)   # the in-memory cache key: Triton recomputes it
    return {"module": module, "qualname": qualname, "spec": spec}


def _identity(entry: dict[str, Any]) -> str:
    return json.dumps(entry, sort_keys=True)


@dataclass
class KernelRecorder:
    """Records every kernel specialization this process compiles or loads (Triton's
    post-compile hook, chained to any hook already there); :meth:`write` merges them into a
    manifest file."""

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    arch: int | None = None
    dims: set[int] = field(default_factory=set)   # hidden sizes of the models recorded

    def install(self) -> "KernelRecorder":
        from triton import knobs

        previous = knobs.runtime.jit_post_compile_hook

        def hook(*, key: Any, repr: str, fn: Any, compile: dict[str, Any],  # noqa: A002
                 is_manual_warmup: bool, already_compiled: bool) -> Any:
            try:
                e = _entry(fn.module, fn.name, compile["specialization_data"])
                self.entries.setdefault(_identity(e), e)
            except Exception:   # a record that fails must never fail a launch
                log.debug("dsv4 precompile: could not record %s", repr, exc_info=True)
            if previous is not None:
                return previous(key=key, repr=repr, fn=fn, compile=compile,
                                is_manual_warmup=is_manual_warmup,
                                already_compiled=already_compiled)
            return None

        knobs.runtime.jit_post_compile_hook = hook
        return self

    def write(self, path: str | os.PathLike) -> int:
        """Merge the recorded entries into the manifest at ``path`` (created if absent; entries
        of another Triton version or compute capability there are dropped); returns the
        number of entries written."""
        path = Path(path)
        version = _triton_version()
        arch = self.arch if self.arch is not None else _device_arch()
        merged: dict[str, dict[str, Any]] = {}
        dims = set(self.dims)
        if path.exists():
            old = json.loads(path.read_text())
            if old.get("triton") == version and old.get("arch") == arch:
                merged = {_identity(e): e for e in old.get("kernels", [])}
                dims |= set(old.get("dims", []))
        merged.update(self.entries)
        kernels = sorted(merged.values(), key=lambda e: (e["module"], e["qualname"],
                                                         _identity(e)))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")   # ranks may write at once
        # One entry a line: a recorded change reads as a diff of lines.
        lines = ",\n".join(json.dumps(e, sort_keys=True) for e in kernels)
        tmp.write_text(f'{{"triton": {json.dumps(version)}, "arch": {arch}, '
                       f'"dims": {json.dumps(sorted(dims))},\n"kernels": [\n'
                       f"{lines}\n]}}\n")
        tmp.replace(path)
        return len(kernels)


def record_to(path: str) -> KernelRecorder:
    """Record into ``path`` for the rest of the process (written at exit, and whenever
    :meth:`KernelRecorder.write` is called)."""
    rec = KernelRecorder().install()
    atexit.register(rec.write, path)
    return rec


def _device_arch() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def load_manifest(path: str | os.PathLike, arch: int, dim: int | None = None
                  ) -> list[dict[str, Any]]:
    """The entries of the manifest at ``path`` that apply here: recorded with this Triton, for
    compute capability ``arch`` (e.g. 90) and, if ``dim`` is given, with a model of that hidden
    size among others; [] for a missing file or another version."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("dsv4 precompile: ignoring the unreadable kernel manifest %s (%s)", path, e)
        return []
    if data.get("triton") != _triton_version() or data.get("arch") != arch:
        log.info("dsv4 precompile: kernel manifest %s was recorded for Triton %s, sm_%s; this "
                 "is Triton %s, sm_%s: not used", path, data.get("triton"), data.get("arch"),
                 _triton_version(), arch)
        return []
    if dim is not None and dim not in data.get("dims", []):
        log.info("dsv4 precompile: kernel manifest %s was recorded for hidden sizes %s, not "
                 "%d: not used", path, data.get("dims"), dim)
        return []
    return list(data.get("kernels", []))


def _jit_function(obj: Any) -> Any:
    """The JITFunction behind an autotuner / heuristics wrapper."""
    from triton.runtime.jit import JITFunction

    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


def _source(entry: dict[str, Any], arch: int) -> tuple[Any, Any, Any]:
    """(ASTSource, backend, options) of an entry, as ``JITFunction.preload`` rebuilds them."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    obj: Any = importlib.import_module(entry["module"])
    for part in entry["qualname"].split("."):
        obj = getattr(obj, part)
    fn = _jit_function(obj)
    spec = entry["spec"]

    def tup(v: Any) -> Any:   # JSON made the tuples lists
        return tuple(tup(x) for x in v) if isinstance(v, list) else v

    constexprs = {}
    for k, v in zip(spec["constant_keys"], spec["constant_vals"]):
        if isinstance(v, str) and tl.dtype.is_dtype(v):
            v = tl.dtype(v)
        elif isinstance(v, dict) and "constexpr" in v:
            v = tl.constexpr(v["constexpr"])
        constexprs[tuple(k)] = v
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    signature = {k: tup(v) for k, v in spec["signature"].items()}
    # A kernel that gained or lost an argument since the recording: its entry's binary would be
    # a key no launch looks up.
    names = set(fn.arg_names)
    if set(signature) != names:
        raise ValueError(f"{entry['qualname']}'s arguments changed since the recording: "
                         f"{sorted(set(signature) ^ names)}")
    backend = make_backend(GPUTarget("cuda", arch, 32))
    options = backend.parse_options({k: tup(v) for k, v in spec["options"].items()})
    source = triton.compiler.ASTSource
    if fn.is_gluon():   # dsv4.ops.gluon_moe_decode
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn, signature, constexprs, attrs)
    return src, backend, options


def _cached(entry: dict[str, Any], arch: int) -> bool:
    """Whether Triton's disk cache holds the entry's binary (the lookup ``triton.compile``
    makes before compiling)."""
    import hashlib

    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.cache import get_cache_key, get_cache_manager

    src, backend, options = _source(entry, arch)
    options = backend.parse_options(dict(options.__dict__, **src.parse_options()))
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    manager = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest())
    name = f"{src.name[:150]}.json"
    return name in (manager.get_group(name) or {})


def missing(entries: list[dict[str, Any]], arch: int) -> list[dict[str, Any]]:
    """The entries not in Triton's disk cache yet (entries that cannot be rebuilt — a kernel
    renamed or changed since the manifest was recorded — are left out)."""
    out = []
    stale = 0
    for e in entries:
        try:
            if not _cached(e, arch):
                out.append(e)
        except Exception as err:
            stale += 1
            log.debug("dsv4 precompile: skipping %s.%s (%s)", e.get("module"),
                      e.get("qualname"), err)
    if stale:
        log.info("dsv4 precompile: %d of %d manifest entries no longer match their kernels "
                 "(a run with DSV4_RECORD_KERNELS=path records a new manifest)", stale,
                 len(entries))
    return out


def compile_entry(entry: dict[str, Any], arch: int) -> None:
    """Compile one entry for ``arch`` into Triton's disk cache (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget

    src, _, options = _source(entry, arch)
    triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options.__dict__)


@dataclass
class Precompile:
    """A background job: check which manifest entries Triton's disk cache lacks, compile those
    in worker processes; :meth:`wait` joins it.  Nothing of it may fail the engine's start: an
    error is logged and the kernels compile on first use, as without it."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    arch: int = 90
    max_workers: int = 1
    timeout: float = 1200.0   # seconds; then the rest compiles on first use, as without it
    started: float = field(default_factory=time.perf_counter)
    total: int = 0            # entries missing from the cache
    workers: list[subprocess.Popen] = field(default_factory=list)
    timed_out: bool = False
    cancelled: bool = False
    _thread: threading.Thread | None = None
    _results: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _run(self) -> None:
        try:
            todo = missing(self.entries, self.arch)
            self.total = len(todo)
            if todo and not self.cancelled:
                with tempfile.TemporaryDirectory(prefix="dsv4-precompile-") as tmp:
                    todo_path = Path(tmp) / "todo.json"
                    todo_path.write_text(json.dumps(todo))
                    self._spawn(todo_path, min(self.max_workers, len(todo)))
                    self._collect()
        except Exception:
            log.warning("dsv4 precompile: failed; kernels compile on first use", exc_info=True)

    def _spawn(self, todo_path: Path, n: int) -> None:
        env = dict(os.environ)
        # The workers import the kernels from where this process did (a source tree or a wheel).
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["CUDA_VISIBLE_DEVICES"] = ""   # compiling needs no GPU: no contexts, no GPU memory
        env.setdefault("OMP_NUM_THREADS", "1")
        log.info("dsv4 precompile: compiling %d kernels in %d worker processes", self.total, n)
        with self._lock:   # against cancel() in between
            for i in range(0 if self.cancelled else n):
                self.workers.append(subprocess.Popen(
                    [sys.executable, "-m", "dsv4.ops.precompile", str(todo_path),
                     str(self.arch), str(i), str(n)], stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, text=True, env=env))

    def _collect(self) -> None:
        for w in self.workers:
            try:
                out, _ = w.communicate(
                    timeout=max(0.0, self.started + self.timeout - time.perf_counter()))
            except subprocess.TimeoutExpired:
                # A hung compiler must not hang the engine's start.
                self.timed_out = True
                for v in self.workers:
                    v.kill()
                out, _ = w.communicate()
            for line in out.splitlines():
                try:
                    self._results.append(json.loads(line))
                except ValueError:
                    pass

    def cancel(self) -> None:
        """Stop the workers (the engine's start failed); the job ends soon after."""
        with self._lock:
            self.cancelled = True
            for w in self.workers:
                w.kill()

    def start(self) -> "Precompile":
        self._thread = threading.Thread(target=self._run, name="dsv4-precompile", daemon=True)
        self._thread.start()
        return self

    def wait(self) -> dict[str, Any]:
        """Block until the job is done; returns ``kernels`` (entries missing from the cache),
        ``compiled``, ``failed``, ``workers``, ``seconds`` (since :func:`start`) and
        ``timed_out``."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failed = [r for r in self._results if r.get("error")]
        for r in failed[:3]:
            log.debug("dsv4 precompile: %s failed: %s", r.get("kernel"), r.get("error"))
        stats = {"kernels": self.total, "compiled": len(self._results) - len(failed),
                 "failed": len(failed), "workers": len(self.workers),
                 "seconds": time.perf_counter() - self.started, "timed_out": self.timed_out}
        if self.timed_out:
            log.warning("dsv4 precompile: stopped after %.0f s; the kernels left compile on "
                        "first use", self.timeout)
        if self.total:
            log.info("dsv4 precompile: %d of %d kernels compiled by %d workers in %.1f s "
                     "(%d failed)", stats["compiled"], self.total, stats["workers"],
                     stats["seconds"], stats["failed"])
        return stats


def default_workers() -> int:
    """Worker processes: the CPUs this process may use, less two for the model's loading, at
    most 16 (each imports torch and Triton: ~0.3 GB of host memory)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(cpus - 2, 16))


# Manifests this process has compiled already (later engines of the process skip the check).
_started: set[tuple[str, int]] = set()


def start(manifest: str | os.PathLike, arch: int, workers: int | None = None,
          dim: int | None = None, timeout: float = 1200.0) -> Precompile:
    """Compile the entries of ``manifest`` (for compute capability ``arch``, a model of hidden
    size ``dim``) that Triton's disk cache lacks, in ``workers`` processes; the check and the
    compiles run in the background, so this returns at once.  A second call for the same
    manifest in one process has nothing to do."""
    seen = (str(Path(manifest).resolve()), arch)
    if seen in _started:
        return Precompile()
    _started.add(seen)
    return Precompile(entries=load_manifest(manifest, arch, dim), arch=arch,
                      max_workers=workers or default_workers(), timeout=timeout).start()


def _worker(todo_path: str, arch: int, shard: int, shards: int) -> None:
    """A worker: compile every ``shards``-th entry from ``shard`` on; one JSON line each."""
    todo = json.loads(Path(todo_path).read_text())
    for entry in todo[shard::shards]:
        t0 = time.perf_counter()
        err = None
        try:
            compile_entry(entry, arch)
        except Exception as e:
            err = f"{type(e).__name__}: {e}"[:500]
        print(json.dumps({"kernel": entry.get("qualname"), "seconds": time.perf_counter() - t0,
                          "error": err}), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
