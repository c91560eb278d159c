"""A long test process must not keep every program it ever compiled: each one holds memory maps.

XLA:CPU loads each compiled program's machine code with LLVM's JIT, which maps its sections
(~8.9 maps per program of the tiny model's kind, measured); they stay mapped while the program is
cached, and jit caches live as long as the process. An xdist worker runs hundreds of tests for
half an hour, so the maps pile up towards the kernel's per-process limit (`vm.max_map_count`,
65,530 by default). Past it, LLVM cannot map the next program and aborts the whole process
("LLVM ERROR: Unable to allocate section memory!"): the worker dies mid-test. Reproduced with the
limit lowered to 6,000: a process compiling distinct programs aborted between its 600th and
800th. In the suite (stop 61's code, run locally) a worker reached 65,100 maps and died in a
compile; CI's run lost a worker in test_jax_engine inside the compilation cache's write, which
loads the program's code a second time to serialise it (its message was not captured).

So when a worker moves on to another test module holding over a quarter of the limit, it
releases every compiled program (tests/conftest.py), and says so clearly if it still holds half
the limit afterwards. Programs a later module needs again come back from the persistent
compilation cache. Not at every module: a release costs ~1.5 s (measured: 169 worker-seconds over
a whole suite run that released at every module, against 2 without), and a worker reaches a
quarter of the limit a few times per run (peak 65,100 maps without releases).
"""

from __future__ import annotations

import gc
import os
import sys


def memory_maps() -> int:
    """How many memory maps this process holds (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


DEFAULT_MAP_LIMIT = 65530  # Linux's default vm.max_map_count


def map_limit() -> int | None:
    """The kernel's per-process limit on memory maps (Linux's default where a container hides it),
    None without /proc (no maps to count)."""
    if not os.path.exists("/proc/self/maps"):
        return None
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return DEFAULT_MAP_LIMIT


def release_compiled_programs() -> None:
    """Drop every compiled program of this process (jit caches, shared_jit's included: the jitted
    functions stay, their executables go) so their code is unmapped."""
    jax = sys.modules.get("jax")
    if jax is None:
        return
    jax.clear_caches()
    gc.collect()


def release_if_crowded(limit: int | None = None) -> str | None:
    """Release this process's compiled programs when it holds over a quarter of the map `limit`
    (default: the kernel's); a message when over half is still held afterwards, else None."""
    limit = limit or map_limit()
    if not limit or memory_maps() <= limit // 4:
        return None
    release_compiled_programs()
    return headroom_problem(limit)


def headroom_problem(limit: int) -> str | None:
    """A message when this process holds more than half the map `limit`, else None."""
    held = memory_maps()
    if held <= limit // 2:
        return None
    return (f"this test process holds {held} memory maps, over half of vm.max_map_count={limit}, "
            "after releasing its compiled programs: LLVM aborts the process when a compile needs maps "
            "past the limit (tests/compiled_programs.py); something keeps programs or maps alive")
