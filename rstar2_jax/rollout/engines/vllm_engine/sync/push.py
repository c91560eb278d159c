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
    whole weights, push_weights; a LoRA run's adapters, adapter_sync.push_adapters). The previous
    sync's deferred probe is collected first: a failed one raises WeightSyncError before any export."""
    for e in engines:
        e.probe_verdict()
    return engines[0].payload.push(engines, params, version, on_exported=on_exported, again=again)


def push_weights(engines: Sequence[SyncedServer], params: Any, version: int, *,
                    on_exported: Callable[[], None] | None = None, again: WrittenExport | None = None) -> SyncReport:
    """The learner's weights to every server: one export, bucket by bucket (vllm_engine/sync/export.py).
    Staged (the engines' `swap`, the default): every bucket is written (sync=pull: and copied by
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
    lead = engines[0]
    staged = not lead.reload.reloads_each_bucket
    reference: jax.Array | None  # the probe's reference: the learner's log-probs of the probe (dispatched)
    if again is None:  # an export to write: into the slot not holding the last whole one
        model = lead.as_model(params)
        plan, arrays, reference = lead.export_plan(model), param_arrays(model), None
        slot = lead.slots.begin(plan)
    else:  # the first attempt's export, whole: reloaded as it is (no array is read)
        model, plan, arrays, reference, slot = again.model, again.plan, {}, again.reference, again.slot
    report = SyncReport(version, len(plan.buckets), plan.nbytes)
    start = time.perf_counter()
    paused: dict[SyncedServer, float] = {}  # server -> when it paused (each entry written by that server's queue)
    failed: list[BaseException] = []      # the errors of servers' loads; one is enough to end the sync

    def pause(e):
        if e not in paused:  # it generated until now: only its reloads need it paused
            e.pause()
            paused[e] = time.perf_counter()

    def load(e, bucket: Bucket, bucket_dir: str):
        """One server's part of one bucket, on that server's queue (so in bucket order): staged,
        only its copy (pull); streamed, its reload too."""
        if failed:
            raise _Abandoned()  # no server loads more of a sync that is failing: it is rolled back
        try:
            source = e.way.bucket_source(e, slot, bucket, bucket_dir, version)
            if not staged:
                pause(e)
                e.reload_part(source)
        except BaseException as err:
            failed.append(err)
            raise

    def swap(e, whole: str):
        """Staged: the server stops for one reload of the whole export."""
        try:
            pause(e)
            e.reload_part(whole)
        except BaseException as err:
            failed.append(err)
            raise

    landed: dict[SyncedServer, str] = {}  # server -> the whole export as its server holds it
    written = 0 if again is None else len(plan.buckets)  # buckets whose gathers this process took part in
    queues = {e: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm-sync") for e in engines}
    try:
        # one queue per server: it reloads the buckets in order, bucket k while k+1 is written
        pending: list[concurrent.futures.Future] = []
        for bucket in plan.buckets:
            if again is None:
                written = bucket.index + 1  # write() takes part in all of its bucket's gathers, even failing
                lead.slots.write(slot, bucket, arrays)
            bucket_dir = lead.slots.bucket_dir(slot, bucket)
            pending += [queues[e].submit(load, e, bucket, bucket_dir) for e in engines]
            if failed:
                break  # a server already failed: stop writing
        report.export_s = time.perf_counter() - start
        export_whole = written == len(plan.buckets)  # every bucket written (again: by the first attempt)
        take_part(plan, arrays, start=written)  # writing stopped early: the other processes' gathers go on
        written = len(plan.buckets)
        # while the servers reload; after every gather, the order of collectives of take_part_in_sync
        if reference is None:  # dispatched: it finishes beside what follows (probe_logprobs)
            reference = probe_logprobs(model, lead.probe_tokens)
        if export_whole:
            report.written = WrittenExport(plan, slot, reference, model)
            if on_exported is not None:
                on_exported()  # the learner's arrays are free: the rest may run behind the caller
        concurrent.futures.wait(pending)
        if failed:
            raise failed[0]
        landed = {e: e.way.landed_dir(e, slot, version) for e in engines}
        if staged:  # every bucket is in: each server stops once, for its reload
            concurrent.futures.wait([queues[e].submit(swap, e, landed[e]) for e in engines])
            if failed:
                raise failed[0]
        report.reload_s = time.perf_counter() - start
        report.paused_from_s = min(paused.values()) - start
        for e in engines:
            e.publish(version)
    except Exception as err:  # noqa: BLE001 - any failure: every server back on its last weights
        report.error = f"{type(err).__name__}: {err}"
        take_part(plan, arrays, start=written)  # the other trainer processes gather every tensor: so must this one
        if reference is None:  # ... and then the probe's reference (its collectives, in that order)
            try:
                probe_logprobs(model, lead.probe_tokens)
            except Exception as probe_err:  # noqa: BLE001 - the roll-back below must still run
                log.error("the probe's reference failed too (%s)", probe_err)
        log.error("weight sync v%d failed (%s); the servers keep their weights (v%s)", version, report.error,
                  ", v".join(str(e.version) for e in engines))
        for q in queues.values():  # no bucket reload may still run beside the roll-back
            q.shutdown(wait=True, cancel_futures=True)
        for e in engines:
            e.sync_failures += 1
        for e in paused:  # only a paused server may hold some of the new buckets
            try:
                e.roll_back()
            except Exception as undo:  # noqa: BLE001 - it is restored when it answers again
                log.error("%s: could not reload its previous weights (%s); restored when it answers", e.url, undo)
    finally:
        for q in queues.values():
            q.shutdown(wait=True, cancel_futures=True)
        for e, since in paused.items():
            try:
                e.resume()
            except Exception as err:  # noqa: BLE001
                log.error("%s: resume failed (%s)", e.url, err)
            report.paused_s = max(report.paused_s, time.perf_counter() - since)
        report.resumed_s = time.perf_counter() - start
    if report.ok:
        if all(e.way.keeps_own_copy for e in engines):
            shutil.rmtree(slot, ignore_errors=True)  # every server holds its fetcher's copy
        else:
            lead.slots.commit(slot)
        for e in engines:
            e.landed(landed[e], version)
        start_probes(engines, model, reference, report)
    finish(engines, report, start)
    log.info("synced weights v%d to %d server(s) in %d bucket(s), %s: %.2f s (export %.2f s, reloaded at %.2f s, "
             "generating again at %.2f s after a pause of at most %.2f s from %.2f s, probes %s)%s", version,
             len(engines), report.buckets, lead.reload.value, report.total_s, report.export_s, report.reload_s,
             report.resumed_s, report.paused_s, report.paused_from_s,
             f"{report.probe_s:.2f} s" if lead.probe.waited_for else "deferred",
             "" if report.ok else f"; FAILED: {report.error}")
    return report
