"""VLLMEngine: the rollout engine as a client of a vLLM OpenAI-compatible server.

Same interface as JaxEngine (`generate`, `update_weights`, `version`), so the agent loop, the
evaluation and the trainer do not know which engine they talk to.

Token in, token out: prompts go as token ids to /v1/completions and the choice's `token_ids`
and `logprobs.token_logprobs` come back; text is never re-tokenized. The server runs with
`--logprobs-mode processed_logprobs` (vllm_engine/server.py): log-probs at the sampling temperature,
what the learner recomputes. (With top-k/top-p vLLM renormalizes over the kept tokens, unlike
JaxEngine; RL sampling uses neither.)

Weight sync (`update_weights`): the learner's weights are exported as HF-named safetensors and
reloaded by the server while it keeps its requests in flight, then probed (vllm_engine/sync/push.py, whose
docstring tells the steps; vllm_engine/sync/probe.py; the modes in vllm_engine/modes.py). Requests in flight during
a sync continue with the new weights (partial rollouts, for asynchronous RL). The server does not
say which tokens came before the swap, so a completion's tokens all count as `version_start`: the
oldest weights that can have sampled them, which keeps the trainer's staleness bound safe
(JaxEngine records the exact version per token).

A dead or restarting server loses nothing: a request that fails on the connection (or with a
5xx) is sent again once the server answers, after the latest weights are reloaded into it (a
restarted server starts from the model directory it was launched with). Nothing is appended to
a trajectory until a completion arrives whole, so a retried turn is neither lost, duplicated
nor truncated. A server that stays down past `restart_timeout` raises ServerUnavailable, which
the scheduler answers by sending the request to another engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import threading
import time
from typing import Any, Hashable, Sequence

import jax
import numpy as np
from flax import nnx

from rstar2_jax.core import processes
from rstar2_jax.models.checkpoint import save_pretrained
from rstar2_jax.models.decoder import Decoder
from rstar2_jax.models import lora
from rstar2_jax.models.lora import LoRAConfig
from rstar2_jax.rollout.engines.vllm_engine.sync import adapters as adapter_sync
from rstar2_jax.rollout.engines.vllm_engine.sync import background as background_sync
from rstar2_jax.rollout.engines.accounting import OwnerLedger, current_owner
from rstar2_jax.rollout.engines.base import Completion, Engine, PromptTooLong, ServerLoad
from rstar2_jax.rollout.engines.vllm_engine.sync.export_roots import export_root, release, remove_orphaned_exports
from rstar2_jax.rollout.engines.vllm_engine.sync.reach import default_sync_root
from rstar2_jax.rollout.engines.vllm_engine.sync.shared_export import SharedExport
from rstar2_jax.rollout.engines.vllm_engine.sync.payloads import ADAPTERS, WHOLE_WEIGHTS
from rstar2_jax.rollout.engines.vllm_engine.client import (AsyncVLLMClient, ServerRequestError, ServerUnavailable, VLLMClient,
                                                    server_load)
from rstar2_jax.rollout.engines.vllm_engine.sync.report import SyncReport
from rstar2_jax.rollout.engines.vllm_engine.modes import FILES, Probe, Reload, SyncWait, SyncWay, sync_way
from rstar2_jax.rollout.engines.vllm_engine.sync.probe import WeightSyncError, probe_logprobs
from rstar2_jax.rollout.engines.vllm_engine.sync.push import push_to_servers
from rstar2_jax.rollout.engines.vllm_engine.sync.export import Bucket, ExportPlan, ExportSlots, model_plan, param_arrays
from rstar2_jax.rollout.engines.vllm_engine.sync.pull import bind_address, file_server
from rstar2_jax.rollout.engines.sampling import SamplingParams
from sandbox.job_secret import check_open_service, job_secret

log = logging.getLogger(__name__)


class VLLMEngine(Engine):
    """model: a Decoder of the served architecture (its graph is used to export and to probe
    synced weights; its parameters are the starting point, and need not be the server's)."""

    def __init__(self, url: str, model: Decoder | None = None, *, model_name: str | None = None,
                 sync_dir: str | None = None, export_dtype=None, probe_tolerance: float = 1e-3,
                 probe_length: int = 32, request_timeout: float = 600.0, restart_timeout: float = 600.0,
                 max_concurrency: int = 256, sync: str | SyncWay = "files", nccl_server_ranks: int = 1,
                 fetch_url: str | None = None, sync_host: str = "127.0.0.1", bucket_bytes: int = 2048 << 20,
                 reload: str | Reload = "staged", probe: str | Probe = "deferred", sync_wait: str | SyncWait = "reload"):
        """sync: "files" (safetensors files; the server reads the export from sync_dir: this host's /dev/shm by
        default, a shared filesystem path when it runs on another host), "pull" (the fetcher at
        `fetch_url`, beside the server, copies the export from this process's file server at
        `sync_host`; no shared filesystem: vllm_engine/sync/pull.py) or "nccl" (GPU broadcast). bucket_bytes:
        the export's bucket (vllm_engine/sync/export.py, host memory): the servers reload bucket by bucket as
        the export is written. reload: "staged" | "streamed", probe: "deferred" | "wait" (the module's
        docstring); sync_wait: "reload" | "export" (vllm_engine/sync/background.py). A `model` with LoRA adapters
        (models/lora.py): a sync moves only them, and the server, started with adapters enabled
        (ServerOptions.lora_rank), loads each version (vllm_engine/sync/adapters.py)."""
        self.way = sync_way(sync)  # each mode a typed object (vllm_engine/modes.py); a bad name raises here
        self.reload, self.probe, self.sync_wait = Reload(reload), Probe(probe), SyncWait(sync_wait)
        self.landing: background_sync.Landing | None = None  # sync_wait=export: the last sync, landing or landed
        self.closing = threading.Event()  # set by close(): a verdict still awaited from process 0 is not
        self.adapters: LoRAConfig | None = lora.config_of(model) if model is not None else None
        self.payload = ADAPTERS if self.adapters is not None else WHOLE_WEIGHTS  # what a sync moves
        if self.payload.loaded_by_name and not self.way.carries_adapters:
            raise ValueError("LoRA adapters reach vLLM servers by files or pull, not sync='nccl'")
        self.loaded_adapters: dict[int, str] = {}  # adapter versions this server holds -> their directories
        self.loads_adapters = False  # this process loads them (the one that pushes), so it unloads them at close
        self.pending_probe: concurrent.futures.Future | None = None  # the last sync's deferred probe
        if self.way.needs_fetcher != (fetch_url is not None):
            raise ValueError("sync='pull' needs fetch_url (the weight fetcher beside the server), and only it does")
        self.fetch_url = fetch_url
        self.sync_host = sync_host
        if self.way.needs_fetcher:  # refused now, not at the first sync: the export would be open to the network
            check_open_service("the trainer's weight export server", bind_address(sync_host), job_secret())
        self.client = VLLMClient(url, timeout=request_timeout)  # control plane (the Engine's sync calls)
        self.async_client = AsyncVLLMClient(url, timeout=request_timeout, max_connections=max_concurrency)
        self.url = self.client.url
        self.version = 0
        self.restart_timeout = restart_timeout
        self.probe_tolerance = probe_tolerance
        self.export_dtype = export_dtype
        self.retries = 0                       # requests sent again after a server failure
        self.reloads_after_restart = 0
        self._template = model
        self._graphdef = nnx.split(model)[0] if model is not None else None
        info = self.client.request("GET", "/v1/models", timeout=30.0)["data"][0]
        self.model_name = model_name or info["id"]
        self.max_model_len = int(info.get("max_model_len") or 0) or None
        self._sync_base = sync_dir or default_sync_root()
        if sync_dir is None:  # this host's own directory: exports of trainers that died are this host's to free
            remove_orphaned_exports(self._sync_base)
        self._sync_root = export_root(self._sync_base, self)  # freed at close, at SIGTERM, or by the next trainer
        self.bucket_bytes = int(bucket_bytes)
        self.slots = ExportSlots(self._sync_root)  # the exports, written in turn (vllm_engine/sync/export.py)
        self.sync_failures = 0                 # syncs that did not reach this server (it kept its weights)
        self.last_sync: SyncReport | None = None
        self._synced_dir: str | None = None    # the latest weights the server should have, on disk ...
        self._synced_model: Decoder | None = None  # ... and in memory (NCCL sync writes no files)
        self._nccl_server_ranks = nccl_server_ranks
        self._nccl = None
        vocab = model.cfg.vocab_size if model is not None else 256
        self.probe_tokens = np.random.default_rng(1234).integers(0, vocab, probe_length).tolist()
        # the control plane's blocking calls made from coroutines (recovery after a restart)
        self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="vllm-control")
        self.ledger = OwnerLedger()  # the same requests, by owner (accounting.py), with their prefix-cache hits
        self._up: asyncio.Event | None = None
        self._recovery: asyncio.Task | None = None

    # ------------------------------------------------------------------------------------------
    # generation

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       stop: Sequence[str] = (), *, session: Hashable | None = None) -> Completion:
        if self.pending_probe is not None and self.pending_probe.done():  # a failed deferred probe: stop here, loudly
            self.probe_verdict()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        max_tokens = sampling.max_tokens
        if self.max_model_len is not None and len(prompt) > self.max_model_len:
            raise PromptTooLong(len(prompt), self.max_model_len)
        if self.max_model_len is not None:
            max_tokens = min(max_tokens, self.max_model_len - len(prompt))
        if max_tokens <= 0:
            return Completion([], [], "length", self.version, self.version)
        body = {"prompt": prompt, "max_tokens": max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or -1,
                "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
                "stop": list(stop) + list(sampling.stop), "include_stop_str_in_output": True}
        if sampling.seed is not None:
            body["seed"] = int(sampling.seed) % 2 ** 63
        deadline = time.monotonic() + self.restart_timeout
        owner = current_owner()
        while True:
            await self._wait_up(deadline)
            version_start = self.version
            body["model"] = self.served_name  # with adapters: this version's, for the whole completion
            start = time.monotonic()
            try:
                out = await self._call("POST", "/v1/completions", body)
            except (ServerUnavailable, ServerRequestError) as err:
                # a restarted server answers 404 for the adapter it no longer holds: restore it
                lost_adapter = isinstance(err, ServerRequestError) and self.payload.loaded_by_name \
                    and "does not exist" in str(err)
                if isinstance(err, ServerRequestError) and not lost_adapter or time.monotonic() > deadline:
                    raise
                self.retries += 1
                self._mark_down()
                continue
            choice = out["choices"][0]
            if choice.get("finish_reason") == "abort":  # aborted by a server shutting down: send again
                self.retries += 1
                self._mark_down()
                continue
            usage = out.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")  # --enable-prompt-tokens-details
            self.ledger.charge_request(owner, start, time.monotonic(), usage.get("prompt_tokens", len(prompt)), cached)
            # an adapter named by the request samples every token of it: the version is exact
            return _completion(choice, version_start, version_start if self.payload.exact_versions else self.version)

    def take_owned(self, owner: Hashable):
        return self.ledger.take(owner)

    @property
    def served_name(self) -> str:
        """What requests name: the served model, or with LoRA the adapter of the current version
        (before the first adapter sync: the base, which is what zero adapters compute)."""
        return self.payload.served_name(self)

    @property
    def synced_dir(self) -> str | None:
        """The latest whole weights (or adapter) the server should hold, as it can read them."""
        return self._synced_dir

    @property
    def sync_base(self) -> str:
        """sync_dir: where this engine's exports live (what sync=pull's file server serves)."""
        return self._sync_base

    @property
    def sync_root(self) -> str:
        """This engine's directory of exports (under sync_dir), removed when it closes."""
        return self._sync_root

    async def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        return await self.async_client.request(method, path, body, timeout)

    def load(self) -> ServerLoad:
        return server_load(self.client.get_text("/metrics"))

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """log p(token t | tokens before t) for t >= 1 under the served weights (at T = 1)."""
        out = self.client.request("POST", "/v1/completions", {
            "model": self.served_name, "prompt": [int(t) for t in token_ids], "max_tokens": 1, "temperature": 1.0,
            "prompt_logprobs": 0, "return_token_ids": True})
        entries = out["choices"][0]["prompt_logprobs"]
        return [float(entries[i][str(int(t))]["logprob"]) for i, t in enumerate(token_ids) if i > 0]

    # ------------------------------------------------------------------------------------------
    # server failures

    def _ensure_event(self) -> asyncio.Event:
        if self._up is None:
            self._up = asyncio.Event()
            self._up.set()
        return self._up

    async def _wait_up(self, deadline: float):
        up = self._ensure_event()
        if not up.is_set():
            try:
                await asyncio.wait_for(up.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise ServerUnavailable(f"{self.url} still down after {self.restart_timeout:.0f} s") from None

    def _mark_down(self):
        up = self._ensure_event()
        up.clear()
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self):
        """Poll until the server answers, put the latest weights back if it restarted, then let
        the waiting requests go."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.restart_timeout
        while time.monotonic() < deadline:
            if await loop.run_in_executor(self._executor, self.client.alive):
                try:
                    await loop.run_in_executor(self._executor, self.payload.restore, self)
                except (ServerUnavailable, ServerRequestError) as e:
                    log.warning("restoring weights on %s failed (%s); retrying", self.url, e)
                else:
                    self._up.set()
                    return
            await asyncio.sleep(1.0)
        log.error("%s did not come back within %.0f s", self.url, self.restart_timeout)
        self._up.set()  # waiting requests try once more and raise ServerUnavailable

    def reload_whole_weights(self):
        """A restarted server (its weights the model directory it was launched with) gets the
        latest whole weights again (sync_payloads.WholeWeights.restore)."""
        served = self.client.request("GET", "/weight_info", timeout=10.0).get("weight_version")
        if (self._synced_dir or self._synced_model is not None) and str(served) != str(self.version):
            if self._synced_dir is None:  # synced over NCCL: the restarted server needs files
                self._synced_dir = os.path.join(self._sync_root, f"v{self.version}")
                save_pretrained(self._synced_model, self._synced_dir, dtype=self.export_dtype, tokenizer_dir=None)
                self._nccl = None  # its communicator died with the old server
            log.warning("%s restarted (weight version %s, expected %s): reloading %s", self.url, served,
                        self.version, self._synced_dir)
            self._reload(self._synced_dir, self.version)
            self.reloads_after_restart += 1

    # ------------------------------------------------------------------------------------------
    # weight sync

    weights_on_servers = True

    @property
    def lands_in_background(self) -> bool:
        """sync_wait=export, for a sync of whole weights through files (adapters and NCCL: waited for)."""
        return self.sync_wait.in_background and self.payload.can_land_in_background and self.way.writes_export

    def settle_sync(self) -> list[str | None]:
        return [r.error for r in background_sync.settle([self])]

    async def weights_at_least(self, version: int) -> None:
        await background_sync.wait_for_version([self], version)

    @classmethod
    def sync_units(cls, engines: Sequence["VLLMEngine"]) -> list:
        """Servers whose syncs go through files (files, pull) share one export, when several and
        of one export dtype; the others (NCCL) are synced one by one."""
        shared = [e for e in engines if e.way.writes_export]
        if len(shared) < 2 or len({e.export_dtype for e in shared}) > 1:
            return list(engines)
        return [SharedExport(shared)] + [e for e in engines if e not in shared]

    def export_error(self) -> str | None:
        return self.landing.export_error() if self.landing is not None else None

    def expect_landing(self, params: Any, version: int) -> None:
        background_sync.await_landing([self], version)

    def update_weights(self, params: Any, version: int | None = None) -> None:
        """Push parameters (an nnx.State of the model's variables, or a Decoder) to the server
        (sync_wait=export: returns once they are exported, vllm_engine/sync/background.py)."""
        model = self.as_model(params)
        version = self.version + 1 if version is None else version
        start = time.perf_counter()
        if self.lands_in_background:
            background_sync.push_in_background([self], model, version)
            return
        if self.way.writes_export or not self._sync_nccl(model, version):
            push_to_servers([self], model, version)
            return
        self._synced_model = model
        self.version = version
        self.check_sync(model)
        log.info("synced weights v%d to %s over NCCL in %.2f s", version, self.url, time.perf_counter() - start)

    def as_model(self, params: Any) -> Decoder:
        if self._graphdef is None:
            raise ValueError("VLLMEngine(model=...) is needed to export weights")
        return params if isinstance(params, nnx.Module) else nnx.merge(self._graphdef, params)

    def export_plan(self, model: Decoder) -> ExportPlan:
        return model_plan(model, self.export_dtype, self.bucket_bytes)

    # The steps of one sync (push_to_servers runs them for every server at once).
    def pause(self):
        self.client.request("POST", "/pause?mode=keep")  # in-flight requests wait, keeping their KV

    def reload_part(self, bucket_dir: str):
        """One bucket (whole decoder layers: vllm_engine/sync/export.py) into the paused server."""
        self.client.request("POST", "/collective_rpc", {"method": "reload_weights",
                                                        "kwargs": {"weights_path": bucket_dir}})

    def fetch_part(self, slot: str, bucket: Bucket, version: int) -> str:
        """sync=pull: the fetcher beside the server copies one written bucket; the server reloads
        from that copy, whose directory this returns (vllm_engine/sync/pull.py)."""
        from rstar2_jax.rollout.engines.vllm_engine.sync.pull import ask_to_fetch
        url = file_server(self._sync_base, self.sync_host).url_for(slot)
        return ask_to_fetch(self.fetch_url, url, bucket.file_name, bucket.dir_name, version)

    def commit_pull(self, version: int) -> str:
        """sync=pull, every bucket reloaded: the fetcher's whole copy (what a roll-back reloads)."""
        from rstar2_jax.rollout.engines.vllm_engine.sync.pull import ask_to_commit
        return ask_to_commit(self.fetch_url, version)

    def publish(self, version: int):
        c = self.client
        c.request("POST", "/reset_prefix_cache")  # cached KV was computed by the old weights
        c.request("POST", "/update_weight_version", {"new_version": str(version)})

    def resume(self):
        self.client.request("POST", "/resume")

    def roll_back(self):
        """After a sync that failed part-way: the last whole export back in (the server may hold
        some of the new buckets). A server that cannot be reached is restored when it answers
        again (_recover). Before the first sync lands there is no export to go back to: the
        trainer's first sync happens before any rollout, and a run stops if its retry fails too."""
        if self._synced_dir:
            self.reload_part(self._synced_dir)

    def landed(self, synced_dir: str, version: int):
        """A sync's whole export is in the server (as `synced_dir`): tokens are `version`'s."""
        self._synced_dir, self._synced_model, self.version = synced_dir, None, version

    def adopt_weights(self, params: Any, version: int, synced: dict[str, str] | None = None) -> None:
        """Another process pushed these weights to the server: stamp tokens with `version`. To
        restore a restarted server: the directory the server reloaded them from (`synced`, by
        server URL, which the server can read whichever process asks), else the weights (this
        engine then exports its own)."""
        if synced and self.url in synced:
            self._synced_model, self._synced_dir = None, synced[self.url]
            if self.payload.loaded_by_name:  # an adapter's directory: the version it holds loaded
                self.loaded_adapters[version] = synced[self.url]
        else:
            self._synced_model, self._synced_dir = self.as_model(params), None
        self.version = version

    def take_part_in_sync(self, params: Any) -> None:
        """A trainer process other than the one that pushes, while it pushes `params` split over
        processes: the same collectives (push_to_servers), nothing sent."""
        self.payload.take_part(self, params)

    def synced_dirs(self) -> dict[str, str]:
        return {self.url: self._synced_dir} if self._synced_dir else {}

    def sync_error(self) -> str | None:
        return self.last_sync.error if self.last_sync is not None else None

    def sync_paused_s(self) -> float | None:
        return self.last_sync.paused_s if self.last_sync is not None else None

    def _sync_nccl(self, model: Decoder, version: int) -> bool:
        """Broadcast over NCCL (vllm_engine/sync/nccl_group.py); False: unavailable here, use the files path."""
        from rstar2_jax.rollout.engines.vllm_engine.sync.nccl_group import (
            NcclUnavailable, NcclWeightSender, sending_device_tensors)
        try:
            if self._nccl is None:
                self._nccl = NcclWeightSender(self.client, server_ranks=self._nccl_server_ranks)
            plan = self.export_plan(model)
            self._nccl.send(plan, sending_device_tensors(plan, param_arrays(model)), version)
        except NcclUnavailable as e:
            log.warning("NCCL weight sync unavailable (%s); using safetensors files", e)
            self.way = FILES
            return False
        if self._synced_dir:
            shutil.rmtree(self._synced_dir, ignore_errors=True)
            self._synced_dir = None
        return True

    def _reload(self, weights_dir: str, version: int):
        """A whole export into the server, alone: a sync's steps for one directory."""
        self.pause()
        try:
            self.reload_part(weights_dir)
            self.publish(version)
        finally:
            self.resume()

    def probe_verdict(self) -> float | None:
        """The last sync's deferred probe, waited for: its log-prob gap (None: no probe pending).
        Raises its WeightSyncError (once) when the server's weights did not match."""
        pending, self.pending_probe = self.pending_probe, None
        return None if pending is None else pending.result()

    def check_sync(self, model: Decoder, ours: np.ndarray | jax.Array | None = None) -> float:
        """Largest |log-prob difference| between the server and `model` on the probe tokens
        (`ours`: the model's log-probs of them, probe_logprobs, when the caller has them; waited
        for here, on the probe's thread)."""
        served = np.asarray(self.prompt_logprobs(self.probe_tokens))
        ours = np.asarray(probe_logprobs(model, self.probe_tokens) if ours is None else ours)
        err = float(np.max(np.abs(served - ours)))
        if not np.isfinite(err) or err > self.probe_tolerance:
            tied = " The model ties its embeddings: vLLM's reload_weights keeps the old output layer " \
                   "of tied models (shared notes on vLLM); restart the server from the new weights " \
                   "or untie the embeddings." if model.cfg.tie_word_embeddings else ""
            raise WeightSyncError(f"after the sync to {self.url}, vLLM's log-probs differ from the learner's by "
                                  f"{err:.3g} (> {self.probe_tolerance:g}).{tied}")
        return err

    async def close(self):
        self.closing.set()
        if self.landing is not None:  # no reload may run beside the export's removal
            reports = await asyncio.get_running_loop().run_in_executor(None, background_sync.settle, [self])
            if processes.is_primary() and reports and not reports[-1].ok:  # the last sync: nothing waits for it
                log.error("%s: the last weights (v%d) never reached the server: %s", self.url, reports[-1].version,
                          reports[-1].error)
        if self.pending_probe is not None:  # the last sync's verdict still counts
            await asyncio.get_running_loop().run_in_executor(None, self.probe_verdict)
        if self._recovery is not None:
            self._recovery.cancel()
        if self.loads_adapters:  # before the files go: the server must not keep names whose files are gone
            await asyncio.get_running_loop().run_in_executor(None, adapter_sync.unload_all, self)
        await self.async_client.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        release(self._sync_root)


def _completion(choice: dict, version_start: int, version_end: int) -> Completion:
    token_ids = [int(t) for t in choice["token_ids"]]
    logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    if len(logprobs) != len(token_ids):
        raise ServerRequestError(f"vLLM returned {len(token_ids)} tokens but {len(logprobs)} log-probs")
    reason, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
    if reason == "length":
        return Completion(token_ids, logprobs, "length", version_start, version_end)
    if isinstance(stop_reason, str):
        return Completion(token_ids, logprobs, "stop", version_start, version_end, stop_reason)
    return Completion(token_ids, logprobs, "eos", version_start, version_end)


