"""A weight sync that lands behind the trainer (`rollout.vllm.sync_wait=export`).

With `sync_wait=reload` (the default) the trainer waits for a whole sync: the export, each
server's fetch and reload, the swap. The reload is the long part (BENCHMARKS.md, "vLLM weight
sync to 2 CPU servers"), and the trainer needs none of it: once the export is written, the
learner's arrays are free for the next update. So with `sync_wait=export` the sync
(push.push_to_servers) runs on a thread of its own and the trainer waits only until the
export is whole and the probe's reference dispatched (`on_exported`; the forward that computes it
finishes beside the next update, probe.probe_logprobs); the servers' fetches, the reload,
the swap and the engines' new version land behind it, beside the next update.

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

Several trainer processes: the export is every process's work (its gathers of tensors split
over processes), so each sync's export is made in step, as with `reload` (Engine.sync_weights:
an export that failed before it was whole is made again by all, at once). Only the primary
pushes and lands; the others learn the landing's verdict when they first need the version
(`await_landing`): the primary publishes it in the job's key-value store (jax.distributed's
coordination service, `processes.publish`), which needs no collective, so a draw of an
asynchronous run, which may issue none, can wait for it. A landing that fails after the export
was whole is made once more by the primary alone, from the written export.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from typing import Any, Sequence

from rstar2_jax.core import processes
from rstar2_jax.rollout.engines.base import WeightSyncFailed
from rstar2_jax.rollout.engines.vllm_engine.sync.report import Landing, SyncReport
from rstar2_jax.rollout.engines.vllm_engine.sync.push import push_to_servers
from rstar2_jax.rollout.engines.vllm_engine.sync.synced_server import SyncedServer


# one landing at a time in the process (a sync settles the previous one first)
_LANDINGS = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm-landing")


def push_in_background(engines: Sequence[SyncedServer], params: Any, version: int) -> Landing:
    """Start the sync of `params` as `version` to `engines` (one export, push_to_servers) and
    return once the learner's arrays are free; the landing is set on every engine as `landing`.
    Several processes: an export that fails before it is whole is not made again here (the
    processes make it again together: Engine.sync_weights), and the verdict of a landing is
    published for the others (await_landing)."""
    settle(engines)  # a server takes one sync at a time
    for e in engines:  # the previous sync's probe: a mismatch raises here, on the trainer's path
        e.probe_verdict()
    alone = processes.count() == 1
    arrays_free, whole = threading.Event(), threading.Event()

    def exported():
        whole.set()
        arrays_free.set()

    def land() -> list[SyncReport]:
        errors: list[str | None] = []  # each attempt's, for the other processes
        try:
            reports = [push_to_servers(engines, params, version, on_exported=exported)]
            if not reports[0].ok:  # once more, as Engine.sync_weights does
                again = reports[0].written
                if again is not None:
                    reports.append(push_to_servers(engines, None, version, again=again))
                elif alone:  # the caller still waits: the arrays are still the learner's
                    reports.append(push_to_servers(engines, params, version, on_exported=exported))
            errors = [r.error for r in reports]
            return reports
        except BaseException as crash:  # a bug, not a failed sync: the others must not wait for ever
            errors = [f"the landing raised {type(crash).__name__}: {crash}"]
            raise
        finally:
            arrays_free.set()
            if not alone and whole.is_set():  # the others wait for this verdict (await_landing)
                _publish_verdict(engines, version, errors)

    landing = Landing(version, _LANDINGS.submit(land), whole)
    for e in engines:
        e.landing = landing
    arrays_free.wait()
    return landing


def _verdict_key(url: str, version: int) -> str:
    return f"rstar2_jax/weights/{url}/v{version}"


def _publish_verdict(engines: Sequence[SyncedServer], version: int, errors: Sequence[str | None]) -> None:
    """The primary: what became of `version` on these engines' servers (each attempt's error,
    None: landed), for the other processes."""
    synced = {url: d for e in engines for url, d in e.synced_dirs().items()}
    verdict = json.dumps({"errors": list(errors), "synced": synced})
    for e in engines:
        processes.publish(_verdict_key(e.url, version), verdict)


def await_landing(engines: Sequence[SyncedServer], version: int) -> Landing:
    """A process that does not push, once `version`'s export was whole: a landing whose future
    ends with the primary's verdict (its attempts' errors), the engines then on `version` if it
    landed. Waited for where the version is needed (wait_for_version), as the primary's own."""
    def verdict() -> list[SyncReport]:
        published = processes.await_published(_verdict_key(engines[0].url, version), engines[0].closing)
        if published is None:
            return [SyncReport(version, 0, 0, error="closed before process 0's verdict came")]
        found = json.loads(published)
        reports = [SyncReport(version, 0, 0, error=error) for error in found["errors"]]
        if reports[-1].ok:
            for e in engines:
                e.adopt_weights(None, version, found["synced"])
        return reports

    landing = Landing(version, _LANDINGS.submit(verdict))
    landing.exported.set()
    for e in engines:
        e.landing = landing
    return landing


def _landings(engines: Sequence[SyncedServer]) -> list[Landing]:
    """The engines' last background syncs, each once."""
    return list({id(e.landing): e.landing for e in engines if e.landing is not None}.values())


def settle(engines: Sequence[SyncedServer]) -> list[SyncReport]:
    """Wait for the engines' background syncs: the reports of their attempts, in order (empty:
    none was started). A sync that raised (not a failed sync: push_to_servers reports those)
    raises here."""
    return [report for landing in _landings(engines) for report in landing.future.result()]


async def wait_for_version(engines: Sequence[SyncedServer], version: int) -> None:
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
