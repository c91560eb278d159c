"""Issue 82: module paths of earlier versions (the prefixes that became packages) fail on import
with the new path named (sandbox/moved_modules.py), and every new path exists."""

import importlib
import importlib.util
import subprocess
import sys

import pytest

import rstar2_jax  # noqa: F401 - installs rstar2_jax's table
from sandbox import moved_modules

TABLES = [f for f in sys.meta_path if isinstance(f, moved_modules.MovedModules)]
MOVED = sorted((old, new) for table in TABLES for old, new in table.moved.items())


def test_both_packages_install_their_table():
    assert sorted(t.package for t in TABLES) == ["rstar2_jax", "sandbox"]


@pytest.mark.parametrize("old, new", MOVED, ids=[old for old, _ in MOVED])
def test_an_old_path_fails_naming_the_new_one_which_exists(old, new):
    assert importlib.util.find_spec(new) is not None, f"{old} is said to be at {new}, which does not exist"
    with pytest.raises(ModuleNotFoundError, match=f"{old} has moved: import {new} instead"):
        importlib.import_module(old)


def test_an_old_from_import_in_a_fresh_process_names_the_new_path():
    """As a user's script meets it (`from sandbox.redis_client import ...` of the README before)."""
    out = subprocess.run([sys.executable, "-c", "from sandbox.redis_client import RedisSandbox"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "sandbox.redis_client has moved: import sandbox.redis_queue.client" in out.stderr


def test_a_module_that_exists_is_never_answered_by_the_table():
    """The finder sits at the end of sys.meta_path: a real module (the packages named like the old
    modules, rollout.engines.jax_engine and sandbox.zygote) imports."""
    assert importlib.import_module("rstar2_jax.rollout.engines.jax_engine").__name__.endswith("jax_engine")
    assert importlib.import_module("sandbox.zygote").__path__
