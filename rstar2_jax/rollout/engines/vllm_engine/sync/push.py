"""One sync of whole weights to a set of vLLM servers (`push_to_servers`): one export, written
bucket by bucket (vllm_engine/sync/export.py), reloaded by every server (their `SyncWay` says from where,
their `Reload` when), rolled back everywhere if any server fails, then probed (vllm_engine/sync/probe.py).
VLLMEngine.update_weights calls it for one server, SharedExport (vllm_engine/sync/shared_export.py) for several,
vllm_engine/sync/background.py behind the trainer.

The learner's parameters are written as HF-named safetensors bucket by bucket (under /dev/shm
where it exists, in one of two directories used in turn). With `reload="staged"` (the default) the servers generate on
while every bucket is written (and, for sync=pull, copied by their fetchers), then each is
paused (in-flight requests kept, with their KV), reloads the whole export in one
`reload_weights` call (/collective_rpc), has its prefix cache reset (cached KV was computed by
the old weights) and its weight version bumped, and resumes: it stops only for its reload. That
is as close to an in-flight swap as vLLM 0.32 allows: a utility call such as collective_rpc runs
in the EngineCore's busy loop between two engine steps (`EngineCore._process_input_queue`,
vllm/v1/engine/core.py), so no decode step runs during a reload whether paused or not, and the
pause (`pause_generation(mode="keep")`) only keeps steps from running between the reload and the
version's bump, so that no token is stamped with the old version but sampled by the new weights.
`reload="streamed"` reloads each bucket while the next is written (pausing from the first reload):
a shorter sync where each server has cores of its own, a longer pause. A sync that fails
part-way puts the previous export back and keeps the old version (SyncReport). Then
a probe checks the result rather than trusting it: vLLM's prompt log-probs of a fixed token
sequence must match the JAX model's within `probe_tolerance`. This catches the tied-embedding
trap (vLLM's reload updates a tied embedding but keeps the old output layer) and any other
silently ignored tensor. With `probe="deferred"` (the default) the probes run after the sync
returns, beside the next step's rollouts, and their verdict is collected at the next sync (or by
the first request after it arrives): a failed probe raises WeightSyncError then, one step later,
instead of holding the trainer for the probes every step (`probe="wait"`)."""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
import time
from typing import Any, Callable, Sequence

import jax

from rstar2_jax.rollout.engines.vllm_engine.sync.report import SyncReport, WrittenExport, finish
from rstar2_jax.rollout.engines.vllm_engine.sync.probe import probe_logprobs, start_probes
from rstar2_jax.rollout.engines.vllm_engine.sync.export import Bucket, param_arrays, take_part
from rstar2_jax.rollout.engines.vllm_engine.sync.synced_server import SyncedServer

log = logging.getLogger(__name__)


class _Abandoned(Exception):
    """A bucket a server did not load because another load of the same sync had failed."""


def push_to_servers(engines: Sequence[SyncedServer], params: Any, version: int, *,
                    on_exported: Callable[[], None] | None = None, again: WrittenExport | None = None) -> SyncReport:
    """One sync to every server of `engines` of what their payload moves (vllm_engine/sync/payloads.py: the
    whole weights, push_weights; a LoRA run's adapters, adapters.push_adapters). The previous
    sync's deferred probe is collected first: a failed one raises WeightSyncError before any export."""
    for e in engines:
        e.probe_verdict()
    return engines[0].payload.push(engines, params, version, on_exported=on_exported, again=again)


def push_weights(engines: Sequence[SyncedServer], params: Any, version: int, *,
                 on_exported: Callable[[], None] | None = None, again: WrittenExport | None = None) -> SyncReport:
    """The learner's weights to every server: one export, bucket by bucket (vllm_engine/sync/export.py).
    Staged (the engines' `reload`, the default): every bucket is written (sync=pull: and copied by
    each server's fetcher) while the servers generate; then each server pauses for one reload of
    the whole export and resumes. Streamed: each bucket is reloaded by every server as soon as it
    is written, so a sync costs about the slowest server's reload, not an export plus a reload,
    and a server pauses right before its first reload. Then every server's log-prob probe: waited
    for (probe="wait"), or left running beside the next rollouts with its verdict collected at
    the next sync (probe="deferred"; VLLMEngine.probe_verdict).

    A sync that fails part-way (a server that errs or dies) leaves every server on its last
    whole weights and version: the ones that took new buckets reload the previous export. The
    error is logged and returned (SyncReport.error, and each engine's sync_failures); the
    servers go on answering, and the caller retries with the next sync.

    `on_exported` is called once the export is whole and the probe's reference dispatched: the
    learner's arrays may be donated (the reference's pending read holds them until it is done),
    and the rest may finish behind the caller
    (vllm_engine/sync/background.py; a sync that fails before calls it never). `again`: a second attempt that
    reloads that written export (report.written) instead of writing one (params unused)."""
    push = _Push(engines, params, version, again)
    try:
        push.write_and_load(on_exported)
        push.reload_whole()
        for e in engines:
            e.publish(version)
    except Exception as err:  # noqa: BLE001 - any failure: every server back on its last weights
        push.roll_back(err)
    finally:
        push.resume_servers()
    if push.report.ok:
        push.commit()
    finish(engines, push.report, push.start)
    push.log_outcome()
    return push.report


class _Push:
    """One push_weights: its export, the servers' queues (one each: a server reloads the buckets
    in order, bucket k while k+1 is written) and what happened, for the steps below."""

    def __init__(self, engines: Sequence[SyncedServer], params: Any, version: int, again: WrittenExport | None):
        self.engines, self.version, self.again = list(engines), version, again
        self.lead = lead = engines[0]
        self.staged = not lead.reload.reloads_each_bucket
        self.reference: jax.Array | None  # the probe's reference: the learner's log-probs of the probe (dispatched)
        if again is None:  # an export to write: into the slot not holding the last whole one
            self.model = lead.as_model(params)
            self.plan, self.arrays, self.reference = lead.export_plan(self.model), param_arrays(self.model), None
            self.slot = lead.slots.begin(self.plan)
        else:  # the first attempt's export, whole: reloaded as it is (no array is read)
            self.model, self.plan, self.arrays, self.reference, self.slot = (again.model, again.plan, {},
                                                                             again.reference, again.slot)
        self.report = SyncReport(version, len(self.plan.buckets), self.plan.nbytes)
        self.start = time.perf_counter()
        self.paused: dict[SyncedServer, float] = {}  # server -> when it paused (written by that server's queue)
        self.failed: list[BaseException] = []      # the errors of servers' loads; one is enough to end the sync
        self.landed: dict[SyncedServer, str] = {}  # server -> the whole export as its server holds it
        self.written = 0 if again is None else len(self.plan.buckets)  # buckets whose gathers this process took part in
        self.queues = {e: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm-sync") for e in engines}

    def _pause(self, e: SyncedServer):
        if e not in self.paused:  # it generated until now: only its reloads need it paused
            e.pause()
            self.paused[e] = time.perf_counter()

    def _load(self, e: SyncedServer, bucket: Bucket, bucket_dir: str):
        """One server's part of one bucket, on that server's queue (so in bucket order): staged,
        only its copy (pull); streamed, its reload too."""
        if self.failed:
            raise _Abandoned()  # no server loads more of a sync that is failing: it is rolled back
        try:
            source = e.way.bucket_source(e, self.slot, bucket, bucket_dir, self.version)
            if not self.staged:
                self._pause(e)
                e.reload_part(source)
        except BaseException as err:
            self.failed.append(err)
            raise

    def _reload(self, e: SyncedServer, whole: str):
        """Staged: the server stops for one reload of the whole export."""
        try:
            self._pause(e)
            e.reload_part(whole)
        except BaseException as err:
            self.failed.append(err)
            raise

    def write_and_load(self, on_exported: Callable[[], None] | None):
        """Every bucket written (unless `again`) and handed to every server's queue; the probe's
        reference dispatched; `on_exported` once the export is whole; every queue done."""
        plan, lead = self.plan, self.lead
        pending: list[concurrent.futures.Future] = []
        for bucket in plan.buckets:
            if self.again is None:
                self.written = bucket.index + 1  # write() takes part in all of its bucket's gathers, even failing
                lead.slots.write(self.slot, bucket, self.arrays)
            bucket_dir = lead.slots.bucket_dir(self.slot, bucket)
            pending += [self.queues[e].submit(self._load, e, bucket, bucket_dir) for e in self.engines]
            if self.failed:
                break  # a server already failed: stop writing
        self.report.export_s = time.perf_counter() - self.start
        export_whole = self.written == len(plan.buckets)  # every bucket written (again: by the first attempt)
        take_part(plan, self.arrays, start=self.written)  # writing stopped early: the other processes' gathers go on
        self.written = len(plan.buckets)
        # while the servers reload; after every gather, the order of collectives of take_part_in_sync
        if self.reference is None:  # dispatched: it finishes beside what follows (probe_logprobs)
            self.reference = probe_logprobs(self.model, lead.probe_tokens)
        if export_whole:
            self.report.written = WrittenExport(plan, self.slot, self.reference, self.model)
            if on_exported is not None:
                on_exported()  # the learner's arrays are free: the rest may run behind the caller
        concurrent.futures.wait(pending)
        if self.failed:
            raise self.failed[0]

    def reload_whole(self):
        """Staged, every bucket in: each server stops once, for its reload of the whole export."""
        self.landed = {e: e.way.landed_dir(e, self.slot, self.version) for e in self.engines}
        if self.staged:
            concurrent.futures.wait([self.queues[e].submit(self._reload, e, self.landed[e]) for e in self.engines])
            if self.failed:
                raise self.failed[0]
        self.report.reload_s = time.perf_counter() - self.start
        self.report.paused_from_s = min(self.paused.values()) - self.start

    def roll_back(self, err: Exception):
        """A failure anywhere: this process's collectives completed, every paused server back on
        its last whole export."""
        report = self.report
        report.error = f"{type(err).__name__}: {err}"
        take_part(self.plan, self.arrays, start=self.written)  # the other processes gather every tensor: so must this one
        if self.reference is None:  # ... and then the probe's reference (its collectives, in that order)
            try:
                probe_logprobs(self.model, self.lead.probe_tokens)
            except Exception as probe_err:  # noqa: BLE001 - the roll-back below must still run
                log.error("the probe's reference failed too (%s)", probe_err)
        log.error("weight sync v%d failed (%s); the servers keep their weights (v%s)", self.version, report.error,
                  ", v".join(str(e.version) for e in self.engines))
        for q in self.queues.values():  # no bucket reload may still run beside the roll-back
            q.shutdown(wait=True, cancel_futures=True)
        for e in self.engines:
            e.sync_failures += 1
        for e in self.paused:  # only a paused server may hold some of the new buckets
            try:
                e.roll_back()
            except Exception as undo:  # noqa: BLE001 - it is restored when it answers again
                log.error("%s: could not reload its previous weights (%s); restored when it answers", e.url, undo)

    def resume_servers(self):
        for q in self.queues.values():
            q.shutdown(wait=True, cancel_futures=True)
        for e, since in self.paused.items():
            try:
                e.resume()
            except Exception as err:  # noqa: BLE001
                log.error("%s: resume failed (%s)", e.url, err)
            self.report.paused_s = max(self.report.paused_s, time.perf_counter() - since)
        self.report.resumed_s = time.perf_counter() - self.start

    def commit(self):
        """The sync landed: the export kept (or each server's own copy), the version taken, the probes started."""
        if all(e.way.keeps_own_copy for e in self.engines):
            shutil.rmtree(self.slot, ignore_errors=True)  # every server holds its fetcher's copy
        else:
            self.lead.slots.commit(self.slot)
        for e in self.engines:
            e.landed(self.landed[e], self.version)
        start_probes(self.engines, self.model, self.reference, self.report)

    def log_outcome(self):
        report, lead = self.report, self.lead
        log.info("synced weights v%d to %d server(s) in %d bucket(s), %s: %.2f s (export %.2f s, reloaded at %.2f s, "
                 "generating again at %.2f s after a pause of at most %.2f s from %.2f s, probes %s)%s", self.version,
                 len(self.engines), report.buckets, lead.reload.value, report.total_s, report.export_s,
                 report.reload_s, report.resumed_s, report.paused_s, report.paused_from_s,
                 f"{report.probe_s:.2f} s" if lead.probe.waited_for else "deferred",
                 "" if report.ok else f"; FAILED: {report.error}")
