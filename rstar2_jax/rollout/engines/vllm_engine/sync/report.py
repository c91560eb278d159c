"""What one sync of whole weights to a set of vLLM servers did (`SyncReport`), the export it
wrote (`WrittenExport`) and a sync landing in the background (`Landing`, sync_wait=export):
shared by the sync (vllm_engine/sync/push.py), its background landing (vllm_engine/sync/background.py),
the adapters' sync (vllm_engine/sync/adapters.py) and the engine (vllm_engine/engine.py)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Sequence

import jax

from rstar2_jax.rollout.engines.vllm_engine.sync.export import ExportPlan


@dataclasses.dataclass(frozen=True)
class WrittenExport:
    """A sync's export once every bucket is written (and the probe's reference dispatched): all a
    second attempt of the same sync needs, without the learner's arrays (vllm_engine/sync/background.py)."""
    plan: ExportPlan
    slot: str
    reference: jax.Array  # probe_logprobs: maybe still being computed
    model: Any       # its arrays may be donated by then: only its config is read (the probe's message)


@dataclasses.dataclass
class SyncReport:
    """One sync to a set of servers: its times, and the error that stopped it (None: it landed)."""
    version: int
    buckets: int
    bytes: int
    export_s: float = 0.0        # writing every bucket (streamed: the servers reload meanwhile)
    reload_s: float = 0.0        # until the last server had the last bucket (from the start)
    resumed_s: float = 0.0       # until every server generates again, on the new weights (from the start)
    paused_s: float = 0.0        # the longest time a server did not generate (its pause to its resume)
    paused_from_s: float = 0.0   # when the first server paused (from the start): staged, after every bucket is in
    probe_s: float = 0.0         # every server's log-prob probe (in parallel), after they resumed (deferred:
                                 # filled in when the last one answers, after the sync returned)
    total_s: float = 0.0         # the whole sync, as the trainer waits for it (deferred: without the probes)
    error: str | None = None
    written: WrittenExport | None = None  # the whole export, once written: what a second attempt reloads

    @property
    def ok(self) -> bool:
        return self.error is None


def finish(engines: Sequence, report: SyncReport, start: float):
    """The sync's total time, and the report on every engine (last_sync)."""
    report.total_s = time.perf_counter() - start
    for e in engines:
        e.last_sync = report


@dataclasses.dataclass(frozen=True)
class Landing:
    """A background sync of `version`: `future` is its attempts' reports (one, or two when the
    first failed), the same object on every engine of the sync. `exported`: set once an export
    of it was whole (what a second attempt can reload without the learner's arrays)."""
    version: int
    future: concurrent.futures.Future
    exported: threading.Event = dataclasses.field(default_factory=threading.Event)

    def landed(self) -> bool:
        """Over, and its last attempt landed."""
        return self.future.done() and self.future.exception() is None and self.future.result()[-1].ok

    def export_error(self) -> str | None:
        """Why its export failed before it was whole (None: it was whole, the landing goes on)."""
        return None if self.exported.is_set() else self.future.result()[-1].error
