"""Tensor / expert parallel groups and the collectives the model and the engine use.

One group spans every process of the launch (``torchrun``: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); the tensor-parallel size is the world size.
Attention splits its query heads over the ranks; the MoE splits either each expert's
intermediate dim (tensor parallel) or the experts themselves (``expert_parallel``).  Backend:
NCCL when the engine runs on CUDA, gloo on CPU.

A second, gloo, *control* group carries the engine's step descriptions from rank 0 to the
workers (pickled objects, host side, so a worker never touches the GPU stream to wait and can
sit idle for days: its timeout is :data:`CONTROL_TIMEOUT`).  While the engine is busy, the
workers listen on the fast *step channel* instead: a fixed-size int64 header broadcast over the
main group (NVLink on GPUs) says what comes next — a pickled message on the control group, or a
static decode step whose inputs follow as tensors (:meth:`Parallel.send_static`).  A pickled
broadcast over gloo took 1.3 ms per decode step on two H200s (TCP in the machine's sandbox);
the header is one NCCL broadcast.  The driver parks the workers back on the control group
whenever the engine goes idle (:meth:`Parallel.park`), so no NCCL wait outlives its timeout.

:data:`SINGLE` is the single-process default: every collective is a no-op, so model code calls
them unconditionally.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger("dsv4")

__all__ = ["ParallelConfig", "Parallel", "SINGLE", "init_parallel", "launch_env",
           "CONTROL_TIMEOUT"]

# A worker waits on the control group for rank 0's next step; a server may stay idle for long.
CONTROL_TIMEOUT = datetime.timedelta(days=365)

# First int of a step-channel header: what follows it.
MSG_OBJECT, MSG_STATIC, MSG_PARK = 1, 2, 3


@dataclass(frozen=True)
class Listen:
    """Control-group message: the workers move to the step channel (the engine is busy), whose
    header holds ``length`` ints."""

    length: int


@dataclass(frozen=True)
class ParallelConfig:
    """The user's choice: ``tensor_parallel_size`` processes (one per GPU), and whether the
    routed experts are split by expert (``expert_parallel=True``) or each expert by its
    intermediate dim (False, the default).  Attention is tensor parallel either way."""

    tensor_parallel_size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size={tp!r} is invalid; allowed: an integer >= 1")
        if not isinstance(self.expert_parallel, bool):
            raise ValueError(f"expert_parallel={self.expert_parallel!r} is invalid; allowed: "
                             "True or False")

    def check_model(self, cfg: Any) -> None:
        """Raise ValueError unless ``cfg`` (a ModelConfig) splits evenly over the ranks."""
        n = self.tensor_parallel_size
        if n == 1:
            return
        need = [("num_attention_heads", cfg.n_heads), ("o_groups", cfg.o_groups),
                ("moe_intermediate_size", cfg.moe_inter_dim)]
        if self.expert_parallel:
            need.append(("n_routed_experts", cfg.n_routed_experts))
            if cfg.is_v41 and cfg.n_mtp_layers and cfg.dspark_n_routed_experts:
                need.append(("dspark_n_routed_experts", cfg.dspark_n_routed_experts))
        for name, value in need:
            if value % n:
                how = "expert_parallel" if name.endswith("experts") else "tensor parallel"
                raise ValueError(f"tensor_parallel_size={n}: the model's {name}={value} is not "
                                 f"a multiple of {n} ({how} splits it evenly over the ranks)")
        if not self.expert_parallel and cfg.quantized:
            # Each rank keeps its slice of every routed expert in the checkpoint format: the
            # slice must hold whole scale blocks.
            part = cfg.moe_inter_dim // n
            block = 32 if cfg.expert_dtype == "fp4" else cfg.weight_block_size
            if part % block:
                raise ValueError(f"tensor_parallel_size={n}: each rank's slice of the routed "
                                 f"experts (moe_intermediate_size {cfg.moe_inter_dim} / {n} = "
                                 f"{part}) is not a multiple of their {cfg.expert_dtype} scale "
                                 f"block {block}; use expert_parallel=True "
                                 f"(--enable-expert-parallel) or another size")


def launch_env() -> dict[str, int] | None:
    """(rank, world_size, local_rank) from a torchrun launch, or None outside one."""
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        world = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise ValueError(f"torchrun environment: RANK/WORLD_SIZE/LOCAL_RANK must be integers; "
                         f"found RANK={os.environ.get('RANK')!r}, "
                         f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}, "
                         f"LOCAL_RANK={os.environ.get('LOCAL_RANK')!r}") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"torchrun environment: RANK={rank} is not in 0..WORLD_SIZE-1 "
                         f"(WORLD_SIZE={world})")
    return {"rank": rank, "world_size": world, "local_rank": local}


class Parallel:
    """The runtime parallel state of one process: its rank among ``world_size`` and the
    collectives over them.  Every collective is a no-op when ``world_size == 1``."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0,
                 expert_parallel: bool = False, group: Any = None,
                 control_group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.expert_parallel = expert_parallel and world_size > 1
        self.group = group
        self.control_group = control_group
        self.closed = False
        # The step channel (None until first used): the header tensor on the main
        # group's device, its pinned host staging copy (driver) and whether the workers listen.
        self._header: Tensor | None = None
        self._header_host: Tensor | None = None
        self._header_sent: Any = None
        self.listening = False
        self.device = torch.device("cpu")   # the main group's device (init_parallel sets it)

    # ------------------------------------------------------------------ facts
    @property
    def enabled(self) -> bool:
        """True when there is more than one process."""
        return self.world_size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler, the sampler and (``dsv4 serve``) the HTTP server."""
        return self.rank == 0

    @property
    def tp_rank(self) -> int:
        return self.rank

    @property
    def tp_size(self) -> int:
        return self.world_size

    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's even share ``[lo, hi)`` of ``n`` items (heads, groups, experts, ...)."""
        if n % self.world_size:
            raise ValueError(f"{what}={n} does not split evenly over {self.world_size} ranks")
        size = n // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def split_ceil(self, n: int) -> tuple[int, int]:
        """This rank's share of ``n`` rows in chunks of ceil(n / world_size) (the last rank may
        hold fewer, or none)."""
        size = -(-n // self.world_size)
        lo = min(n, self.rank * size)
        return lo, min(n, lo + size)

    def describe(self) -> str:
        moe = "expert parallel" if self.expert_parallel else "tensor parallel"
        return f"rank {self.rank}/{self.world_size} (attention tensor parallel, MoE {moe})"

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: Tensor, dim: int = 0) -> Tensor:
        """Concatenate every rank's ``t`` (same shape on each) along ``dim``, rank order."""
        if self.world_size == 1:
            return t
        import torch.distributed as dist

        t = t.contiguous().reshape(1, *t.shape)  # rank-major along a new leading dim
        out = torch.empty((self.world_size,) + tuple(t.shape[1:]), dtype=t.dtype,
                          device=t.device)
        dist.all_gather_into_tensor(out, t, group=self.group)
        return torch.cat(out.unbind(0), dim=dim)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled over the control group)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    # ------------------------------------------------------------------ step channel
    def _open_step_channel(self, length: int) -> None:
        """Allocate the step channel's ``length``-int header on the main group's device."""
        if self._header is not None and self._header.numel() == length:
            return
        self._header = torch.zeros(length, dtype=torch.int64, device=self.device)
        if self.is_driver:
            self._header_host = torch.zeros(length, dtype=torch.int64,
                                            pin_memory=self.device.type == "cuda")
            self._header_sent = None

    def _send_header(self, values: list[int]) -> None:
        import torch.distributed as dist

        assert self._header is not None and self._header_host is not None
        if len(values) > self._header.numel():
            raise ValueError(f"step header of {len(values)} ints; the channel holds "
                             f"{self._header.numel()}")
        if self._header_sent is not None:
            self._header_sent.synchronize()   # the staging copy is free again
        host = self._header_host
        h = host.numpy()    # (no tensor made per step)
        h[:] = 0
        h[:len(values)] = values
        if self._header.device.type == "cuda":
            self._header.copy_(host, non_blocking=True)
            self._header_sent = torch.cuda.Event()
            self._header_sent.record()
        else:
            self._header.copy_(host)
        dist.broadcast(self._header, src=0, group=self.group)

    def send(self, obj: Any) -> None:
        """Driver: one pickled message to the workers (announced on the step channel when they
        listen there)."""
        if self.world_size == 1:
            return
        if self.listening:
            self._send_header([MSG_OBJECT])
        self.broadcast_object(obj)

    def send_static(self, values: list[int], length: int) -> None:
        """Driver: announce a static decode step described by ``values`` (its inputs follow as
        tensor broadcasts, :meth:`broadcast_tensor`); first moves the workers to the step
        channel (a header of ``length`` ints) if they wait on the control group."""
        if not self.listening or self._header is None or self._header.numel() != length:
            self.park()
            self._open_step_channel(length)
            self.broadcast_object(Listen(length))
            self.listening = True
        self._send_header([MSG_STATIC, *values])

    def park(self) -> None:
        """Driver: send the workers back to the control group (the engine goes idle)."""
        if self.world_size > 1 and self.listening:
            self._send_header([MSG_PARK])
            self.listening = False

    def receive(self) -> tuple[str, Any]:
        """Worker: the driver's next message: ``("object", obj)`` or ``("static", header ints
        after the kind)``."""
        while True:
            if not self.listening:
                obj = self.broadcast_object(None)
                if isinstance(obj, Listen):
                    self._open_step_channel(obj.length)
                    self.listening = True
                    continue
                return "object", obj
            import torch.distributed as dist

            assert self._header is not None, "the step channel was never opened on this rank"
            dist.broadcast(self._header, src=0, group=self.group)
            head = self._header.tolist()
            if head[0] == MSG_OBJECT:
                return "object", self.broadcast_object(None)
            if head[0] == MSG_PARK:
                self.listening = False
                continue
            if head[0] == MSG_STATIC:
                return "static", head[1:]
            raise ValueError(f"step channel: unknown message kind {head[0]}")

    def broadcast_tensor(self, t: Tensor) -> None:
        """Rank 0's ``t`` into every rank's ``t`` (in place, the main group)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.broadcast(t, src=0, group=self.group)

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. cache pages every rank can hold)."""
        if self.world_size == 1:
            return int(value)
        import torch.distributed as dist

        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.control_group)

    def close(self) -> None:
        """Leave this engine's control group (idempotent).  The default process group stays:
        a later engine of the same launch reuses it (torchrun's store cannot host a second
        one); when this module created it, it is destroyed at interpreter exit."""
        if self.closed or self.world_size == 1:
            return
        self.closed = True
        import torch.distributed as dist

        if self.control_group is not None and dist.is_initialized():
            dist.destroy_process_group(self.control_group)
            self.control_group = None

    def __repr__(self) -> str:
        return (f"Parallel(rank={self.rank}, world_size={self.world_size}, "
                f"expert_parallel={self.expert_parallel})")


SINGLE = Parallel()


def init_parallel(config: ParallelConfig, device: torch.device | str | None = None) -> Parallel:
    """The :class:`Parallel` of this process for ``config``.

    ``tensor_parallel_size == 1`` outside a multi-process launch gives :data:`SINGLE`.
    Otherwise the process must run under ``torchrun`` with ``WORLD_SIZE`` equal to
    ``tensor_parallel_size``; the default process group is created (NCCL when ``device`` is
    CUDA, gloo else; destroyed at exit) unless one already exists, which is then reused.
    On CUDA the process uses GPU ``LOCAL_RANK``.
    """
    env = launch_env()
    tp = config.tensor_parallel_size
    world = env["world_size"] if env else 1
    if tp == 1 and world == 1:
        return SINGLE
    if env is None:
        raise ValueError(f"tensor_parallel_size={tp} needs a launch with {tp} processes, one per "
                         f"GPU: torchrun --nproc-per-node {tp} ... (no WORLD_SIZE in the "
                         "environment)")
    if world != tp:
        raise ValueError(f"tensor_parallel_size={tp} but the launch has WORLD_SIZE={world} "
                         f"processes; they must be equal (torchrun --nproc-per-node / --nnodes)")
    import torch.distributed as dist

    dev = torch.device(device) if device is not None else torch.device("cpu")
    rank, local = env["rank"], env["local_rank"]
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dist.is_initialized():
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise ValueError(f"an existing process group has rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}; the environment says {rank} of {world}")
        have = dist.get_backend()
        if backend not in str(have):
            raise ValueError(f"the existing process group uses {have!r}; device {dev} needs "
                             f"{backend!r}")
    else:
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(local)
            kwargs["device_id"] = torch.device("cuda", local)
        dist.init_process_group(backend=backend, init_method="env://", rank=rank,
                                world_size=world, **kwargs)
        atexit.register(_destroy_default_group)
    if backend == "nccl":
        torch.cuda.set_device(local)
    # new_group is collective: every rank creates the control group in the same order.
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    par = Parallel(rank, world, local, config.expert_parallel, group=dist.group.WORLD,
                   control_group=control)
    par.device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    log.info("dsv4 parallel: %s, backend %s", par.describe(), backend)
    return par


def _destroy_default_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
