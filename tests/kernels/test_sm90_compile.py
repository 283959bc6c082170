"""Every Triton kernel launch of the dsv4 ops compiles for the H200 (sm_90), checked offline.

The scenarios of ``sm90_cases.py`` (see its docstring for how to add one) are recorded and
compiled in child processes without ``TRITON_INTERPRET`` (the kernels branch on it), split over
the CPU cores; each scenario is one test, failing with the kernel, its constexprs and options and
the compiler's error.  The canaries check the machinery itself: a kernel whose constexpr branches
return different dtypes must be rejected, the same kernel with one return type must compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import sm90_cases  # stdlib only at import: no torch / triton in this process

# Compile shards run in parallel, one per core (two on the CI machine).
_SHARDS = max(1, min(int(os.environ.get("DSV4_SM90_JOBS", "0")) or (os.cpu_count() or 1), 8))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Record every scenario and compile its launches (once per module, in child processes)."""
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["CUDA_VISIBLE_DEVICES"] = ""       # compile only; never touch a GPU
    env.setdefault("OMP_NUM_THREADS", "1")
    out = tmp_path_factory.mktemp("sm90")
    procs = []
    for i in range(_SHARDS):
        path = out / f"shard{i}.json"
        cmd = [sys.executable, str(HERE / "sm90_cases.py"), "--canaries",
               f"--shard={i}/{_SHARDS}", f"--out={path}"]
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True), path))
    merged: dict[str, Any] = {}
    for proc, path in procs:
        log, _ = proc.communicate(timeout=900)
        if proc.returncode != 0 or not path.exists():
            pytest.fail(f"sm90 compile child failed (rc={proc.returncode}):\n{log[-6000:]}")
        shard = json.loads(path.read_text())
        if not merged:
            merged = shard
            continue
        for key, entry in shard["launches"].items():
            if "seconds" in entry:     # the shard that compiled this launch has the verdict
                merged["launches"][key] = entry
    if merged["toolchain"]:
        pytest.skip(f"cannot compile for sm_90 here: {merged['toolchain']}")
    return merged


def _failures(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    if name in results["record_errors"]:
        pytest.fail(f"scenario {name} failed before any compile:\n{results['record_errors'][name]}")
    keys = results["scenarios"][name]
    assert keys, f"scenario {name} launched no kernel: it tests nothing"
    entries = [results["launches"][k] for k in keys]
    missing = [e["config"] for e in entries if "seconds" not in e]
    assert not missing, f"launches recorded but never compiled: {missing}"
    return [e for e in entries if e["error"]]


@pytest.mark.parametrize("name", list(sm90_cases.SCENARIOS))
def test_sm90_compile(results: dict[str, Any], name: str) -> None:
    """Every launch of scenario ``name`` compiles to a cubin for sm_90."""
    failed = _failures(results, name)
    reasons = {}
    unknown = []
    for e in failed:
        hits = [k for k in sm90_cases.KNOWN_FAILURES if k.covers(name, e["config"])]
        if hits:
            reasons[hits[0].reason] = None
        else:
            unknown.append(e)
    report = "\n\n".join(f"{e['config']}\n  -> {e['error']}" for e in unknown)
    assert not unknown, f"{len(unknown)} launch(es) of {name} do not compile for sm_90:\n{report}"
    if reasons:
        pytest.xfail("; ".join(reasons))


def test_sm90_known_failures_still_fail(results: dict[str, Any]) -> None:
    """A KNOWN_FAILURES entry that no longer matches a failing launch is stale: remove it."""
    stale = []
    for known in sm90_cases.KNOWN_FAILURES:
        if known.scenario not in results["scenarios"]:
            stale.append((known, "no such scenario"))
            continue
        entries = [results["launches"][k] for k in results["scenarios"][known.scenario]]
        if not any(e["error"] and known.covers(known.scenario, e["config"]) for e in entries):
            stale.append((known, "its launches compile now"))
    assert not stale, f"stale entries in sm90_cases.KNOWN_FAILURES: {stale}"


def test_sm90_canary_mixed_return_dtypes_is_rejected(results: dict[str, Any]) -> None:
    """The machinery catches what the interpreter let through: a helper returning bf16 from one
    constexpr branch and fp32 from another fails to compile; one return type compiles."""
    bad = _failures(results, "canary/mixed_return_dtypes")
    assert len(bad) == 1 and "canary_mixed_return_kernel" in bad[0]["config"], bad
    assert "AS_F32=True" in bad[0]["config"]
    assert not _failures(results, "canary/single_return_dtype")


def test_sm90_scenarios_cover_every_ops_kernel(results: dict[str, Any]) -> None:
    """Each @triton.jit kernel (a function with a grid launch) of dsv4.ops is compiled by at
    least one scenario, so a new kernel without a case fails here, by name."""
    import ast

    launched = {e["kernel"] for e in results["launches"].values()}
    ops_dir = REPO / "dsv4" / "ops"
    kernels = set()
    for path in sorted(ops_dir.glob("triton_*.py")):
        tree = ast.parse(path.read_text())
        jitted = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)
                  and any("jit" in ast.unparse(d) for d in f.decorator_list)}
        # A launch is `name[grid](...)`: a subscript of a jitted name that is then called.
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in jitted):
                kernels.add(node.func.value.id)
    assert kernels, "found no kernel launches in dsv4/ops: the scan is broken"
    missing = sorted(kernels - launched)
    assert not missing, (f"kernels launched in dsv4/ops without an sm_90 compile case: {missing}; "
                         "add a scenario in tests/kernels/sm90_cases.py")
