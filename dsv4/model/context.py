"""StepContext: what one forward step of the model processes (docs/ARCHITECTURE.md).

A step holds the new tokens of R requests flattened into T tokens, in request order.  Request i
owns rows ``cu_seqlens[i] : cu_seqlens[i+1]`` of the flat batch; its tokens sit at the contiguous
positions ``start_pos[i] .. start_pos[i] + n_i - 1`` of its sequence.  Device tensors are what
kernels read; the ``*_host`` lists are copies for the torch path so it never has to synchronise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["StepContext", "StaticShape", "pages_needed", "decode_buckets", "bucket_for",
           "ints_to_device"]


def ints_to_device(arrays: Sequence[np.ndarray], device: torch.device | str | None
                   ) -> list[Tensor]:
    """int64 tensors on ``device`` with the values and shapes of host ``arrays``.

    On a GPU they travel in one pinned buffer and one non-blocking copy: a ``torch.tensor(list,
    device="cuda")`` is a pageable copy, which waits for the stream's queued work, so every one
    of them in a prefill step left the GPU idle while the host caught up again (the 8K-prefill
    gap report of the thirteenth session, docs/PERFORMANCE.md)."""
    arrays = [np.asarray(a, dtype=np.int64) for a in arrays]
    device = torch.device(device) if device is not None else torch.device("cpu")
    flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0, np.int64)
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.to(device)
    out, at = [], 0
    for a in arrays:
        out.append(dev[at:at + a.size].view(a.shape))
        at += a.size
    return out


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Number of pages of ``page_size`` tokens that hold ``num_tokens`` tokens."""
    return (num_tokens + page_size - 1) // page_size


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes of static-shape decode steps: 1, 2, 4, ... below ``max_batch``, then
    ``max_batch`` itself (a step of R requests runs at the smallest bucket >= R)."""
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch <= 0:
        raise ValueError(f"decode_buckets: max_batch must be an integer > 0; got {max_batch!r}")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def bucket_for(num_requests: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``num_requests`` rows (None when none does)."""
    for b in buckets:
        if b >= num_requests:
            return b
    return None


@dataclass(frozen=True)
class StaticShape:
    """The engine constants a static-shape decode step is padded to (CUDA graphs).

    With them every tensor of the step has a shape that depends only on the bucket size B and
    the model/engine constants (window, ratios, page size, index_topk), never on the step's
    positions, and the step's index tensors are derived on the device (no host values, no sync):
    a step captured once replays for any positions.

    * ``max_pages``: width of every block table (pages of ``max_model_len`` tokens); the
      compressed-entry lists of a ratio-r layer have ``max_pages · page_size // r`` columns;
    * ``scratch_slot`` / ``scratch_page``: state slot and page of the padding rows.  The runner
      allocates them beyond the cache manager's ids, so no real request ever holds them: a
      padding row writes its window row, compressor carry-over and entries there and reads
      nothing else.
    """

    max_pages: int
    scratch_slot: int
    scratch_page: int

    def __post_init__(self) -> None:
        for name in ("max_pages", "scratch_slot", "scratch_page"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "max_pages"
                                                                     else 0):
                raise ValueError(f"StaticShape: {name} must be a "
                                 f"{'positive' if name == 'max_pages' else 'non-negative'} "
                                 f"integer; got {v!r}")

    def pad_table(self) -> list[int]:
        """The block table of a padding row: the scratch page, then −1."""
        return [self.scratch_page] + [-1] * (self.max_pages - 1)


def _as_long(t: Tensor | Sequence[int], device: torch.device | str | None) -> Tensor:
    if isinstance(t, Tensor):
        return t.to(device=device, dtype=torch.int64) if device is not None else t.long()
    return torch.tensor(list(t), dtype=torch.int64, device=device)


@dataclass
class StepContext:
    """The tokens of one forward step and where their requests live in the cache.

    Fields (torch tensors on the model's device unless noted):

    * ``input_ids`` [T] int64, ``positions`` [T] int64 (absolute position in its sequence);
    * ``cu_seqlens`` [R+1] int64, ``start_pos`` [R] int64 (tokens cached before this step);
    * ``slots`` [R] int64 (state slot of each request in HybridCache);
    * ``block_tables`` [R, max_pages] int64 (page ids, −1 where unused);
    * ``logits_indices`` [N] int64 (rows whose logits are wanted); ``logits_all`` (host flag):
      they are every row in order, so the model skips the gather (one kernel per step);
    * ``seqlens_host``, ``start_pos_host`` (list[int]): host copies;
    * ``token_types`` [T] int64 or None (V4.1 image marks: −1 text, ≥ 0 image span).

    Extra host copies (``slots_host``, ``block_tables_host``) are filled on construction when
    not given; ``memo`` is a per-step scratch dict where layers share derived tensors (RoPE
    tables, window indices) so that 40+ layers compute them once per step.

    ``static`` (a :class:`StaticShape`, decode steps only): the static-shape mode of CUDA graphs.
    Every request then has exactly one token (so ``positions == start_pos`` and token t is
    request t), the block tables are ``max_pages`` wide, and the layers derive their index
    tensors from the device tensors only; the host position lists are not step constants there
    (``end_pos_host`` refuses).  Build such a step with :meth:`static_decode`.
    """

    input_ids: Tensor
    positions: Tensor
    cu_seqlens: Tensor
    start_pos: Tensor
    slots: Tensor
    block_tables: Tensor
    logits_indices: Tensor
    seqlens_host: list[int]
    start_pos_host: list[int]
    token_types: Tensor | None = None
    slots_host: list[int] | None = None
    block_tables_host: list[list[int]] | None = None
    memo: dict[Any, Any] = field(default_factory=dict, repr=False)
    static: StaticShape | None = None
    logits_all: bool = False

    def __post_init__(self) -> None:
        R = len(self.seqlens_host)
        T = int(self.input_ids.shape[0])
        if len(self.start_pos_host) != R:
            raise ValueError(f"StepContext: start_pos_host has {len(self.start_pos_host)} entries; "
                             f"expected one per request ({R})")
        if sum(self.seqlens_host) != T:
            raise ValueError(f"StepContext: seqlens_host sums to {sum(self.seqlens_host)}; expected "
                             f"the number of tokens T={T}")
        if any(n <= 0 for n in self.seqlens_host):
            raise ValueError(f"StepContext: every request needs >= 1 token; seqlens_host="
                             f"{self.seqlens_host}")
        for name, t, shape in (("positions", self.positions, (T,)),
                               ("cu_seqlens", self.cu_seqlens, (R + 1,)),
                               ("start_pos", self.start_pos, (R,)),
                               ("slots", self.slots, (R,))):
            if tuple(t.shape) != shape:
                raise ValueError(f"StepContext: {name} has shape {tuple(t.shape)}; expected {shape}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != R:
            raise ValueError(f"StepContext: block_tables has shape {tuple(self.block_tables.shape)};"
                             f" expected [R={R}, max_pages]")
        if self.logits_all and tuple(self.logits_indices.shape) != (T,):
            raise ValueError(f"StepContext: logits_all needs logits_indices of every token "
                             f"({T}); found shape {tuple(self.logits_indices.shape)}")
        if self.token_types is not None and tuple(self.token_types.shape) != (T,):
            raise ValueError(f"StepContext: token_types has shape {tuple(self.token_types.shape)};"
                             f" expected ({T},)")
        if self.static is not None:
            if any(n != 1 for n in self.seqlens_host):
                raise ValueError(f"StepContext: a static-shape step is decode only (one token per "
                                 f"request); seqlens_host={self.seqlens_host}")
            if self.block_tables.shape[1] != self.static.max_pages:
                raise ValueError(f"StepContext: a static-shape step needs block tables "
                                 f"{self.static.max_pages} pages wide; found "
                                 f"{tuple(self.block_tables.shape)}")
        if self.slots_host is None:
            self.slots_host = [int(s) for s in self.slots.tolist()]
        if self.block_tables_host is None:
            self.block_tables_host = [[int(p) for p in row] for row in self.block_tables.tolist()]

    # ------------------------------------------------------------------ constructors
    @classmethod
    def build(cls, input_ids: Tensor | Sequence[int], seqlens: Sequence[int],
              start_pos: Sequence[int], slots: Sequence[int],
              block_tables: Sequence[Sequence[int]], *, logits_indices: Sequence[int] | None = None,
              token_types: Tensor | Sequence[int] | None = None,
              device: torch.device | str | None = None) -> "StepContext":
        """Build a context from host lists (positions and offsets are derived).

        ``block_tables`` rows may have different lengths; they are padded with −1.
        ``logits_indices`` defaults to the last token of every request.
        """
        seqlens = [int(n) for n in seqlens]
        start_pos = [int(s) for s in start_pos]
        R = len(seqlens)
        if not (len(start_pos) == len(slots) == len(block_tables) == R):
            raise ValueError(f"StepContext.build: seqlens, start_pos, slots and block_tables must "
                             f"have one entry per request; got {R}, {len(start_pos)}, {len(slots)},"
                             f" {len(block_tables)}")
        if device is None:
            device = input_ids.device if isinstance(input_ids, Tensor) else "cpu"
        n = np.asarray(seqlens, dtype=np.int64)
        cu = np.concatenate(([0], np.cumsum(n)))
        T = int(cu[-1])
        req = np.repeat(np.arange(R), n)
        positions = np.asarray(start_pos, dtype=np.int64)[req] + np.arange(T) - cu[:-1][req]
        width = max([len(b) for b in block_tables] + [1])
        bt = [[int(p) for p in b] + [-1] * (width - len(b)) for b in block_tables]
        logits = (cu[1:] - 1 if logits_indices is None
                  else np.asarray([int(i) for i in logits_indices], dtype=np.int64))
        slot_list = [int(s) for s in slots]
        host = [positions, cu, start_pos, slot_list,
                np.asarray(bt, dtype=np.int64).reshape(R, width), logits, req]
        if not isinstance(input_ids, Tensor):      # host ids travel in the same copy
            host.append(np.asarray(list(input_ids), dtype=np.int64))
        on_dev = ints_to_device(host, device)
        ids = on_dev[7] if len(host) > 7 else _as_long(input_ids, device)
        tt = None if token_types is None else _as_long(token_types, device)
        ctx = cls(
            input_ids=ids, positions=on_dev[0], cu_seqlens=on_dev[1], start_pos=on_dev[2],
            slots=on_dev[3], block_tables=on_dev[4], logits_indices=on_dev[5],
            seqlens_host=seqlens, start_pos_host=start_pos, token_types=tt,
            slots_host=slot_list, block_tables_host=bt,
            logits_all=len(logits) == T and bool((logits == np.arange(T)).all()))
        ctx.memo["request_of_token"] = on_dev[6]
        return ctx

    @classmethod
    def static_decode(cls, input_ids: Sequence[int], start_pos: Sequence[int],
                      slots: Sequence[int], block_tables: Sequence[Sequence[int]], bucket: int,
                      static: StaticShape, *, token_types: Sequence[int] | None = None,
                      device: torch.device | str | None = None) -> "StepContext":
        """A static-shape decode step of R <= ``bucket`` requests (one token each), padded to
        ``bucket`` rows.  Padding rows hold token 0 at position 0 in the scratch slot and page;
        the logits of every row are computed (rows R.. are padding)."""
        R = len(input_ids)
        if not 0 < R <= bucket:
            raise ValueError(f"StepContext.static_decode: needs 1..bucket={bucket} requests; "
                             f"got {R}")
        if not (len(start_pos) == len(slots) == len(block_tables) == R):
            raise ValueError(f"StepContext.static_decode: input_ids, start_pos, slots and "
                             f"block_tables must have one entry per request; got {R}, "
                             f"{len(start_pos)}, {len(slots)}, {len(block_tables)}")
        width = static.max_pages
        for i, b in enumerate(block_tables):
            if len(b) > width:
                raise ValueError(f"StepContext.static_decode: block table {i} has {len(b)} pages;"
                                 f" the static width is max_pages={width}")
        pad = bucket - R
        bt = [[int(p) for p in b] + [-1] * (width - len(b)) for b in block_tables]
        bt += [static.pad_table() for _ in range(pad)]
        ids = [int(t) for t in input_ids] + [0] * pad
        pos = [int(p) for p in start_pos] + [0] * pad
        slot_list = [int(s) for s in slots] + [static.scratch_slot] * pad
        tt = None
        if token_types is not None:
            tt = torch.tensor([int(t) for t in token_types] + [-1] * pad, dtype=torch.int64,
                              device=device)
        return cls.from_static_tensors(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            start_pos=torch.tensor(pos, dtype=torch.int64, device=device),
            slots=torch.tensor(slot_list, dtype=torch.int64, device=device),
            block_tables=torch.tensor(bt, dtype=torch.int64, device=device),
            static=static, token_types=tt, start_pos_host=pos, slots_host=slot_list,
            block_tables_host=bt)

    @classmethod
    def from_static_tensors(cls, input_ids: Tensor, start_pos: Tensor, slots: Tensor,
                            block_tables: Tensor, static: StaticShape, *,
                            token_types: Tensor | None = None,
                            start_pos_host: list[int] | None = None,
                            slots_host: list[int] | None = None,
                            block_tables_host: list[list[int]] | None = None,
                            cu_seqlens: Tensor | None = None,
                            logits_indices: Tensor | None = None) -> "StepContext":
        """A static-shape decode step over given device tensors of B rows (e.g. views of a CUDA
        graph's persistent buffers): positions are ``start_pos`` itself, every row's logits are
        wanted (``logits_indices``, when given, must be ``arange(B)``).  The host lists (only validated by the layers, never used for shapes) default to
        what the tensors hold when passed, else to the padding-row values; pass them to avoid a
        device read (under graph capture they must be given).
        """
        B = int(input_ids.shape[0])
        dev = input_ids.device
        if cu_seqlens is None:
            cu_seqlens = torch.arange(B + 1, dtype=torch.int64, device=dev)
        if logits_indices is None:
            logits_indices = torch.arange(B, dtype=torch.int64, device=dev)
        if start_pos_host is None:
            start_pos_host = [0] * B
        if slots_host is None:
            slots_host = [static.scratch_slot] * B
        if block_tables_host is None:
            block_tables_host = [static.pad_table() for _ in range(B)]
        return cls(input_ids=input_ids, positions=start_pos, cu_seqlens=cu_seqlens,
                   start_pos=start_pos, slots=slots, block_tables=block_tables,
                   logits_indices=logits_indices, seqlens_host=[1] * B,
                   start_pos_host=list(start_pos_host), token_types=token_types,
                   slots_host=list(slots_host), block_tables_host=block_tables_host,
                   static=static, logits_all=True)

    @classmethod
    def single(cls, input_ids: Tensor | Sequence[int], start_pos: int = 0, page_size: int = 256,
               token_types: Tensor | Sequence[int] | None = None,
               all_logits: bool = True) -> "StepContext":
        """The context of one request: slot 0, pages 0..k covering ``start_pos + n`` tokens.

        ``all_logits`` asks for the logits of every token (else only the last one).
        """
        ids = input_ids if isinstance(input_ids, Tensor) else torch.tensor(list(input_ids),
                                                                           dtype=torch.int64)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"StepContext.single: input_ids must be a non-empty 1-D sequence; got "
                             f"shape {tuple(ids.shape)}")
        if start_pos < 0:
            raise ValueError(f"StepContext.single: start_pos must be >= 0; got {start_pos}")
        n = int(ids.numel())
        pages = list(range(pages_needed(start_pos + n, page_size)))
        rows = list(range(n)) if all_logits else [n - 1]
        return cls.build(ids, [n], [start_pos], [0], [pages], logits_indices=rows,
                         token_types=token_types, device=ids.device)

    # ------------------------------------------------------------------ helpers
    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return len(self.seqlens_host)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def cu_seqlens_host(self) -> list[int]:
        """Host copy of ``cu_seqlens``."""
        out = [0]
        for n in self.seqlens_host:
            out.append(out[-1] + n)
        return out

    @property
    def end_pos_host(self) -> list[int]:
        """Per request: tokens in the cache after this step (``start_pos + n``).

        Refused in static-shape mode: shapes derived from it would change from step to step."""
        if self.static is not None:
            raise RuntimeError("StepContext.end_pos_host: a static-shape step must not size "
                               "tensors by host positions (use the device tensors)")
        return [s + n for s, n in zip(self.start_pos_host, self.seqlens_host)]

    @property
    def is_decode(self) -> bool:
        """True when every request brings exactly one token."""
        return all(n == 1 for n in self.seqlens_host)

    @property
    def request_of_token(self) -> Tensor:
        """[T] int64: the request index (0..R−1) of every token of the flat batch."""
        key = "request_of_token"
        if key not in self.memo and self.static is not None:
            # One token per request: no host counts (and no device sync) needed.
            self.memo[key] = torch.arange(self.num_requests, device=self.device)
        if key not in self.memo:
            req = np.repeat(np.arange(self.num_requests), self.seqlens_host)
            self.memo[key] = ints_to_device([req], self.device)[0]
        return self.memo[key]

    def token_range(self, request: int) -> tuple[int, int]:
        """(first, last + 1) rows of request ``request`` in the flat batch."""
        cu = self.cu_seqlens_host
        return cu[request], cu[request + 1]
