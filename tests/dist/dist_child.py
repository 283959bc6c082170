"""One rank of the tensor / expert parallel tests, launched by ``torchrun --nproc-per-node 2``.

For each ``variant:mode`` argument (mode ``tp`` or ``ep``) every rank builds an ``LLM`` with
``tensor_parallel_size=WORLD_SIZE``; rank 0 generates the prompts of ``prompts.json`` and writes
``<variant>-<mode>.json`` (tokens, logprobs, prompt logprobs) into the output directory, then
shuts the workers down.  The first LLM creates the process group (as under a plain torchrun
launch); the later ones reuse it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def _outputs(outs: list) -> list[dict]:
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append({
            "token_ids": list(c.token_ids),
            "logprobs": [{str(t): lp.logprob for t, lp in pos.items()} for pos in c.logprobs],
            "prompt_logprobs": [None if pos is None else {str(t): lp.logprob
                                                          for t, lp in pos.items()}
                                for pos in (o.prompt_logprobs or [])],
        })
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--paths", required=True, help="JSON {variant: checkpoint dir}")
    ap.add_argument("runs", nargs="+", help="variant:mode, mode tp, ep, tppg, eppg or tpwu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MKL_CBWR", "AVX2")

    from dsv4.engine.llm import LLM
    from dsv4.engine.sampling_params import SamplingParams

    paths = json.loads(args.paths)
    with open(os.path.join(args.out, "prompts.json"), encoding="utf-8") as f:
        spec = json.load(f)
    world = int(os.environ["WORLD_SIZE"])
    for run in args.runs:
        variant, mode = run.split(":")
        if variant == "cli":
            _cli(paths[mode], args.out)
            continue
        # Modes tppg / eppg: the same with prefill_graphs (its segments run eagerly on CPUs);
        # tpwu: with the start-up warm-up (the driver runs it in its constructor).
        llm = LLM(paths[variant], tensor_parallel_size=world,
                  expert_parallel=mode.startswith("ep"), prefill_graphs=mode.endswith("pg"),
                  warmup=mode.endswith("wu"), device="cpu", dtype=torch.float32,
                  **spec["engine"])
        if mode.endswith("pg"):
            assert llm.engine.runner.prefill_graphs is not None
        if mode.endswith("wu") and llm.is_driver:
            stats = llm.engine.warmup_stats
            assert stats is not None and stats["requests"] > 0 and not stats["aborted"], stats
        if llm.is_driver:
            params = [SamplingParams(**p) for p in spec["params"]]
            outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params,
                                use_tqdm=False)
            llm.engine.check_idle()
            with open(os.path.join(args.out, f"{variant}-{mode}.json"), "w",
                      encoding="utf-8") as f:
                json.dump({"outputs": _outputs(outs), "shapes": _shapes(llm)}, f)
            llm.shutdown()
        else:
            # The constructor ran rank 0's steps and returned at its shutdown.
            with pytest_free_raises(RuntimeError):
                llm.generate([[5, 6, 7]], use_tqdm=False)
    _collectives(args.out)
    return 0


def _collectives(out_dir: str) -> None:
    """The Parallel helpers over the launch's process group (left by the engines)."""
    import torch.distributed as dist

    from dsv4.dist.parallel import Parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    par = Parallel(rank, world, rank, group=dist.group.WORLD, control_group=dist.group.WORLD)
    got = {"all_gather": par.all_gather(torch.tensor([[rank, 10.0]]), dim=1).tolist(),
           "all_reduce": par.all_reduce(torch.tensor([rank + 1.0])).tolist(),
           "min_int": par.min_int(5 - rank),
           "broadcast": par.broadcast_object({"from": rank})}
    if rank == 0:
        with open(os.path.join(out_dir, "collectives.json"), "w", encoding="utf-8") as f:
            json.dump(got, f)


def _shapes(llm: object) -> dict[str, int]:
    """What this rank holds of layer 0: heads, experts, expert intermediate dim."""
    engine = llm.engine  # type: ignore[attr-defined]
    cfg, layer = engine.config, engine.model.layers[0]
    w1 = layer.ffn.experts.w1
    return {"heads": cfg.n_heads, "local_heads": int(layer.attn.attn_sink.shape[0]),
            "experts": cfg.n_routed_experts, "local_experts": int(w1.shape[0]),
            "spread": int(layer.ffn.experts.weights().spread),
            "inter": cfg.moe_inter_dim, "local_inter": int(w1.shape[1])}


def _cli(path: str, out_dir: str) -> None:
    """``dsv4 generate --json -tp WORLD_SIZE`` on every rank; rank 0's stdout to cli.out."""
    import contextlib

    from dsv4.cli import main as cli_main

    argv = ["generate", "--model", path, "--device", "cpu", "--dtype", "float32", "--json",
            "--max-tokens", "5", "--tensor-parallel-size", os.environ["WORLD_SIZE"]]
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(out_dir, "cli.out"), "w", encoding="utf-8") as f:
            with contextlib.redirect_stdout(f):
                rc = cli_main(argv)
    else:
        rc = cli_main(argv)
    if rc != 0:
        raise SystemExit(f"dsv4 generate returned {rc}")


class pytest_free_raises:
    """``with pytest_free_raises(E):`` fails unless the block raises E (no pytest here)."""

    def __init__(self, exc: type[BaseException]) -> None:
        self.exc = exc

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type | None, ev: BaseException | None, tb: object) -> bool:
        if et is None:
            raise AssertionError(f"expected {self.exc.__name__}")
        return issubclass(et, self.exc)


if __name__ == "__main__":
    sys.exit(main())
