"""Jitted programs shared by every object of a process that is built over the same static parts.

`jax.jit(partial(f, *static))` made in an object's constructor is a new function for every
object: the second learner over the same graph and settings traces, lowers and compiles (or
reads the persistent compilation cache) every program again, though it runs the same programs.
That costs seconds per program shape, and a process often builds several: `ablate` runs its
cells one after another in one process, an evaluation builds an engine before RL and another
after it, and the tests build many learners and engines over one tiny model.

`shared_jit(f, *static, **static_kw, donate_argnums=..., static_argnames=...)` is the one jitted
`partial(f, *static, **static_kw)` of the process for those parts and options, so a later
object's calls hit the jit's in-memory cache. The static parts must be hashable and equal exactly
when they give the same program: an nnx GraphDef (by value), frozen settings dataclasses (by
value), an optax transformation (by identity: `learner.optimizer.make_optimizer` returns the same
one for the same settings). Nothing else may reach the traced function except its arguments.

The JaxEngine's four kernels close over its graph and model config; they are shared the same
way, as one object per (graph, config): rollout/engines/jax_engine/kernels.engine_kernels.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax


@functools.lru_cache(maxsize=256)  # a bound on what a long process keeps compiled (tiny programs in tests)
def _jitted(fn: Callable, static: tuple, static_kw: tuple, donate_argnums: tuple, static_argnames: tuple):
    return jax.jit(functools.partial(fn, *static, **dict(static_kw)), donate_argnums=donate_argnums,
                   static_argnames=static_argnames)


def shared_jit(fn: Callable, *static: Any, donate_argnums: tuple[int, ...] = (),
               static_argnames: tuple[str, ...] = (), **static_kw: Any):
    """`jax.jit(partial(fn, *static, **static_kw), donate_argnums=, static_argnames=)`, one per
    process for equal arguments. donate_argnums count the arguments after `static`."""
    return _jitted(fn, static, tuple(sorted(static_kw.items())), tuple(donate_argnums), tuple(static_argnames))
