"""The suite's XLA flags (tests/xla_flags.py): every worker compiles with them, the compute-bound
subprocesses drop them and keep any other flag."""

import os

from hypothesis import given
from hypothesis import strategies as st

from tests.xla_flags import FAST_COMPILE, compute_bound_env, xla_flags

OTHER_FLAGS = st.lists(st.sampled_from(["--xla_force_host_platform_device_count=8", "--xla_dump_to=/tmp/x",
                                        *FAST_COMPILE]), max_size=5)


def test_this_worker_compiles_with_the_fast_compile_flags():
    assert set(FAST_COMPILE) <= set(os.environ["XLA_FLAGS"].split())  # set by the controller (tests/conftest.py)


@given(OTHER_FLAGS)
def test_xla_flags_holds_each_flag_once_and_adding_them_again_changes_nothing(flags):
    once = xla_flags(*flags)
    assert xla_flags(*once.split()) == once
    assert sorted(once.split()) == sorted(set(FAST_COMPILE) | set(flags))


@given(OTHER_FLAGS)
def test_a_compute_bound_subprocess_keeps_every_other_flag(flags):
    old = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = xla_flags(*flags)
    try:
        env = compute_bound_env(JAX_PLATFORMS="cpu")
    finally:
        os.environ.pop("XLA_FLAGS") if old is None else os.environ.__setitem__("XLA_FLAGS", old)
    kept = [f for f in dict.fromkeys(flags) if f not in FAST_COMPILE]
    assert env.get("XLA_FLAGS", "").split() == kept and env["JAX_PLATFORMS"] == "cpu"
