"""Static-shape decode steps (the CUDA-graph path, run eagerly on CPUs) under tensor parallelism
(V4) and expert parallelism (V4.1), two processes with gloo: the driver marks its decode steps
static, the worker takes the same static-shape path at the same steps (same counters), and the
greedy tokens equal one process with static decode (logprobs to fp32 rounding)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LOGPROB_TOL = 1e-4


def torchrun(script: str, args: list[str], timeout: float = 240) -> str:
    """Run ``script`` on two ranks (``torchrun --standalone``); its output, or a test failure."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", script, *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the two ranks it started
        log, _ = proc.communicate()
        pytest.fail(f"torchrun timed out; output:\n{log[-4000:]}")
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{log[-6000:]}"
    return log


def _one_process(path: str, ep: bool) -> tuple[dict, dict]:
    sys.path.insert(0, HERE)
    try:
        import static_child
    finally:
        sys.path.remove(HERE)
    eng = static_child.engine(path, "cpu", "static", ep, 1)
    return static_child.workload(eng), static_child.stats(eng)


def _compare(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for rid, (tokens, lps) in want.items():
        assert got[rid][0] == tokens, f"{what}: {rid} tokens differ"
        for a, b in zip(got[rid][1], lps):
            assert abs(a - b) <= LOGPROB_TOL, f"{what}: {rid} logprob {a} vs {b}"


@pytest.mark.parametrize("variant,ep", [("v4", False), ("v41", True)])
def test_static_decode_under_parallelism_matches_one_process(tiny_paths: dict[str, str],
                                                             tmp_path, variant: str,
                                                             ep: bool) -> None:
    path = tiny_paths[variant]
    torchrun(os.path.join(HERE, "static_child.py"),
             ["--out", str(tmp_path), "--path", path, "--tag", variant, "static"]
             + (["--ep"] if ep else []))
    driver = json.loads((tmp_path / f"{variant}-static-rank0.json").read_text())
    worker = json.loads((tmp_path / f"{variant}-static-rank1.json").read_text())
    want, want_stats = _one_process(path, ep)
    _compare(driver["outputs"], want, f"{variant} static TP")
    # Both ranks ran the same static steps (padding rows included), none as a graph (the
    # host-time fields, *_s, differ: only the driver fills the buffers).
    d, w = ({k: v for k, v in r["stats"].items() if not k.endswith("_s")}
            for r in (driver, worker))
    assert d["eager_static_steps"] > 0
    assert d == w, (d, w)
    assert d["replays"] == 0 and not driver["disabled"] and not worker["disabled"]
    # ... and exactly the static steps one process runs for the same workload.
    assert d["eager_static_steps"] == want_stats["stats"]["eager_static_steps"]
    assert d["padded_rows"] == want_stats["stats"]["padded_rows"] > 0
    assert worker["steps"] > d["eager_static_steps"]  # plus the dynamic prefill steps


@pytest.mark.parametrize("variant,ep", [("v4", False), ("v41", True)])
def test_pipelined_static_decode_under_parallelism(tiny_paths: dict[str, str], tmp_path,
                                                   variant: str, ep: bool) -> None:
    """Pipelined decode (the next step launched before the samples reach the host; its input
    tokens reach the worker in the broadcast buffers): the greedy tokens of one process."""
    path = tiny_paths[variant]
    torchrun(os.path.join(HERE, "static_child.py"),
             ["--out", str(tmp_path), "--path", path, "--tag", variant, "pipeline"]
             + (["--ep"] if ep else []))
    driver = json.loads((tmp_path / f"{variant}-pipeline-rank0.json").read_text())
    want, _ = _one_process(path, ep)
    assert {r: t for r, (t, _) in driver["outputs"].items()} == {
        r: t for r, (t, _) in want.items()}
    assert driver["pipelined"] > 0


@pytest.mark.parametrize("mode", ["failcapture", "failstartup"])
def test_a_capture_failing_on_one_rank_turns_graphs_off_on_every_rank(
        tiny_paths: dict[str, str], tmp_path, mode: str) -> None:
    """On the first decode step of a bucket (lazy) or at engine start (capture_graphs)."""
    path = tiny_paths["v4"]
    torchrun(os.path.join(HERE, "static_child.py"),
             ["--out", str(tmp_path), "--path", path, "--tag", "v4", mode])
    driver = json.loads((tmp_path / f"v4-{mode}-rank0.json").read_text())
    worker = json.loads((tmp_path / f"v4-{mode}-rank1.json").read_text())
    assert "another rank" in driver["disabled"], driver["disabled"]
    assert "capture failure on rank 1" in worker["disabled"], worker["disabled"]
    assert driver["stats"] is None and worker["stats"] is None
    want, _ = _one_process(path, False)
    _compare(driver["outputs"], want, "v4 after a failed capture")


def test_a_prefill_capture_failing_on_one_rank_turns_them_off_on_every_rank(
        tiny_paths: dict[str, str], tmp_path) -> None:
    """Prefill graphs under TP (a pretend capture that fails on rank 1 only): every rank turns
    them off at the same step (no hang) and the steps run eagerly, with one process's tokens."""
    path = tiny_paths["v4"]
    torchrun(os.path.join(HERE, "static_child.py"),
             ["--out", str(tmp_path), "--path", path, "--tag", "v4", "pgfail"])
    driver = json.loads((tmp_path / f"v4-pgfail-rank0.json").read_text())
    worker = json.loads((tmp_path / f"v4-pgfail-rank1.json").read_text())
    assert "another rank" in driver["disabled"], driver["disabled"]
    assert "prefill capture failure on rank 1" in worker["disabled"], worker["disabled"]
    assert driver["prefill_stats"] is None and worker["prefill_stats"] is None
    want, _ = _one_process(path, False)
    _compare(driver["outputs"], want, "v4 after a failed prefill capture")


def test_static_plan_on_a_worker_without_graphs_is_an_error() -> None:
    from dsv4.dist.parallel import Parallel
    from dsv4.engine.runner import ModelRunner
    from dsv4.tiny import default_checkpoint
    from dsv4.config import ModelConfig

    cfg = ModelConfig.from_file(default_checkpoint())
    runner = ModelRunner(None, cfg, device=torch.device("cpu"), cache_dtype=torch.float32,
                         num_pages=2, num_slots=2, page_size=256,
                         parallel=Parallel(1, 2, 1), max_model_len=256, static_decode=False)
    with pytest.raises(ValueError, match="every rank needs the same engine options"):
        runner.run_worker_static([1, 1, 0])   # bucket 1, one row, no reset slots


def test_engine_options_of_graphs_under_tp() -> None:
    from dsv4.engine.llm_engine import EngineOptions

    assert EngineOptions().cuda_graphs_under_tp is True  # verified on two H200s
    with pytest.raises(ValueError, match="cuda_graphs_under_tp='yes' is invalid"):
        EngineOptions(cuda_graphs_under_tp="yes")
    with pytest.raises(ValueError, match="model_factory must be a callable"):
        EngineOptions(model_factory=lambda *a: None, model=object())
    with pytest.raises(ValueError, match="model_factory must be a callable"):
        EngineOptions(model_factory=3)
