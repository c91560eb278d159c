"""A weight sync that lands behind the trainer (`rollout.vllm.sync_wait=export`).

With `sync_wait=reload` (the default) the trainer waits for a whole sync: the export, each
server's fetch and reload, the swap. The reload is the long part (BENCHMARKS.md, "vLLM weight
sync to 2 CPU servers"), and the trainer needs none of it: once the export is written, the
learner's arrays are free for the next update. So with `sync_wait=export` the sync
(vllm_engine.push_to_servers) runs on a thread of its own and the trainer waits only until the
export is whole and the probe's reference computed (`on_exported`); the servers' fetches, the
reload, the swap and the engines' new version land behind it, beside the next update.

What stays true:
- The staleness bound: an engine's `version` moves only when its server has the weights, and
  the trainer's producer starts a step's rollouts only once the engine holds the version the
  pipeline promises them (`Engine.weights_at_least`, awaited in the trainer's draw, before its
  evaluations and after a session's first sync): rollouts wait for the reload, the update does
  not. A landing carries its version (`Landing`): the first sync's version is the engine's
  starting one, so the number alone cannot say whether it landed.
- One sync at a time: a sync settles the previous one (waits for it) before it exports.
- A failed sync is made once more, as `sync_weights` does with `reload`: from the export
  already written (report.written; the arrays may be in use again), or, when the export itself
  failed (the caller is still waiting, the arrays are still valid), from the arrays. A second
  failure is the sync's verdict: the trainer raises WeightSyncFailed at its next draw or sync.
- The previous sync's deferred probe is collected on the trainer's path before the export, so
  a mismatch raises where it does with `reload`.

One trainer process only: the other processes would learn of a landing only at their next
collective, after the draws that must wait for it (the vLLM kind's `process_refusal` refuses
more).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Sequence

from rstar2_jax.rollout.engines.base import WeightSyncFailed

if TYPE_CHECKING:
    from rstar2_jax.rollout.engines.vllm_engine import SyncReport, VLLMEngine

WAIT_MODES = ("reload", "export")  # the names of rollout.vllm.sync_wait

# one landing at a time in the process (a sync settles the previous one first)
_LANDINGS = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm-landing")


@dataclasses.dataclass(frozen=True)
class Landing:
    """A background sync of `version`: `future` is its attempts' reports (one, or two when the
    first failed), the same object on every engine of the sync."""
    version: int
    future: concurrent.futures.Future

    def landed(self) -> bool:
        """Over, and its last attempt landed."""
        return self.future.done() and self.future.exception() is None and self.future.result()[-1].ok


def push_in_background(engines: Sequence[VLLMEngine], params: Any, version: int) -> Landing:
    """Start the sync of `params` as `version` to `engines` (one export, push_to_servers) and
    return once the learner's arrays are free; the landing is set on every engine as `landing`."""
    from rstar2_jax.rollout.engines.vllm_engine import push_to_servers

    settle(engines)  # a server takes one sync at a time
    for e in engines:  # the previous sync's probe: a mismatch raises here, on the trainer's path
        e.probe_verdict()
    arrays_free = threading.Event()

    def land() -> list[SyncReport]:
        try:
            reports = [push_to_servers(engines, params, version, on_exported=arrays_free.set)]
            if not reports[0].ok:  # once more, as Engine.sync_weights does
                again = reports[0].written
                reports.append(push_to_servers(engines, None, version, again=again) if again is not None
                               else push_to_servers(engines, params, version, on_exported=arrays_free.set))
            return reports
        finally:
            arrays_free.set()

    landing = Landing(version, _LANDINGS.submit(land))
    for e in engines:
        e.landing = landing
    arrays_free.wait()
    return landing


def _landings(engines: Sequence[VLLMEngine]) -> list[Landing]:
    """The engines' last background syncs, each once."""
    return list({id(e.landing): e.landing for e in engines if e.landing is not None}.values())


def settle(engines: Sequence[VLLMEngine]) -> list[SyncReport]:
    """Wait for the engines' background syncs: the reports of their attempts, in order (empty:
    none was started). A sync that raised (not a failed sync: push_to_servers reports those)
    raises here."""
    return [report for landing in _landings(engines) for report in landing.future.result()]


async def wait_for_version(engines: Sequence[VLLMEngine], version: int) -> None:
    """Until every engine samples with weights `version` or newer: a background sync of `version`
    or older still under way is waited for (the first sync's version is the engine's starting
    one: the version alone cannot tell). Raises WeightSyncFailed when the sync that was to bring
    them failed twice."""
    while behind := [e for e in engines if e.version < version or e.landing is not None
                     and e.landing.version <= version and not e.landing.landed()]:
        pending = [landing for landing in _landings(behind) if not landing.future.done()]
        if pending:
            await asyncio.wait([asyncio.wrap_future(landing.future) for landing in pending])
            continue
        e = behind[0]
        if e.landing is not None and not e.landing.landed():
            report = e.landing.future.result()[-1]  # (or what ended it, raised)
            raise WeightSyncFailed(f"weights v{report.version} could not reach {e.url} twice in a row: "
                                   f"{report.error} (the servers answer with their previous weights; see the "
                                   "trainer's and servers' logs; the run resumes from its last checkpoint)")
        raise RuntimeError(f"{e.url} samples with v{e.version} and no sync of v{version} or newer is under way")
