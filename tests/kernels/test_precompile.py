"""Kernel manifests (dsv4/ops/precompile.py): a specialization recorded through Triton's own
post-compile hook, compiled for sm_90 by a worker process into an empty disk cache, is the
binary the launch path then finds (the same cache key), without a GPU — a Triton kernel and
the Gluon one.

The launch comes from the offline sm_90 recorder (tests/kernels/sm90_cases.py) in a child
process without ``TRITON_INTERPRET`` (the kernels branch on it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

CHILD = r"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import sm90_cases as c
problem = c.toolchain_problem()
if problem:
    print(json.dumps({"skip": problem})); sys.exit(0)
from triton import knobs
from triton.runtime.jit import JitFunctionInfo
from dsv4.ops import precompile as pc

c.RECORDER.launches.clear()
with c.RECORDER.active():
    c.SCENARIOS[sys.argv[3]]()
launch = next(x for x in c.RECORDER.launches if x.kernel_name == sys.argv[4])
out = {"kernel": launch.kernel_name}

# The hook as Triton calls it after a compile (JITFunction._call_hook serializes the launch).
rec = pc.KernelRecorder(arch=90, dims={64}).install()
launch.kernel._call_hook(knobs.runtime.jit_post_compile_hook, ((), ""), launch.signature, 0,
                         launch.constexprs, launch.options, [launch.attrs], False)
launch.kernel._call_hook(knobs.runtime.jit_post_compile_hook, ((), ""), launch.signature, 0,
                         launch.constexprs, launch.options, [launch.attrs], False)
manifest = Path(sys.argv[2])
out["written"] = rec.write(manifest)
entries = pc.load_manifest(manifest, 90)
out["entries"] = len(entries)
out["derived_options_dropped"] = all(k not in entries[0]["spec"]["options"]
                                     for k in ("extern_libs", "arch"))
out["other_arch"] = len(pc.load_manifest(manifest, 80))
out["same_dim"] = len(pc.load_manifest(manifest, 90, dim=64))
out["other_dim"] = len(pc.load_manifest(manifest, 90, dim=4096))
out["missing_before"] = len(pc.missing(entries, 90))

job = pc.start(manifest, 90, workers=2)
out["stats"] = job.wait()
out["missing_after"] = len(pc.missing(entries, 90))

# The launch path's own compile (what JITFunction.run does on the GPU) must now be a cache hit:
# no new entry in the cache directory.
cache = Path(os.environ["TRITON_CACHE_DIR"])
before = sorted(p.name for p in cache.iterdir())
c.compile_launch(launch)
out["new_cache_dirs"] = sorted(set(p.name for p in cache.iterdir()) - set(before))

# A stale entry (a parameter renamed since it was recorded) is skipped, not fatal.
stale = json.loads(json.dumps(entries[0]))
stale["spec"]["signature"]["no_such_param"] = "i32"
out["stale_missing"] = len(pc.missing([stale], 90))
print(json.dumps(out))
"""


def _child_env(tmp_path: Path) -> dict[str, str]:
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    return env


def _record_and_precompile(tmp_path: Path, env: dict[str, str], scenario: str,
                           kernel: str) -> dict:
    """CHILD on the first launch of ``kernel`` in the offline recorder's ``scenario``."""
    proc = subprocess.run([sys.executable, "-c", CHILD, str(HERE), str(tmp_path / "m.json"),
                           scenario, kernel],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"cannot compile for sm_90 here: {out['skip']}")
    return out


def test_recorded_kernel_precompiles_to_the_launch_paths_cache_entry(tmp_path: Path) -> None:
    env = _child_env(tmp_path)
    out = _record_and_precompile(tmp_path, env, "act_quant", "_act_quant_kernel")
    assert out["written"] == 1 and out["entries"] == 1          # recorded twice, kept once
    assert out["derived_options_dropped"]
    assert out["other_arch"] == 0                                  # sm_80 would not use it
    assert out["same_dim"] == 1 and out["other_dim"] == 0          # nor a model of other widths
    assert out["missing_before"] == 1
    assert out["stats"]["kernels"] == 1 and out["stats"]["compiled"] == 1
    assert out["stats"]["failed"] == 0
    assert out["missing_after"] == 0
    assert out["new_cache_dirs"] == []
    assert out["stale_missing"] == 0

    # `dsv4 precompile` fills another (empty) cache from the same manifest, without a GPU.
    env["TRITON_CACHE_DIR"] = str(tmp_path / "image_cache")
    cli = subprocess.run([sys.executable, "-m", "dsv4.cli", "precompile", "--manifest",
                          str(tmp_path / "m.json"), "--arch", "90", "--workers", "1"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert cli.stdout.startswith("1 of 1 kernels"), cli.stdout
    assert list((tmp_path / "image_cache").rglob("_act_quant_kernel.cubin"))
    again = subprocess.run([sys.executable, "-m", "dsv4.cli", "precompile", "--manifest",
                            str(tmp_path / "m.json"), "--arch", "90"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout.startswith("0 of 0 kernels"), again.stdout
    bad = subprocess.run([sys.executable, "-m", "dsv4.cli", "precompile", "--manifest",
                          str(tmp_path / "m.json"), "--arch", "80"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "holds nothing for sm_80" in bad.stderr


def test_gluon_kernel_records_and_precompiles(tmp_path: Path) -> None:
    """The one-token expert GEMM (Gluon, dsv4.ops.gluon_moe_decode): its specialization goes
    through Triton's compile hook into a manifest (its constexprs serialize: no layout object
    among them) and a worker compiles the launch path's own cache entry."""
    pytest.importorskip("triton.experimental.gluon")
    out = _record_and_precompile(tmp_path, _child_env(tmp_path),
                                 "moe_experts/v4_flash/fp4_wgmma_decode", "_wgmma_gemv_kernel")
    assert out["written"] == 1 and out["entries"] == 1
    assert out["missing_before"] == 1
    assert out["stats"]["compiled"] == 1 and out["stats"]["failed"] == 0
    assert out["missing_after"] == 0
    assert out["new_cache_dirs"] == []


def test_manifest_of_another_triton_is_ignored(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from dsv4.ops import precompile as pc

    path = tmp_path / "m.json"
    path.write_text(json.dumps({"triton": "0.0.1", "arch": 90, "kernels": [{"x": 1}]}))
    assert pc.load_manifest(path, 90) == []
    assert pc.load_manifest(tmp_path / "absent.json", 90) == []
    path.write_text("{not json")
    assert pc.load_manifest(path, 90) == []
    job = pc.start(tmp_path / "absent.json", 90)
    assert job.wait()["kernels"] == 0 and job.workers == []


def test_shipped_manifest_applies_to_v4_flash_widths_on_sm90() -> None:
    triton = pytest.importorskip("triton")
    from dsv4.ops import precompile as pc

    data = json.loads(pc.SHIPPED_MANIFEST.read_text())
    assert data["arch"] == 90 and 4096 in data["dims"]
    entries = pc.load_manifest(pc.SHIPPED_MANIFEST, 90, dim=4096)
    if data["triton"] != triton.__version__:
        assert entries == []
        return
    assert len(entries) == len(data["kernels"]) > 100
    assert all(e["module"].startswith("dsv4.ops.") for e in entries)
    assert pc.load_manifest(pc.SHIPPED_MANIFEST, 90, dim=64) == []   # a tiny model: not used


def test_shipped_manifest_matches_the_kernels_arguments() -> None:
    """Every shipped entry names its kernel's current arguments, and its specialized indices
    fall on them: a kernel that gains or loses an argument (as the attention merge and the
    expert kernels did in the twenty-seventh session) needs its entries re-recorded, else its
    precompiled binaries are keys no launch looks up."""
    pytest.importorskip("triton")
    import importlib

    from dsv4.ops import precompile as pc

    data = json.loads(pc.SHIPPED_MANIFEST.read_text())
    stale = []
    for e in data["kernels"]:
        try:
            pc._source(e, 90)      # rejects an entry whose kernel's arguments changed
        except ValueError as err:
            stale.append(str(err))
            continue
        names = list(getattr(importlib.import_module(e["module"]), e["qualname"]).arg_names)
        spec = e["spec"]
        if any(k[0] >= len(names) for k in spec["attrs_keys"] + spec["constant_keys"]):
            stale.append(f"{e['qualname']}: an argument index past its arguments")
        elif any(spec["signature"][names[k[0]]] != "constexpr" and v is None
                 for k, v in zip(spec["constant_keys"], spec["constant_vals"])):
            stale.append(f"{e['qualname']}: a None constant on a typed argument")
    assert not stale, "re-record dsv4/ops/kernels_sm90.json (DSV4_RECORD_KERNELS):\n" + \
        "\n".join(sorted(set(stale))[:20])


def test_a_hung_worker_is_stopped_at_the_timeout() -> None:
    import threading
    import time

    from dsv4.ops import precompile as pc

    job = pc.Precompile(timeout=0.5)
    job.workers.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                        stdout=subprocess.PIPE, text=True))
    job._thread = threading.Thread(target=job._collect, daemon=True)
    job._thread.start()
    t0 = time.perf_counter()
    stats = job.wait()
    assert stats["timed_out"] and stats["compiled"] == 0
    assert time.perf_counter() - t0 < 30
    assert job.workers[0].poll() is not None     # killed, not left running


def test_engine_option_precompile_is_checked() -> None:
    from dsv4.engine.llm_engine import EngineOptions

    assert EngineOptions().precompile is None
    assert EngineOptions(precompile=False).precompile is False
    with pytest.raises(ValueError, match="precompile"):
        EngineOptions(precompile="yes")


def test_nothing_in_the_job_fails_the_caller(monkeypatch) -> None:
    pytest.importorskip("triton")
    from dsv4.ops import precompile as pc

    stale = {"module": "dsv4.ops.no_such_module", "qualname": "_k", "spec": {}}
    assert pc.Precompile(entries=[stale]).start().wait()["kernels"] == 0   # skipped

    def broken(entries, arch):
        raise RuntimeError("disk cache unreadable")

    monkeypatch.setattr(pc, "missing", broken)
    stats = pc.Precompile(entries=[stale]).start().wait()
    assert stats["kernels"] == 0 and stats["workers"] == 0


def test_cancel_kills_the_workers() -> None:
    import threading

    from dsv4.ops import precompile as pc

    job = pc.Precompile()
    job.workers.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                        stdout=subprocess.PIPE, text=True))
    job._thread = threading.Thread(target=job._collect, daemon=True)
    job._thread.start()
    job.cancel()
    stats = job.wait()
    assert job.cancelled and stats["compiled"] == 0 and not stats["timed_out"]
    assert job.workers[0].poll() is not None
