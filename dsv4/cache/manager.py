"""Pure-Python bookkeeping of the hybrid cache: one page allocator, block tables, state slots.

A *page* is one logical block of ``page_size`` token positions.  The page id addresses every
per-layer pool of :class:`dsv4.cache.tensors.HybridCache` at once (each pool stores
``page_size // ratio`` entries per page), so one allocator and one block table per request
cover every cache kind that grows with the sequence.  The fixed-size per-request state (window
ring, compressor carry-over, Engram lookback) lives in *slots*, one per running request.

Memory grows with the tokens a request actually holds: ``ensure(req, n)`` grants pages only up
to ``ceil(n / page_size)``.  Pages carry a reference count so that a later prefix cache can
share full pages between requests; today every page has exactly one owner.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class CacheManager:
    """Page allocator + per-request block tables + per-request state slots (no tensors).

    Args:
        num_pages: pages in every pool of the device cache.
        page_size: token positions per page.
        num_slots: fixed-size state slots (at least the maximum number of running requests).
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int) -> None:
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("num_slots", num_slots)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"CacheManager: {name} must be a positive integer, got {value!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_slots
        # FIFO free lists: a page freed late is reused late, which keeps recently freed pages
        # available longest for a future prefix cache.
        self._free_pages: deque[int] = deque(range(num_pages))
        self._free_slots: deque[int] = deque(range(num_slots))
        self._ref_count: list[int] = [0] * num_pages
        self._tables: dict[Hashable, list[int]] = {}
        self._slots: dict[Hashable, int] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free_pages(self) -> int:
        """Pages not held by any request."""
        return len(self._free_pages)

    @property
    def num_free_slots(self) -> int:
        """State slots not held by any request."""
        return len(self._free_slots)

    @property
    def usage(self) -> float:
        """Fraction of pages in use, in [0, 1]."""
        return 1.0 - len(self._free_pages) / self.num_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` positions."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.page_size)

    def num_pages_held(self, req_id: Hashable) -> int:
        """Pages currently in the block table of ``req_id`` (0 when it has none)."""
        return len(self._tables.get(req_id, ()))

    def pages_needed(self, req_id: Hashable, num_tokens: int) -> int:
        """Extra pages ``req_id`` needs so that its block table covers ``num_tokens``."""
        return max(0, self.pages_for(num_tokens) - self.num_pages_held(req_id))

    def can_allocate(self, num_tokens: int, req_id: Hashable | None = None) -> bool:
        """Whether ``req_id`` (or a new request when None) could grow to ``num_tokens`` now."""
        need = self.pages_for(num_tokens) if req_id is None else self.pages_needed(req_id, num_tokens)
        return need <= len(self._free_pages)

    def block_table(self, req_id: Hashable) -> list[int]:
        """The page ids of ``req_id`` in order (a copy; empty when it holds no page)."""
        return list(self._tables.get(req_id, ()))

    def has_slot(self, req_id: Hashable) -> bool:
        return req_id in self._slots

    def slot(self, req_id: Hashable) -> int:
        """The state slot of ``req_id``; KeyError naming the request when it has none."""
        try:
            return self._slots[req_id]
        except KeyError:
            raise KeyError(f"request {req_id!r} holds no state slot") from None

    def holders(self) -> list[Hashable]:
        """Requests holding pages or a slot."""
        return list(dict.fromkeys([*self._tables, *self._slots]))

    # ------------------------------------------------------------------ changes
    def allocate_slot(self, req_id: Hashable) -> int:
        """Give ``req_id`` a state slot (the same one again if it already holds one)."""
        if req_id in self._slots:
            return self._slots[req_id]
        if not self._free_slots:
            raise RuntimeError(
                f"CacheManager: no free state slot for request {req_id!r} "
                f"(all {self.num_slots} slots are held)")
        slot = self._free_slots.popleft()
        self._slots[req_id] = slot
        return slot

    def ensure(self, req_id: Hashable, num_tokens: int) -> bool:
        """Grow the block table of ``req_id`` to cover ``num_tokens`` positions.

        Returns False, changing nothing, when there are not enough free pages.
        """
        need = self.pages_needed(req_id, num_tokens)
        if need > len(self._free_pages):
            return False
        if need:
            table = self._tables.setdefault(req_id, [])
            for _ in range(need):
                page = self._free_pages.popleft()
                self._ref_count[page] = 1
                table.append(page)
        return True

    def free(self, req_id: Hashable) -> None:
        """Return every page and the slot of ``req_id`` (finish, abort, preemption).

        Freeing a request that holds nothing is a no-op, so callers may free defensively.
        """
        for page in self._tables.pop(req_id, ()):
            self._ref_count[page] -= 1
            if self._ref_count[page] < 0:
                raise RuntimeError(f"CacheManager: page {page} freed more often than allocated")
            if self._ref_count[page] == 0:
                self._free_pages.append(page)
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    # ------------------------------------------------------------------ invariants
    def check_consistency(self) -> None:
        """Raise RuntimeError when the free lists and the holders disagree."""
        held = [p for table in self._tables.values() for p in table]
        free = list(self._free_pages)
        if len(set(free)) != len(free):
            raise RuntimeError("CacheManager: a page is twice in the free list")
        if set(held) & set(free):
            raise RuntimeError(f"CacheManager: pages both held and free: {sorted(set(held) & set(free))}")
        if len(set(held)) + len(free) != self.num_pages:
            raise RuntimeError(
                f"CacheManager: {len(set(held))} held + {len(free)} free pages != {self.num_pages}")
        slots = list(self._slots.values())
        if len(set(slots)) != len(slots) or set(slots) & set(self._free_slots):
            raise RuntimeError("CacheManager: a state slot is held twice or held and free")
        if len(slots) + len(self._free_slots) != self.num_slots:
            raise RuntimeError("CacheManager: state slots were lost")

    def check_idle(self) -> None:
        """Raise RuntimeError with details unless every page and every slot is free."""
        self.check_consistency()
        if self._tables or self._slots:
            details = ", ".join(
                f"{req!r}: {len(self._tables.get(req, ()))} pages"
                + (f" + slot {self._slots[req]}" if req in self._slots else "")
                for req in self.holders())
            raise RuntimeError(
                f"cache not idle: {self.num_pages - self.num_free_pages}/{self.num_pages} pages and "
                f"{self.num_slots - self.num_free_slots}/{self.num_slots} slots still held ({details})")
