"""Time the compressor ops (``compress_entries`` + ``compress_update_state``) at V4-Flash shapes.

    PYTHONPATH=. python bench/compressor.py [--out results.json]

Per shape: the Triton kernels' time (``triton.testing.do_bench`` median, L2 flushed between
runs), the torch twin's time on the same GPU, the bytes the kernels must move (the group rows
they read, kv and score fp32, the entries they write, the state rows read and rewritten) and the
ratio to the floor ``bytes / 4.29 TB/s`` (the H200's measured copy bandwidth).
Shapes: a 64-request static decode step (one candidate entry per request, as CUDA graphs run
it) for the attention compressor of a CSA layer (ratio 4, overlap, d 512), the indexer's
compressor (ratio 4, overlap, d 128) and an HCA layer (ratio 128, d 512), and a prefill step of
8 requests × 1024 tokens.  Not run in CI; no result is recorded here until measured.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from dsv4.ops import torch_compress as twin
from dsv4.ops import triton_compress as tri

BW = 4.29e12


def build(ratio: int, overlap: bool, d: int, starts: list[int], lens: list[int], static: bool,
          out_dtype: torch.dtype) -> tuple[tuple, tuple, int]:
    """(entries args, state args, bytes moved) of one step on the GPU."""
    dev = "cuda"
    coff = 2 if overlap else 1
    W, R, T = coff * d, len(starts), sum(lens)
    kv = torch.randn(T, W, device=dev)
    score = torch.randn(T, W, device=dev)
    state_kv = torch.randn(R, coff * ratio, W, device=dev)
    state_score = torch.randn(R, coff * ratio, W, device=dev)
    slots = torch.randperm(R, device=dev)
    start = torch.tensor(starts, device=dev)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=dev)
    if static:
        req = torch.arange(R, device=dev)
        ent = torch.clamp((start + 1) // ratio - 1, min=0)
        valid = (start + 1) % ratio == 0
    else:
        pairs = [(i, j) for i, (s, n) in enumerate(zip(starts, lens))
                 for j in range(s // ratio, (s + n) // ratio)]
        req = torch.tensor([p[0] for p in pairs], device=dev)
        ent = torch.tensor([p[1] for p in pairs], device=dev)
        valid = None
    E = int(req.shape[0])
    n_live = E if valid is None else int(valid.sum())
    angles = torch.rand(E, 32, device=dev)
    weight = torch.rand(d, device=dev) + 0.5
    entries = (kv, score, state_kv, state_score, req, ent, valid, start, cu, slots, ratio,
               overlap, weight, 1e-6, torch.cos(angles), torch.sin(angles), out_dtype)
    state = (kv, score, state_kv, state_score, start, cu, slots, ratio, overlap)
    slots_per_entry = coff * ratio
    nbytes = (n_live * slots_per_entry * d * 4 * 2 + E * d * out_dtype.itemsize
              + R * coff * ratio * W * 4 * 2 * 2)
    return entries, state, nbytes


def run(out_path: str | None) -> None:
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}; floor = bytes / {BW / 1e12:.2f} TB/s")
    gen = torch.Generator().manual_seed(0)
    rows = []
    shapes = [("csa attn decode x64", 4, True, 512), ("csa index decode x64", 4, True, 128),
              ("hca decode x64", 128, False, 512)]
    for name, ratio, overlap, d in shapes:
        starts = torch.randint(ratio, 64 * 1024, (64,), generator=gen).tolist()
        starts[:16] = [(k + 100) * ratio - 1 for k in range(16)]     # a quarter complete
        rows.append((name, ratio, overlap, d, starts, [1] * 64, True))
    for name, ratio, overlap, d in (("csa attn prefill 8x1024", 4, True, 512),
                                    ("hca prefill 8x1024", 128, False, 512)):
        rows.append((name, ratio, overlap, d, [0] * 8, [1024] * 8, False))
    results = []
    for name, ratio, overlap, d, starts, lens, static in rows:
        e_args, s_args, nbytes = build(ratio, overlap, d, starts, lens, static, torch.bfloat16)

        def kernels() -> None:
            tri.compress_entries(*e_args)
            tri.compress_update_state(*s_args)

        def torch_twin() -> None:
            twin.compress_entries(*e_args)
            twin.compress_update_state(*s_args)

        t_k = triton.testing.do_bench(kernels) * 1e3
        t_t = triton.testing.do_bench(torch_twin) * 1e3
        floor = nbytes / BW * 1e6
        res = dict(shape=name, kernel_us=t_k, torch_us=t_t, bytes=nbytes, floor_us=floor,
                   ratio_to_floor=t_k / floor)
        results.append(res)
        print(f"{name:26s} kernels {t_k:9.1f} µs   torch {t_t:9.1f} µs   floor {floor:7.2f} µs"
              f"   ×{t_k / floor:6.1f}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(dict(device=props.name, results=results), f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/compressor.py needs a CUDA GPU")
    run(args.out)


if __name__ == "__main__":
    main()
