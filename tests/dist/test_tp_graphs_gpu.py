"""CUDA graphs under tensor / expert parallelism on two GPUs (skipped unless two CUDA devices are
present): ``cuda_graphs_under_tp`` captures and replays the same decode graphs (NCCL all-reduces
inside) on both ranks and gives the tokens of the same static-shape steps run eagerly; and
``bench/tp_bench.py`` at toy widths runs end to end with graphs (NCCL, Triton kernels)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from test_tp_static_decode import HERE, ROOT, torchrun

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.parametrize("ep", [False, True])
def test_graphs_under_tp_match_static_eager(tiny_paths: dict[str, str], tmp_path,
                                            ep: bool) -> None:
    tag = "v4ep" if ep else "v4"
    torchrun(os.path.join(HERE, "static_child.py"),
             ["--out", str(tmp_path), "--path", tiny_paths["v4"], "--device", "cuda", "--tag",
              tag, "graphs", "static"] + (["--ep"] if ep else []), timeout=600)

    def load(mode: str, rank: int) -> dict:
        return json.loads((tmp_path / f"{tag}-{mode}-rank{rank}.json").read_text())

    graphs, static = load("graphs", 0), load("static", 0)
    for rank in range(2):
        g = load("graphs", rank)
        assert g["disabled"] is None, g["disabled"]
        assert g["stats"]["replays"] > 0 and g["buckets"], g
    # Both ranks captured the same buckets and replayed them at the same steps.
    assert load("graphs", 0)["buckets"] == load("graphs", 1)["buckets"]
    assert load("graphs", 0)["stats"]["replays"] == load("graphs", 1)["stats"]["replays"]
    assert set(graphs["outputs"]) == set(static["outputs"])
    for rid, (tokens, lps) in static["outputs"].items():
        assert graphs["outputs"][rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(graphs["outputs"][rid][1], lps)) <= 1e-3, rid


@pytest.mark.parametrize("ep", [False, True])
def test_pipelined_graphs_under_tp(tiny_paths: dict[str, str], tmp_path, ep: bool) -> None:
    """Pipelined decode over the graphs (the default): the greedy tokens of the same static
    steps run eagerly, unpipelined."""
    tag = "v4ep" if ep else "v4"
    torchrun(os.path.join(HERE, "static_child.py"),
             ["--out", str(tmp_path), "--path", tiny_paths["v4"], "--device", "cuda", "--tag",
              tag, "graphspipe", "static"] + (["--ep"] if ep else []), timeout=600)
    got = json.loads((tmp_path / f"{tag}-graphspipe-rank0.json").read_text())
    want = json.loads((tmp_path / f"{tag}-static-rank0.json").read_text())
    assert got["disabled"] is None and got["pipelined"] > 0
    assert {r: t for r, (t, _) in got["outputs"].items()} == {
        r: t for r, (t, _) in want["outputs"].items()}


@pytest.mark.parametrize("ep", [False, True])
def test_prefill_graphs_under_tp(tiny_paths: dict[str, str], tmp_path, ep: bool) -> None:
    """Prefill graphs replayed on both ranks (NCCL all-reduces inside): the tokens and
    logprobs of the same segments run eagerly (same kernels and shapes)."""
    tag = "v4ep" if ep else "v4"
    torchrun(os.path.join(HERE, "static_child.py"),
             ["--out", str(tmp_path), "--path", tiny_paths["v4"], "--device", "cuda", "--tag",
              tag, "pggraphs", "pgeager"] + (["--ep"] if ep else []), timeout=600)
    got = json.loads((tmp_path / f"{tag}-pggraphs-rank0.json").read_text())
    want = json.loads((tmp_path / f"{tag}-pgeager-rank0.json").read_text())
    worker = json.loads((tmp_path / f"{tag}-pggraphs-rank1.json").read_text())
    assert got["disabled"] is None and worker["disabled"] is None
    assert got["prefill_stats"]["steps"] == worker["prefill_stats"]["steps"] > 0
    assert got["outputs"] == want["outputs"]


def test_tp_bench_tiny_on_two_gpus_with_graphs(tmp_path) -> None:
    out = tmp_path / "tp.json"
    torchrun(os.path.join(ROOT, "bench", "tp_bench.py"),
             ["--tiny", "--device", "cuda", "--graphs", "--ep", "--out", str(out)], timeout=600)
    r = json.loads(out.read_text())
    assert not r["errors"], r["errors"]
    assert [w["concurrency"] for w in r["workloads"]] == [1, 4]
    assert r["graph_stats"]["replays"] > 0 and r["graphs_disabled_reason"] is None
    for w in r["workloads"]:
        assert not w["partial"] and w["tpot_median_s"] > 0
