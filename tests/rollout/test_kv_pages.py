"""The page allocator's laws, under any sequence of calls."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rstar2_jax.rollout.engines.jax_engine.kv_pages import PagePool, pages_for

OWNERS = st.sampled_from(["a", "b", "c", ("row", 0), ("resident", "s")])
OPS = st.lists(st.one_of(
    st.tuples(st.just("grow"), OWNERS, st.integers(0, 6)),
    st.tuples(st.just("transfer"), OWNERS, OWNERS),
    st.tuples(st.just("truncate"), OWNERS, st.integers(0, 6)),
    st.tuples(st.just("release"), OWNERS),
), max_size=60)


@given(st.integers(1, 12), OPS)
def test_every_page_is_free_or_held_by_exactly_one_owner_in_order(num_pages, ops):
    pool = PagePool(num_pages)
    model: dict = {}  # owner -> pages, what the calls must have done
    for op, owner, *arg in ops:
        if op == "grow":
            if arg[0] > pool.free:
                with pytest.raises(MemoryError):
                    pool.grow(owner, arg[0])
            else:
                before = pool.free
                pool.grow(owner, arg[0])
                new = pool.held(owner)[len(model.get(owner, [])):]
                assert len(new) == arg[0] and pool.free == before - arg[0]
                if new:
                    model.setdefault(owner, []).extend(new)
        elif op == "transfer":
            target = arg[0]
            if target in model:
                with pytest.raises(ValueError):
                    pool.transfer(owner, target)
            else:
                pool.transfer(owner, target)
                if owner in model:
                    model[target] = model.pop(owner)
        elif op == "truncate":
            pool.truncate(owner, arg[0])
            if owner in model:
                model[owner] = model[owner][:arg[0]]
                if not model[owner]:
                    del model[owner]
        else:
            assert pool.release(owner) == len(model.pop(owner, []))
        # the laws: held lists are what the calls built, in order; no page twice; none lost
        assert {o: pool.held(o) for o in pool.owners()} == model
        held = [p for pages in model.values() for p in pages]
        assert len(held) == len(set(held)) and all(0 <= p < num_pages for p in held)
        assert pool.free + len(held) == num_pages


@given(st.integers(0, 1000), st.integers(1, 64))
def test_pages_for_is_the_fewest_pages_that_cover_the_tokens(tokens, page_size):
    n = pages_for(tokens, page_size)
    assert n * page_size >= tokens and (n - 1) * page_size < tokens or n == 0 == tokens


def test_an_empty_pool_is_refused():
    with pytest.raises(ValueError, match="at least one page"):
        PagePool(0)
