"""The RL loop over several JAX processes (`jax.distributed`): who runs which rollouts, how the
results meet, who writes files.

Every process runs the same loop. Rollouts are split by index (process p runs rollouts p, p+P,
p+2P, ... of a step, on its own engine and sandbox), then gathered so that every process holds
the whole step in the same order; selection, advantages and the batch are then the same
everywhere, and the update is one sharded step over the global mesh. Only the primary process
(index 0) writes run files (metrics, traces, TensorBoard); checkpoints are written by all
processes together (orbax). With one process every function here is the identity.

Collectives (`gather_shares`, `barrier`) must be issued by every process in the same order. The
rollout producer of an asynchronous run interleaves with the trainer differently in each
process, so it may issue none: the pipeline marks its task with `no_collectives`, and a
collective called there raises `CollectiveInProducerError` (with one process too, so a test on
one machine catches what would deadlock several).
"""

from __future__ import annotations

import contextlib
import contextvars
import pickle
import threading
from typing import Any, Sequence, TypeVar

import jax
import numpy as np

T = TypeVar("T")


class CollectiveInProducerError(RuntimeError):
    """A collective called where the processes may not all call it in the same order."""


_NO_COLLECTIVES: contextvars.ContextVar[str | None] = contextvars.ContextVar("no_collectives", default=None)


@contextlib.contextmanager
def no_collectives(where: str | None):
    """Within this context (and the tasks it creates) collectives raise, naming `where`; None
    allows them again (a producer that has waited until the trainer is idle)."""
    token = _NO_COLLECTIVES.set(where)
    try:
        yield
    finally:
        _NO_COLLECTIVES.reset(token)


def _check_collective(name: str):
    where = _NO_COLLECTIVES.get()
    if where is not None:
        raise CollectiveInProducerError(f"{name} called in {where}: processes would issue collectives in different "
                                        "orders (a deadlock with several); gather in the consumer instead")


def count() -> int:
    """The job's trainer processes."""
    return jax.process_count()


def is_primary() -> bool:
    return jax.process_index() == 0


def my_share(n: int) -> list[int]:
    """The indices of n rollouts this process runs."""
    return list(range(jax.process_index(), n, jax.process_count()))


def gather_shares(local: Sequence[T], n: int) -> list[T]:
    """Every process's `local` results (its my_share(n), in that order) as one list of n, in the
    global order, on every process."""
    _check_collective("gather_shares")
    if jax.process_count() == 1:
        return list(local)
    from jax.experimental import multihost_utils

    payload = np.frombuffer(pickle.dumps(list(local)), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([payload.size], np.int64))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:payload.size] = payload
    blobs = multihost_utils.process_allgather(padded)
    out: list[Any] = [None] * n
    for p in range(jax.process_count()):
        share = pickle.loads(blobs[p][:int(sizes[p][0])].tobytes())
        for i, item in zip(range(p, n, jax.process_count()), share):
            out[i] = item
    return out


def barrier(name: str):
    """Wait until every process gets here (e.g. after the primary wrote a file the others read)."""
    _check_collective(f"barrier({name!r})")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


# one process: what publish() set (several: jax.distributed's key-value store holds it)
_PUBLISHED: dict[str, str] = {}
_PUBLISHED_CHANGED = threading.Condition()


def publish(key: str, value: str) -> None:
    """Set `key` to `value` for every process of the job, once, without a collective: the others
    read it when they need it (await_published), whatever they are doing meanwhile. Several
    processes: jax.distributed's key-value store (its coordination service)."""
    if jax.process_count() == 1:
        with _PUBLISHED_CHANGED:
            _PUBLISHED[key] = value
            _PUBLISHED_CHANGED.notify_all()
        return
    _distributed_client().key_value_set(key, value)


def await_published(key: str, give_up: threading.Event, poll_s: float = 1.0) -> str | None:
    """What a process published under `key`, once it is there; None once `give_up` is set (the
    caller closes). A job whose publishing process died ends the wait with the coordination
    service's error."""
    while not give_up.is_set():
        if jax.process_count() == 1:
            with _PUBLISHED_CHANGED:
                if _PUBLISHED_CHANGED.wait_for(lambda: key in _PUBLISHED, poll_s):
                    return _PUBLISHED[key]
            continue
        try:
            return _distributed_client().blocking_key_value_get(key, int(poll_s * 1000))
        except Exception as e:  # jaxlib's runtime error; a wait that timed out says DEADLINE_EXCEEDED
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
    return None


def _distributed_client():
    from jax._src import distributed  # the client orbax's multi-host code uses too; no public accessor
    if distributed.global_state.client is None:
        raise RuntimeError("several processes without jax.distributed.initialize(): nothing to publish through")
    return distributed.global_state.client


def local_copy(tree, dtype=None, shardings=None):
    """A copy of a (possibly sharded over processes) pytree of arrays for this process's engine:
    cast to `dtype` (default: kept) and placed on `shardings` (this process's devices; default:
    its first device, whole). One leaf at a time, so at most one whole tensor is in flight.

    Over several processes each leaf's gather is waited for before the next is dispatched. Without
    the wait (dispatch is asynchronous) every leaf's cast and gather were queued at once beside the
    engine's programs on the same devices, and both processes could hang in the all-gather: in the
    stacks of one hang, one process's two devices were in the gather, the other process had one
    device in it and the other device's share waiting for a free place among the 32 programs XLA's
    CPU client lets a device hold in flight. That was 1 run in 4 of tests/rl/test_own_devices.py's
    two-process test on 2 loaded cores; none in 14 with the wait.
    """
    from rstar2_jax.core.sharding import caster, gathered

    cast = caster(dtype)  # a fresh buffer, never the learner's

    def one(x, target=None):
        x = cast(x)
        if jax.process_count() > 1:
            x = jax.block_until_ready(gathered(x)).addressable_data(0)
        return x if target is None else jax.device_put(x, target)

    if shardings is None:
        return jax.tree.map(one, tree)
    return jax.tree.map(one, tree, shardings)
