"""Tensor parallel (TP=2) and TP=2 + expert parallel on CPU with gloo, two processes launched
by torchrun: the same greedy tokens and logprobs (to fp32 rounding) as one process, on the tiny
V4 and V4.1 checkpoints; plus ``dsv4 generate --tensor-parallel-size 2``."""

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
RUNS = ("v4:tp", "v4:ep", "v41:tp", "v41:ep")
# Small chunks: prompts span several steps, some steps sample nothing (partial prefill chunks).
ENGINE = {"max_model_len": 256, "max_num_batched_tokens": 32, "max_num_seqs": 4}
LOGPROB_TOL = 1e-4


def _spec() -> dict:
    g = torch.Generator().manual_seed(7)
    # 140 tokens cross a 128-token compression group of the V4 HCA layers.
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 37, 140)]
    params = [{"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 2},
              {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, "logprobs": 1,
               "prompt_logprobs": 1},
              {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True, "logprobs": 2}]
    return {"prompts": prompts, "params": params, "engine": ENGINE}


def _single_process(path: str, spec: dict) -> list[dict]:
    sys.path.insert(0, HERE)
    try:
        from dist_child import _outputs
    finally:
        sys.path.remove(HERE)
    from dsv4.engine.llm import LLM
    from dsv4.engine.sampling_params import SamplingParams

    llm = LLM(path, device="cpu", dtype=torch.float32, **spec["engine"])
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]],
                        [SamplingParams(**p) for p in spec["params"]], use_tqdm=False)
    return json.loads(json.dumps(_outputs(outs)))


def _torchrun(out_dir: str, paths: dict[str, str], runs: tuple[str, ...]) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", os.path.join(HERE, "dist_child.py"), "--out", out_dir, "--paths",
           json.dumps(paths), *runs]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the two ranks it started
        log, _ = proc.communicate()
        pytest.fail(f"torchrun timed out; output:\n{log[-4000:]}")
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{log[-6000:]}"


def _compare(got: list[dict], want: list[dict], what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["token_ids"] == w["token_ids"], f"{what}: prompt {i} tokens differ"
        for kind in ("logprobs", "prompt_logprobs"):
            assert len(g[kind]) == len(w[kind]), f"{what}: prompt {i} {kind} lengths differ"
            for pos, (gp, wp) in enumerate(zip(g[kind], w[kind])):
                if wp is None:
                    assert gp is None
                    continue
                assert set(gp) == set(wp), f"{what}: prompt {i} {kind}[{pos}] token sets differ"
                for tok, lp in wp.items():
                    assert abs(gp[tok] - lp) <= LOGPROB_TOL, (
                        f"{what}: prompt {i} {kind}[{pos}] token {tok}: {gp[tok]} vs {lp}")


def test_tp_and_ep_match_one_process(tiny_paths: dict[str, str], tmp_path) -> None:
    spec = _spec()
    (tmp_path / "prompts.json").write_text(json.dumps(spec))
    _torchrun(str(tmp_path), tiny_paths, RUNS + ("cli:v4",))
    for variant in ("v4", "v41"):
        want = _single_process(tiny_paths[variant], spec)
        assert any(len(w["token_ids"]) for w in want)
        for mode in ("tp", "ep"):
            result = json.loads((tmp_path / f"{variant}-{mode}.json").read_text())
            meta = result["shapes"]
            # The ranks really held half of the heads and half of the MoE.
            assert meta["local_heads"] * 2 == meta["heads"], meta
            # The expert kernels' size choices count pairs over every rank's experts.
            assert meta["spread"] == meta["experts"], meta
            if mode == "ep":
                assert meta["local_experts"] * 2 == meta["experts"], meta
                assert meta["local_inter"] == meta["inter"], meta
            else:
                assert meta["local_experts"] == meta["experts"], meta
                assert meta["local_inter"] * 2 == meta["inter"], meta
            _compare(result["outputs"], want, f"{variant} {mode}")
    world = 2
    assert json.loads((tmp_path / "collectives.json").read_text()) == {
        "all_gather": [[0.0, 10.0, 1.0, 10.0]], "all_reduce": [world * (world + 1) / 2],
        "min_int": 5 - (world - 1), "broadcast": {"from": 0}}
    cli = [json.loads(line) for line in (tmp_path / "cli.out").read_text().splitlines()
           if line.startswith("{")]
    assert [c["prompt"] for c in cli] == ["The quick brown fox"]
    from dsv4.engine.llm import LLM
    from dsv4.engine.sampling_params import SamplingParams

    ref = LLM(tiny_paths["v4"], device="cpu", dtype=torch.float32).generate(
        "The quick brown fox", SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert cli[0]["token_ids"] == list(ref[0].outputs[0].token_ids)


def test_tp_and_ep_with_prefill_graphs(tiny_paths: dict[str, str], tmp_path) -> None:
    """The engine option ``prefill_graphs`` under TP=2 and TP=2 + EP, V4 and V4.1 (the
    piecewise segments, their all-reduces inside, run eagerly on CPUs), and TP=2 with the
    start-up warm-up (the driver's constructor runs steps the workers follow once they reach
    their loop): one process's tokens and logprobs."""
    spec = _spec()
    (tmp_path / "prompts.json").write_text(json.dumps(spec))
    runs = (("v4", "tppg"), ("v4", "eppg"), ("v41", "eppg"), ("v4", "tpwu"))
    _torchrun(str(tmp_path), tiny_paths, tuple(f"{v}:{m}" for v, m in runs))
    for variant, mode in runs:
        want = _single_process(tiny_paths[variant], spec)
        result = json.loads((tmp_path / f"{variant}-{mode}.json").read_text())
        assert result["shapes"]["local_heads"] * 2 == result["shapes"]["heads"]
        _compare(result["outputs"], want, f"{variant} {mode}")


def test_tensor_parallel_needs_a_launch(tiny_paths: dict[str, str], monkeypatch) -> None:
    from dsv4.engine.llm import LLM

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="needs a launch with 2 processes"):
        LLM(tiny_paths["v4"], tensor_parallel_size=2, device="cpu")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 but the launch has WORLD_SIZE=4"):
        LLM(tiny_paths["v4"], tensor_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple of 3"):
        LLM(tiny_paths["v4"], tensor_parallel_size=3, device="cpu")
