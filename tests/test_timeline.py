"""Interval arithmetic of the step breakdown: laws checked against a brute-force grid."""

import asyncio

from hypothesis import given, strategies as st

from rstar2_jax.core import timeline as tl

interval = st.tuples(st.integers(0, 40), st.integers(0, 40)).map(lambda p: (float(min(p)), float(max(p))))
intervals = st.lists(interval, max_size=12)


def _covered(ivs):
    """Unit cells [k, k+1) covered by some interval (integer endpoints)."""
    return {k for a, b in ivs for k in range(int(a), int(b))}


@given(intervals)
def test_union_length_counts_each_covered_instant_once(ivs):
    assert tl.union_length(ivs) == len(_covered(ivs))
    assert tl.union_length(ivs) <= sum(b - a for a, b in ivs)
    assert tl.merge(tl.merge(ivs)) == tl.merge(ivs)


@given(intervals, intervals)
def test_overlap_and_exclusive_partition_the_union(a, b):
    assert tl.overlap_length(a, b) == len(_covered(a) & _covered(b))
    assert tl.exclusive_length(a, b) == len(_covered(a) - _covered(b))
    assert tl.exclusive_length(a, b) + tl.overlap_length(a, b) == tl.union_length(a)


def test_spans_from_concurrent_tasks_land_in_the_active_timeline_only():
    async def work():
        with tl.span("tool"):
            await asyncio.sleep(0.05)

    async def main():
        t = tl.Timeline()
        with t.activate():
            await asyncio.gather(work(), work(), work())
        await work()  # after deactivation: not recorded
        return t

    t = asyncio.run(main())
    assert len(t.get("tool")) == 3
    assert 0.04 < t.union("tool") < 0.15  # three concurrent sleeps: ~one sleep of wall time
