"""One rank of the step-channel test (``torchrun --nproc-per-node 2``, gloo): rank 0 sends a
scripted sequence of messages — pickled objects while the worker waits on the control group,
static-step headers with a tensor after each (the worker moves to the step channel), objects
announced on the channel, a park, objects again, a second channel of another length — and the
worker writes what it received, in order, to ``--out``."""

from __future__ import annotations

import argparse
import json

import torch

from dsv4.dist.parallel import ParallelConfig, init_parallel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    par = init_parallel(ParallelConfig(tensor_parallel_size=2))
    data = torch.zeros(3, dtype=torch.int64)
    if par.is_driver:
        par.send({"n": 1})                       # control group (workers parked)
        data[:] = torch.tensor([7, 8, 9])
        par.send_static([4, 3, 1, 5], 8)        # -> Listen(8), then the header
        par.broadcast_tensor(data)
        par.send(["on", "the", "channel"])      # header MSG_OBJECT, then the pickle
        data[:] = torch.tensor([1, 2, 3])
        par.send_static([2, 1, 0], 8)
        par.broadcast_tensor(data)
        par.park()
        par.park()                               # idempotent: nothing sent
        par.send("parked")
        par.send_static([1, 1, 0], 5)            # a channel of another length
        par.broadcast_tensor(data)
        par.send(None)                           # the end
    else:
        got = []
        while True:
            kind, msg = par.receive()
            if kind == "static":
                par.broadcast_tensor(data)
                got.append(["static", msg[:4], data.tolist()])
                continue
            got.append(["object", msg])
            if msg is None:
                break
        with open(args.out, "w") as f:
            json.dump(got, f)
    par.barrier()
    par.close()


if __name__ == "__main__":
    main()
