"""What the suite's shared compilation cache relies on (tests/conftest.py): it runs without JAX's
size cap, so without its file lock, and a process may read an entry that another is still
writing. JAX must take such an entry as a miss (warn, compile, give the right result), never
crash or run a broken program."""

import os
import subprocess
import sys

_SCRIPT = """
import os, sys, warnings
import jax, jax.numpy as jnp

cache = sys.argv[1]
f = lambda x: jnp.sin(x) * 2.0 + x
want = float(jax.jit(f)(1.5))
entries = [e for e in os.listdir(cache) if e.endswith("-cache")]
assert entries, os.listdir(cache)
for e in entries:  # every entry cut in half, as a reader sees one mid-write (and one still empty)
    path = os.path.join(cache, e)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2] if e != entries[0] else b"")
jax.clear_caches()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = float(jax.jit(f)(1.5))
assert got == want, (got, want)
assert any("Error reading persistent compilation cache entry" in str(w.message) for w in caught), \\
    [str(w.message) for w in caught]
print("ok")
"""


def test_an_entry_read_mid_write_is_a_miss_that_compiles_again(tmp_path):
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


_RELEASE_SCRIPT = """
import jax.numpy as jnp
from rstar2_jax.core.shared_jit import shared_jit
from tests.compiled_programs import memory_maps, release_if_crowded

def program(i, x):
    return (jnp.sin(x) * i + jnp.cos(x).sum()) @ x

before = memory_maps()
outs = [shared_jit(program, i)(jnp.ones((8, 8))) for i in range(120)]  # kept by shared_jit's cache
compiled = memory_maps()
assert release_if_crowded(limit=4 * compiled + 4) is None  # under a quarter of the limit: kept
kept = memory_maps()
assert release_if_crowded(limit=2 * compiled + 2) is None  # over a quarter: released, under half after
print(before, compiled, kept, memory_maps())
"""


def test_releasing_compiled_programs_unmaps_their_code():
    """What the suite does between modules (tests/compiled_programs.py): programs kept alive by
    shared_jit hold memory maps; under a quarter of the limit they are kept, over it releasing
    them gives the maps back."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    done = subprocess.run([sys.executable, "-c", _RELEASE_SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**env, "JAX_PLATFORMS": "cpu"}, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-3000:]
    before, compiled, kept, released = map(int, done.stdout.split())
    assert compiled - before >= 5 * 120, (before, compiled)  # the maps that pile up in a long process
    assert kept >= compiled - 20, (compiled, kept)
    assert released - before <= 0.1 * (compiled - before), (before, compiled, released)
