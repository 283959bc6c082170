"""``dsv4 serve``: the OpenAI-compatible server on a checkpoint (default: the tiny one)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

log = logging.getLogger("dsv4.server")

TINY_MODEL_NAME = "dsv4-tiny"


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine options and the server options of ``dsv4 serve`` to ``parser``."""
    from dsv4.cli import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--api-key", default=os.environ.get("DSV4_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $DSV4_API_KEY)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: --model, or dsv4-tiny)")
    parser.add_argument("--default-thinking", action="store_true",
                        help="chat requests that do not say use thinking mode")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                        help="seconds to let running requests finish after SIGTERM")


def default_model_path() -> str:
    """The embedded tiny checkpoint (generated once into a cache directory if needed)."""
    import dsv4.tiny as tiny

    if hasattr(tiny, "default_checkpoint"):
        return tiny.default_checkpoint()
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                         "dsv4", "tiny-v4")
    if not os.path.isdir(cache):
        import tempfile

        os.makedirs(os.path.dirname(cache), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".tiny-v4-", dir=os.path.dirname(cache))
        tiny.make_tiny_checkpoint(staging, variant="v4")
        try:
            os.rename(staging, cache)  # atomic: never a half-written checkpoint in the cache
        except OSError:  # another process won the race
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
    return cache


def build_server(args: argparse.Namespace, engine: Any | None = None) -> Any:
    """The FastAPI app for ``args`` (loads the engine unless one is given)."""
    from dsv4.cli import engine_kwargs
    from dsv4.server.app import build_app
    from dsv4.server.async_engine import AsyncEngine

    if engine is None:
        from dsv4.engine.llm_engine import LLMEngine

        path = args.model or default_model_path()
        log.info("loading %s", path)
        engine = LLMEngine(path, **engine_kwargs(args))
    name = args.served_model_name or args.model or TINY_MODEL_NAME
    return build_app(AsyncEngine(engine), model_name=name, api_key=args.api_key,
                     default_thinking=args.default_thinking)


def run_serve(args: argparse.Namespace) -> int:
    """Load the model and serve until SIGINT / SIGTERM (uvicorn drains, then the engine stops)."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port: expected 1-65535, found {args.port}")
    from dsv4.cli import engine_kwargs
    from dsv4.engine.llm_engine import LLMEngine

    path = args.model or default_model_path()
    log.info("loading %s", path)
    engine = LLMEngine(path, **engine_kwargs(args))
    if not engine.is_driver:
        # Tensor parallel ranks > 0 (torchrun): run rank 0's steps until it shuts down.
        engine.run_worker()
        return 0
    try:
        app = build_server(args, engine)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=args.graceful_shutdown_timeout)
    finally:
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m dsv4.server``: the same as ``dsv4 serve``."""
    parser = argparse.ArgumentParser(prog="python -m dsv4.server", description=__doc__)
    add_serve_args(parser)
    return run_serve(parser.parse_args(argv))
