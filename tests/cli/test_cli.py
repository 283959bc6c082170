"""The ``dsv4`` command line: generate on the tiny checkpoint, clear errors, help."""

from __future__ import annotations

import json

import pytest

from dsv4.cli import main


def test_generate_streams_and_reports(capsys):
    assert main(["generate", "Hello", "--max-tokens", "5", "--device", "cpu",
                 "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Hello")
    assert "5 tokens in" in err and "tokens/s" in err


def test_generate_json_is_greedy_and_reproducible(capsys):
    args = ["generate", "--prompt", "abc", "--max-tokens", "4", "--json", "--device", "cpu",
            "--dtype", "float32"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) == 4
    assert first["finish_reason"] == "length"


@pytest.mark.parametrize("make", ["missing", "no_config", "bad_config"])
def test_bad_model_dir_is_a_message_not_a_traceback(tmp_path, capsys, make):
    path = tmp_path / "model"
    if make != "missing":
        path.mkdir()
    if make == "bad_config":
        (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["generate", "--model", str(path), "x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4: error:") and "Traceback" not in err


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("generate", "serve", "make-tiny"):
        assert cmd in out


def test_engine_flags_reach_the_engine_options():
    """The serving flags map onto EngineOptions (unset ones keep the engine's defaults)."""
    from dsv4.cli import build_parser, engine_kwargs
    from dsv4.engine.llm_engine import EngineOptions

    args = build_parser().parse_args(
        ["generate", "--enforce-eager", "--cuda-graph-capture", "lazy",
         "--gpu-memory-utilization", "0.8", "--cuda-graph-max-batch", "16", "hi"])
    kw = engine_kwargs(args)
    assert kw["enforce_eager"] is True and kw["cuda_graph_capture"] == "lazy"
    assert kw["gpu_memory_utilization"] == 0.8 and kw["cuda_graph_max_batch"] == 16
    assert "cuda_graphs_under_tp" not in kw and "pipeline_decode" not in kw
    opts = EngineOptions(**kw)
    assert "moe_fp8_codes" not in kw
    kept = engine_kwargs(build_parser().parse_args(["generate", "--moe-fp8-codes", "hi"]))
    assert kept["moe_fp8_codes"] is True and EngineOptions(**kept).moe_fp8_codes is True
    off = engine_kwargs(build_parser().parse_args(["generate", "--no-pipeline-decode", "hi"]))
    assert off["pipeline_decode"] is False and EngineOptions(**off).pipeline_decode is False
    cold = engine_kwargs(build_parser().parse_args(["generate", "--no-precompile",
                                                    "--no-warmup", "hi"]))
    assert cold["precompile"] is False and cold["warmup"] is False
    assert EngineOptions(**cold).precompile is False
    assert opts.enforce_eager and opts.cuda_graph_capture == "lazy"
    assert "enforce_eager" not in engine_kwargs(build_parser().parse_args(["generate", "hi"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--cuda-graph-capture", "never", "hi"])
