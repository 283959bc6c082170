"""Load test of ``dsv4 serve``: concurrent streaming chat clients on loopback.

Starts the server in a subprocess (the tiny checkpoint unless ``--model``), runs ``--rounds``
rounds of ``--clients`` concurrent streaming chat requests, and checks that every response is
well formed (HTTP 200, every event valid JSON, one finish_reason per choice, usage present and
consistent, ``data: [DONE]`` last) and that no cache page leaked (``/metrics`` after the load:
nothing running or waiting, cache usage 0, every page free).  Prints requests/s, output
tokens/s and TTFT / end-to-end latency percentiles.

    python bench/server_load.py [--clients 64] [--rounds 3] [--max-tokens 16] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx


@dataclass
class Result:
    ok: bool
    error: str
    ttft: float
    latency: float
    tokens: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


async def one_request(client: httpx.AsyncClient, url: str, k: int, max_tokens: int) -> Result:
    body = {"messages": [{"role": "user", "content": f"Client {k}: tell me about the sea."}],
            "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, "seed": k}
    start = time.perf_counter()
    ttft = None
    events: list[str] = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Result(False, f"HTTP {r.status_code}: {await r.aread()!r}", 0, 0, 0)
            async for line in r.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    return Result(False, f"not an SSE data line: {line!r}", 0, 0, 0)
                events.append(line[6:])
                if ttft is None and line != "data: [DONE]":
                    # the first chunk that carries generated text (not the role chunk)
                    chunk = json.loads(line[6:])
                    for ch in chunk.get("choices", ()):
                        d = ch.get("delta", {})
                        if d.get("content") or d.get("reasoning_content") or ch.get("finish_reason"):
                            ttft = time.perf_counter() - start
    except httpx.HTTPError as e:
        return Result(False, f"{type(e).__name__}: {e}", 0, 0, 0)
    latency = time.perf_counter() - start
    if not events or events[-1] != "[DONE]":
        return Result(False, "stream did not end with [DONE]", 0, 0, 0)
    finishes, usage = [], None
    try:
        for ev in events[:-1]:
            chunk = json.loads(ev)
            if "error" in chunk:
                return Result(False, f"error event: {chunk['error']}", 0, 0, 0)
            if chunk["object"] != "chat.completion.chunk":
                return Result(False, f"bad object {chunk['object']!r}", 0, 0, 0)
            for ch in chunk["choices"]:
                if ch["finish_reason"] is not None:
                    finishes.append(ch["finish_reason"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    except (ValueError, KeyError) as e:
        return Result(False, f"malformed event: {e}", 0, 0, 0)
    if finishes != ["length"]:
        return Result(False, f"finish reasons {finishes}", 0, 0, 0)
    if usage is None or usage["completion_tokens"] != max_tokens or (
            usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]):
        return Result(False, f"bad usage {usage}", 0, 0, 0)
    return Result(True, "", ttft if ttft is not None else latency, latency, max_tokens)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def run_load(url: str, clients: int, rounds: int, max_tokens: int) -> list[Result]:
    results: list[Result] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    for rnd in range(rounds):
        # fresh connections each round, as fresh clients would open (reusing httpx's
        # keep-alive pool across rounds measured the client's pool, not the server)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            t0 = time.perf_counter()
            batch = await asyncio.gather(*(one_request(client, url, rnd * clients + k, max_tokens)
                                           for k in range(clients)))
            dt = time.perf_counter() - t0
            good = sum(r.ok for r in batch)
            print(f"round {rnd + 1}/{rounds}: {good}/{clients} ok in {dt:.2f} s "
                  f"({clients / dt:.2f} req/s)", flush=True)
            results += batch
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: a fresh tiny v4 one)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--device", default=None)
    ap.add_argument("--server-arg", action="append", default=[], help="extra server argument")
    args = ap.parse_args(argv)

    model = args.model
    if model is None:
        from dsv4.tiny import make_tiny_checkpoint

        model = make_tiny_checkpoint(tempfile.mkdtemp(prefix="dsv4_tiny_"), variant="v4")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "dsv4.server", "--model", model, "--port", str(port),
           "--max-num-seqs", str(max(args.clients, 1)), "--max-model-len", "1024",
           "--log-level", "warning", *args.server_arg]
    if args.device:
        cmd += ["--device", args.device]
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                print("server exited during start-up", file=sys.stderr)
                return 1
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                print("server did not come up", file=sys.stderr)
                return 1
            time.sleep(0.2)

        t0 = time.perf_counter()
        results = asyncio.run(run_load(url, args.clients, args.rounds, args.max_tokens))
        wall = time.perf_counter() - t0
        bad = [r for r in results if not r.ok]
        for r in bad[:5]:
            print("FAILED:", r.error)

        # the engine should be idle now: give a finished step a moment to be reflected
        for _ in range(50):
            m = _metrics(url)
            if m.get("dsv4_num_requests_running", 1) == 0 and m.get("dsv4_num_requests_waiting", 1) == 0:
                break
            time.sleep(0.1)
        leaks = []
        if m.get("dsv4_num_requests_running") != 0 or m.get("dsv4_num_requests_waiting") != 0:
            leaks.append("requests still running/waiting")
        if m.get("dsv4_cache_usage") != 0:
            leaks.append(f"cache usage {m.get('dsv4_cache_usage')}")
        if "dsv4_engine_num_free_pages" in m and m["dsv4_engine_num_free_pages"] != m.get(
                "dsv4_engine_num_pages"):
            leaks.append(f"{m['dsv4_engine_num_pages'] - m['dsv4_engine_num_free_pages']:.0f} "
                         "pages not free")

        good = [r for r in results if r.ok]
        print(f"\n{len(good)}/{len(results)} responses well formed; "
              f"{'no pages leaked' if not leaks else 'LEAK: ' + '; '.join(leaks)}")
        if good:
            ttfts = [r.ttft * 1000 for r in good]
            lats = [r.latency * 1000 for r in good]
            print(f"clients {args.clients} x rounds {args.rounds}, max_tokens {args.max_tokens}, "
                  f"wall {wall:.2f} s")
            print(f"throughput: {len(good) / wall:.2f} req/s, "
                  f"{sum(r.tokens for r in good) / wall:.1f} output tok/s")
            print(f"TTFT ms: p50 {pct(ttfts, 50):.0f}  p90 {pct(ttfts, 90):.0f}  "
                  f"p99 {pct(ttfts, 99):.0f}  mean {statistics.fmean(ttfts):.0f}")
            print(f"latency ms: p50 {pct(lats, 50):.0f}  p90 {pct(lats, 90):.0f}  "
                  f"p99 {pct(lats, 99):.0f}")
        return 0 if not bad and not leaks else 1
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
