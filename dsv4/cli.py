"""The ``dsv4`` command line: generate, serve, make-tiny."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by ``generate`` and ``serve``."""
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: the embedded tiny checkpoint)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default per device)")
    p.add_argument("--numerics", default="bf16", choices=["bf16", "official"],
                   help="official: DeepSeek's run-time fake quantization")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="processes (one GPU each) sharing the model; launch with torchrun "
                        "--nproc-per-node N (default 1)")
    p.add_argument("--enable-expert-parallel", dest="expert_parallel", action="store_true",
                   help="split the routed experts by expert over the ranks instead of each "
                        "expert's intermediate dim (default off)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of the GPU memory the engine may use; the KV cache gets what "
                        "the weights, activations and graphs leave (default 0.9)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no CUDA graphs (default: decode replays CUDA graphs on a GPU)")
    p.add_argument("--cuda-graph-max-batch", type=int, default=None,
                   help="largest decode batch run as a CUDA graph (default: --max-num-seqs)")
    p.add_argument("--cuda-graph-capture", default=None, choices=["startup", "lazy"],
                   help="capture the decode graphs at start (default) or on first use")
    p.add_argument("--cuda-graphs-under-tp", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA graphs also with --tensor-parallel-size > 1 (default on)")
    p.add_argument("--moe-fp8-codes", action=argparse.BooleanOptionalAction, default=None,
                   help="keep an FP8 re-encoding of the MXFP4 experts on the GPU: faster large "
                        "prefill steps for about twice the experts' MXFP4 bytes (default off)")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="run prefill and mixed steps of up to 1,024 tokens as piecewise CUDA "
                        "graphs (default on with CUDA graphs on one GPU)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run a few synthetic requests at start so that the first real ones do "
                        "not wait for Triton compiles (default on for one GPU)")
    p.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the kernels of the shipped kernel manifest that Triton's disk "
                        "cache lacks in parallel worker processes while the model loads "
                        "(default on for one GPU)")
    p.add_argument("--pipeline-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each decode step before the host has read the previous one's "
                        "tokens (default on with CUDA graphs)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options of ``args`` that were set."""
    names = ("device", "dtype", "numerics", "kv_cache_dtype", "max_num_seqs",
             "max_num_batched_tokens", "max_model_len", "seed", "tensor_parallel_size",
             "expert_parallel", "gpu_memory_utilization", "enforce_eager",
             "cuda_graph_max_batch", "cuda_graph_capture", "cuda_graphs_under_tp",
             "pipeline_decode", "moe_fp8_codes", "prefill_graphs", "warmup", "precompile")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _generate(args: argparse.Namespace) -> int:
    """Stream each continuation to the terminal, then report tokens/s."""
    from dsv4 import LLM

    if args.model is not None and not os.path.isdir(args.model):
        raise FileNotFoundError(f"--model {args.model!r} is not a directory")
    llm = LLM(model=args.model, **engine_kwargs(args))
    if not llm.is_driver:
        return 0  # a tensor parallel worker: rank 0 has finished and released it
    try:
        return _generate_on(llm, args)
    finally:
        llm.shutdown()


def _generate_on(llm: Any, args: argparse.Namespace) -> int:
    import time

    from dsv4 import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed)
    prompts = ([args.prompt_opt] if args.prompt_opt else []) + list(args.prompt)
    prompts = prompts or ["The quick brown fox"]
    for i, prompt in enumerate(prompts):
        if args.chat:
            from dsv4.chat.encoding import encode_messages

            prompt = encode_messages([{"role": "user", "content": prompt}],
                                     variant=engine.config.variant)
        request_id = f"cli-{i}"
        engine.add_request(request_id, prompt, params)
        start, shown, out = time.perf_counter(), 0, None
        if not args.json:
            print(prompts[i], end="", flush=True)
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
                if not args.json:
                    print(text[shown:], end="", flush=True)
                shown = len(text)
        elapsed = time.perf_counter() - start
        result = out.outputs[0]
        n = len(result.token_ids)
        if args.json:
            print(json.dumps({"prompt": prompts[i], "text": result.text,
                              "token_ids": list(result.token_ids),
                              "finish_reason": result.finish_reason,
                              "tokens_per_s": n / elapsed if elapsed > 0 else None}))
        else:
            print(f"\n[{n} tokens in {elapsed:.2f} s, {n / max(elapsed, 1e-9):.1f} tokens/s, "
                  f"finish: {result.finish_reason}]", file=sys.stderr)
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from dsv4.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(args.out, variant=args.variant, seed=args.seed)
    print(path)
    return 0


def _precompile(args: argparse.Namespace) -> int:
    """Compile a kernel manifest into Triton's disk cache (``TRITON_CACHE_DIR``) without a GPU,
    e.g. while building a container image, so that engines started from it find them."""
    import time

    from dsv4.ops import precompile

    manifest = args.manifest or precompile.SHIPPED_MANIFEST
    entries = precompile.load_manifest(manifest, args.arch, args.dim)
    if not entries:
        raise ValueError(f"the kernel manifest {manifest} holds nothing for sm_{args.arch}"
                         + (f" and hidden size {args.dim}" if args.dim else "")
                         + " with this Triton (see the log above)")
    t0 = time.perf_counter()
    stats = precompile.Precompile(entries=entries, arch=args.arch,
                                  max_workers=args.workers or precompile.default_workers(),
                                  timeout=args.timeout).start().wait()
    print(f"{stats['compiled']} of {stats['kernels']} kernels missing from the cache compiled "
          f"({len(entries)} in the manifest, {stats['failed']} failed) by {stats['workers']} "
          f"workers in {time.perf_counter() - t0:.1f} s")
    return 1 if stats["failed"] or stats["timed_out"] else 0


def _serve(args: argparse.Namespace) -> int:
    from dsv4.server.cli import run_serve

    return run_serve(args) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text offline")
    add_engine_args(g)
    g.add_argument("prompt", nargs="*", help="prompts (default: one example prompt)")
    g.add_argument("--prompt", dest="prompt_opt", default=None, help="a prompt (as TEXT)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    g.add_argument("--json", action="store_true", help="one JSON object per output")
    g.set_defaults(func=_generate)

    t = sub.add_parser("make-tiny", help="write a tiny random checkpoint in the official format")
    t.add_argument("out")
    t.add_argument("--variant", default="v4", choices=["v4", "v4-base", "v4-bf16", "v41"])
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_make_tiny)

    c = sub.add_parser("precompile", help="compile a kernel manifest into Triton's disk cache "
                       "(no GPU needed), e.g. when building a container image")
    c.add_argument("--manifest", default=None,
                   help="kernel manifest (default: the shipped dsv4/ops/kernels_sm90.json)")
    c.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (Hopper)")
    c.add_argument("--dim", type=int, default=None,
                   help="only if the manifest was recorded with this hidden size")
    c.add_argument("--workers", type=int, default=None,
                   help="worker processes (default: the CPUs less two)")
    c.add_argument("--timeout", type=float, default=3600.0, help="seconds")
    c.set_defaults(func=_precompile)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    try:
        from dsv4.server.cli import add_serve_args

        add_serve_args(s)
    except ImportError:  # server extras missing: fail only when `serve` is used
        add_engine_args(s)
    s.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"dsv4: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
