"""CacheManager: pages grow with tokens, exact freeing, slots, idle check."""

import pytest

from dsv4.cache.manager import CacheManager


def test_pages_grow_with_tokens_not_with_a_maximum() -> None:
    m = CacheManager(num_pages=10, page_size=4, num_slots=2)
    assert m.ensure("a", 1) and m.num_pages_held("a") == 1
    assert m.ensure("a", 4) and m.num_pages_held("a") == 1
    assert m.ensure("a", 5) and m.num_pages_held("a") == 2
    assert m.ensure("a", 3) and m.num_pages_held("a") == 2  # never shrinks
    assert m.num_free_pages == 8
    assert m.usage == pytest.approx(0.2)
    assert m.block_table("a") == [0, 1]
    m.free("a")
    m.check_idle()


def test_ensure_fails_without_partial_allocation() -> None:
    m = CacheManager(num_pages=3, page_size=2, num_slots=2)
    assert m.ensure("a", 4)
    assert not m.can_allocate(4, "b")
    assert not m.ensure("b", 4)  # needs 2 pages, 1 free
    assert m.num_pages_held("b") == 0 and m.num_free_pages == 1
    assert m.can_allocate(6, "a") and m.pages_needed("a", 6) == 1
    assert m.ensure("b", 2)
    assert set(m.block_table("a")) | set(m.block_table("b")) == {0, 1, 2}
    m.free("a")
    m.free("b")
    m.check_idle()


def test_slots_are_unique_and_returned() -> None:
    m = CacheManager(num_pages=4, page_size=2, num_slots=2)
    s0 = m.allocate_slot("a")
    assert m.allocate_slot("a") == s0  # idempotent
    s1 = m.allocate_slot("b")
    assert {s0, s1} == {0, 1}
    with pytest.raises(RuntimeError, match="no free state slot"):
        m.allocate_slot("c")
    m.free("a")
    assert m.allocate_slot("c") == s0
    with pytest.raises(KeyError, match="'a'"):
        m.slot("a")
    m.free("b")
    m.free("c")
    m.free("never-seen")  # no-op
    m.check_idle()


def test_check_idle_names_the_holders() -> None:
    m = CacheManager(num_pages=4, page_size=2, num_slots=2)
    m.ensure("req-7", 3)
    m.allocate_slot("req-7")
    with pytest.raises(RuntimeError, match=r"2/4 pages.*1/2 slots.*req-7"):
        m.check_idle()
    m.free("req-7")
    m.check_idle()


def test_pages_recycled_many_times_stay_consistent() -> None:
    m = CacheManager(num_pages=7, page_size=3, num_slots=3)
    live: dict[int, int] = {}
    for step in range(300):
        rid = step % 5
        if rid in live and step % 3 == 0:
            m.free(rid)
            del live[rid]
        else:
            want = live.get(rid, 0) + (step % 4) + 1
            if m.ensure(rid, want):
                live[rid] = want
        m.check_consistency()
        assert sum(m.pages_for(n) for n in live.values()) == 7 - m.num_free_pages
    for rid in list(live):
        m.free(rid)
    m.check_idle()


@pytest.mark.parametrize("kw", [dict(num_pages=0, page_size=4, num_slots=1),
                                dict(num_pages=4, page_size=-1, num_slots=1),
                                dict(num_pages=4, page_size=4, num_slots=0)])
def test_bad_sizes_are_rejected(kw: dict) -> None:
    bad = [k for k, v in kw.items() if v <= 0][0]
    with pytest.raises(ValueError, match=bad):
        CacheManager(**kw)
