"""VLLMEngine: the rollout engine as a client of a vLLM OpenAI-compatible server.

Same interface as JaxEngine (`generate`, `update_weights`, `version`), so the agent loop, the
evaluation and the trainer do not know which engine they talk to.

Token in, token out: prompts go as token ids to /v1/completions and the choice's `token_ids`
and `logprobs.token_logprobs` come back; text is never re-tokenized. The server runs with
`--logprobs-mode processed_logprobs` (vllm_server.py): log-probs at the sampling temperature,
what the learner recomputes. (With top-k/top-p vLLM renormalizes over the kept tokens, unlike
JaxEngine; RL sampling uses neither.)

Weight sync (`update_weights`, `push_to_servers`): the learner's parameters are written as
HF-named safetensors bucket by bucket (weight_export.py: under /dev/shm where it exists, in one
of two directories used in turn). With `swap="staged"` (the default) the servers generate on
while every bucket is written (and, for sync=pull, copied by their fetchers), then each is
paused (in-flight requests kept, with their KV), reloads the whole export in one
`reload_weights` call (/collective_rpc), has its prefix cache reset (cached KV was computed by
the old weights) and its weight version bumped, and resumes: it stops only for its reload. That
is as close to an in-flight swap as vLLM 0.32 allows: a utility call such as collective_rpc runs
in the EngineCore's busy loop between two engine steps (`EngineCore._process_input_queue`,
vllm/v1/engine/core.py), so no decode step runs during a reload whether paused or not, and the
pause (`pause_generation(mode="keep")`) only keeps steps from running between the reload and the
version's bump, so that no token is stamped with the old version but sampled by the new weights.
`swap="streamed"` reloads each bucket while the next is written (pausing from the first reload):
a shorter sync where each server has cores of its own, a longer pause. A sync that fails
part-way puts the previous export back and keeps the old version (SyncReport). Then
a probe checks the result rather than trusting it: vLLM's prompt log-probs of a fixed token
sequence must match the JAX model's within `probe_tolerance`. This catches the tied-embedding
trap (vLLM's reload updates a tied embedding but keeps the old output layer) and any other
silently ignored tensor. With `probe="deferred"` (the default) the probes run after the sync
returns, beside the next step's rollouts, and their verdict is collected at the next sync (or by
the first request after it arrives): a failed probe raises WeightSyncError then, one step later,
instead of holding the trainer for the probes every step (`probe="wait"`). Requests in flight
during a sync continue with the new weights (partial rollouts, for asynchronous RL). The
server does not say which tokens came before the swap, so a completion's tokens all count as
`version_start`: the oldest weights that can have sampled them, which keeps the trainer's
staleness bound safe (JaxEngine records the exact version per token).

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
import dataclasses
import functools
import logging
import os
import shutil
import threading
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstar2_jax import processes
from rstar2_jax.models.checkpoint import save_pretrained
from rstar2_jax.models.decoder import Decoder
from rstar2_jax.models.logprobs import token_logprobs
from rstar2_jax.models import lora
from rstar2_jax.models.lora import LoRAConfig
from rstar2_jax.rollout.engines import adapter_sync, background_sync
from rstar2_jax.rollout.engines.background_sync import WAIT_MODES
from rstar2_jax.rollout.engines.adapter_sync import adapter_name, load_on_server
from rstar2_jax.rollout.engines.accounting import OwnerLedger, current_owner
from rstar2_jax.rollout.engines.base import Completion, Engine, PromptTooLong, ServerLoad
from rstar2_jax.rollout.engines.export_roots import export_root, release, remove_orphaned_exports
from rstar2_jax.rollout.engines.reach import default_sync_root
from rstar2_jax.rollout.engines.vllm_client import (AsyncVLLMClient, ServerRequestError, ServerUnavailable, VLLMClient,
                                                    server_load)
from rstar2_jax.rollout.engines.vllm_kind import PROBE_MODES, SWAP_MODES
from rstar2_jax.rollout.engines.weight_export import Bucket, ExportPlan, ExportSlots, model_plan, param_arrays, take_part
from rstar2_jax.rollout.sampling import SamplingParams
from sandbox.job_secret import check_open_service, is_loopback, job_secret

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    pass


class VLLMEngine(Engine):
    """model: a Decoder of the served architecture (its graph is used to export and to probe
    synced weights; its parameters are the starting point, and need not be the server's)."""

    def __init__(self, url: str, model: Decoder | None = None, *, model_name: str | None = None,
                 sync_dir: str | None = None, export_dtype=None, probe_tolerance: float = 1e-3,
                 probe_length: int = 32, request_timeout: float = 600.0, restart_timeout: float = 600.0,
                 max_concurrency: int = 256, sync: str = "files", nccl_server_ranks: int = 1,
                 fetch_url: str | None = None, sync_host: str = "127.0.0.1", bucket_bytes: int = 2048 << 20,
                 swap: str = "staged", probe: str = "deferred", sync_wait: str = "reload"):
        """sync: "files" (safetensors files; the server reads the export from sync_dir: this host's /dev/shm by
        default, a shared filesystem path when it runs on another host), "pull" (the fetcher at
        `fetch_url`, beside the server, copies the export from this process's file server at
        `sync_host`; no shared filesystem: weight_pull.py) or "nccl" (GPU broadcast). bucket_bytes:
        the export's bucket (weight_export.py, host memory): the servers reload bucket by bucket as
        the export is written. swap: "staged" | "streamed", probe: "deferred" | "wait" (the module's
        docstring); sync_wait: "reload" | "export" (background_sync.py). A `model` with LoRA adapters
        (models/lora.py): a sync moves only them, and the server, started with adapters enabled
        (ServerOptions.lora_rank), loads each version (adapter_sync.py)."""
        if sync not in SYNC_METHODS:
            raise ValueError(f"sync must be one of {SYNC_METHODS}, got {sync!r}")
        if swap not in SWAP_MODES or probe not in PROBE_MODES:
            raise ValueError(f"swap must be one of {SWAP_MODES} and probe one of {PROBE_MODES}, got {swap!r}, {probe!r}")
        if sync_wait not in WAIT_MODES:
            raise ValueError(f"sync_wait must be one of {WAIT_MODES}, got {sync_wait!r}")
        self.swap, self.probe, self.sync_wait = swap, probe, sync_wait
        self.landing: background_sync.Landing | None = None  # sync_wait=export: the last sync, landing or landed
        self.closing = threading.Event()  # set by close(): a verdict still awaited from process 0 is not
        self.adapters: LoRAConfig | None = lora.config_of(model) if model is not None else None
        if self.adapters is not None and sync == "nccl":
            raise ValueError("LoRA adapters reach vLLM servers by files or pull, not sync='nccl'")
        self.loaded_adapters: dict[int, str] = {}  # adapter versions this server holds -> their directories
        self.loads_adapters = False  # this process loads them (the one that pushes), so it unloads them at close
        self._probe: concurrent.futures.Future | None = None  # the last sync's deferred probe
        if (sync == "pull") != (fetch_url is not None):
            raise ValueError("sync='pull' needs fetch_url (the weight fetcher beside the server), and only it does")
        self.fetch_url = fetch_url
        self.sync_host = sync_host
        if sync == "pull":  # refused now, not at the first sync: the export would be open to the network
            check_open_service("the trainer's weight export server", _bind_address(sync_host), job_secret())
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
        self.slots = ExportSlots(self._sync_root)  # the exports, written in turn (weight_export.py)
        self.sync_failures = 0                 # syncs that did not reach this server (it kept its weights)
        self.last_sync: SyncReport | None = None
        self._synced_dir: str | None = None    # the latest weights the server should have, on disk ...
        self._synced_model: Decoder | None = None  # ... and in memory (NCCL sync writes no files)
        self.sync = sync
        self._nccl_server_ranks = nccl_server_ranks
        self._nccl = None
        vocab = model.cfg.vocab_size if model is not None else 256
        self._probe_tokens = np.random.default_rng(1234).integers(0, vocab, probe_length).tolist()
        # the control plane's blocking calls made from coroutines (recovery after a restart)
        self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="vllm-control")
        self.ledger = OwnerLedger()  # the same requests, by owner (accounting.py), with their prefix-cache hits
        self._up: asyncio.Event | None = None
        self._recovery: asyncio.Task | None = None

    # ------------------------------------------------------------------------------------------
    # generation

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       stop: Sequence[str] = (), *, session: Hashable | None = None) -> Completion:
        if self._probe is not None and self._probe.done():  # a failed deferred probe: stop here, loudly
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
                lost_adapter = isinstance(err, ServerRequestError) and self.adapters is not None \
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
            return _completion(choice, version_start, version_start if self.adapters else self.version)

    def take_owned(self, owner: Hashable):
        return self.ledger.take(owner)

    @property
    def served_name(self) -> str:
        """What requests name: the served model, or with LoRA the adapter of the current version
        (before the first adapter sync: the base, which is what zero adapters compute)."""
        return adapter_name(self.version) if self.adapters and self._synced_dir else self.model_name

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
                    await loop.run_in_executor(self._executor, self._restore_weights)
                except (ServerUnavailable, ServerRequestError) as e:
                    log.warning("restoring weights on %s failed (%s); retrying", self.url, e)
                else:
                    self._up.set()
                    return
            await asyncio.sleep(1.0)
        log.error("%s did not come back within %.0f s", self.url, self.restart_timeout)
        self._up.set()  # waiting requests try once more and raise ServerUnavailable

    def _restore_weights(self):
        if self.adapters is not None:  # a restarted server holds no adapter: load the current one again
            served_ids = {m["id"] for m in self.client.request("GET", "/v1/models", timeout=10.0)["data"]}
            if self._synced_dir and adapter_name(self.version) not in served_ids:
                log.warning("%s restarted without adapter v%d: loading %s", self.url, self.version, self._synced_dir)
                load_on_server(self, self._synced_dir, self.version, fetch=False)  # the server's own copy
                self.loaded_adapters = {self.version: self._synced_dir}
                self.reloads_after_restart += 1
            return
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
        return self.sync_wait == "export" and self.adapters is None and self.sync != "nccl"

    def settle_sync(self) -> list[str | None]:
        return [r.error for r in background_sync.settle([self])]

    async def weights_at_least(self, version: int) -> None:
        await background_sync.wait_for_version([self], version)

    def export_error(self) -> str | None:
        return self.landing.export_error() if self.landing is not None else None

    def expect_landing(self, params: Any, version: int) -> None:
        background_sync.await_landing([self], version)

    def update_weights(self, params: Any, version: int | None = None) -> None:
        """Push parameters (an nnx.State of the model's variables, or a Decoder) to the server
        (sync_wait=export: returns once they are exported, background_sync.py)."""
        model = self.as_model(params)
        version = self.version + 1 if version is None else version
        start = time.perf_counter()
        if self.lands_in_background:
            background_sync.push_in_background([self], model, version)
            return
        if not (self.sync == "nccl" and self._sync_nccl(model, version)):
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
    def _pause(self):
        self.client.request("POST", "/pause?mode=keep")  # in-flight requests wait, keeping their KV

    def _reload_part(self, bucket_dir: str):
        """One bucket (whole decoder layers: weight_export.py) into the paused server."""
        self.client.request("POST", "/collective_rpc", {"method": "reload_weights",
                                                        "kwargs": {"weights_path": bucket_dir}})

    def _fetch_part(self, slot: str, bucket: Bucket, version: int) -> str:
        """sync=pull: the fetcher beside the server copies one written bucket; the server reloads
        from that copy, whose directory this returns (weight_pull.py)."""
        from rstar2_jax.rollout.engines.weight_pull import ask_to_fetch
        url = _file_server(self._sync_base, self.sync_host).url_for(slot)
        return ask_to_fetch(self.fetch_url, url, bucket.file_name, bucket.dir_name, version)

    def _commit_pull(self, version: int) -> str:
        """sync=pull, every bucket reloaded: the fetcher's whole copy (what a roll-back reloads)."""
        from rstar2_jax.rollout.engines.weight_pull import ask_to_commit
        return ask_to_commit(self.fetch_url, version)

    def _publish(self, version: int):
        c = self.client
        c.request("POST", "/reset_prefix_cache")  # cached KV was computed by the old weights
        c.request("POST", "/update_weight_version", {"new_version": str(version)})

    def _resume(self):
        self.client.request("POST", "/resume")

    def _roll_back(self):
        """After a sync that failed part-way: the last whole export back in (the server may hold
        some of the new buckets). A server that cannot be reached is restored when it answers
        again (_recover). Before the first sync lands there is no export to go back to: the
        trainer's first sync happens before any rollout, and a run stops if its retry fails too."""
        if self._synced_dir:
            self._reload_part(self._synced_dir)

    def adopt_weights(self, params: Any, version: int, synced: dict[str, str] | None = None) -> None:
        """Another process pushed these weights to the server: stamp tokens with `version`. To
        restore a restarted server: the directory the server reloaded them from (`synced`, by
        server URL, which the server can read whichever process asks), else the weights (this
        engine then exports its own)."""
        if synced and self.url in synced:
            self._synced_model, self._synced_dir = None, synced[self.url]
            if self.adapters is not None:
                self.loaded_adapters[version] = synced[self.url]
        else:
            self._synced_model, self._synced_dir = self.as_model(params), None
        self.version = version

    def take_part_in_sync(self, params: Any) -> None:
        """A trainer process other than the one that pushes, while it pushes `params` split over
        processes: the same collectives (push_to_servers), nothing sent."""
        if self.adapters is not None:
            adapter_sync.take_part(params, self)
            return
        model = self.as_model(params)
        take_part(self.export_plan(model), param_arrays(model))
        probe_logprobs(model, self._probe_tokens)

    def synced_dirs(self) -> dict[str, str]:
        return {self.url: self._synced_dir} if self._synced_dir else {}

    def sync_error(self) -> str | None:
        return self.last_sync.error if self.last_sync is not None else None

    def sync_paused_s(self) -> float | None:
        return self.last_sync.paused_s if self.last_sync is not None else None

    def _sync_nccl(self, model: Decoder, version: int) -> bool:
        """Broadcast over NCCL (nccl_sync.py); False: unavailable here, use the files path."""
        from rstar2_jax.rollout.engines.nccl_sync import NcclUnavailable, NcclWeightSender, sending_device_tensors
        try:
            if self._nccl is None:
                self._nccl = NcclWeightSender(self.client, server_ranks=self._nccl_server_ranks)
            plan = self.export_plan(model)
            self._nccl.send(plan, sending_device_tensors(plan, param_arrays(model)), version)
        except NcclUnavailable as e:
            log.warning("NCCL weight sync unavailable (%s); using safetensors files", e)
            self.sync = "files"
            return False
        if self._synced_dir:
            shutil.rmtree(self._synced_dir, ignore_errors=True)
            self._synced_dir = None
        return True

    def _reload(self, weights_dir: str, version: int):
        """A whole export into the server, alone: a sync's steps for one directory."""
        self._pause()
        try:
            self._reload_part(weights_dir)
            self._publish(version)
        finally:
            self._resume()

    def probe_verdict(self) -> float | None:
        """The last sync's deferred probe, waited for: its log-prob gap (None: no probe pending).
        Raises its WeightSyncError (once) when the server's weights did not match."""
        pending, self._probe = self._probe, None
        return None if pending is None else pending.result()

    def check_sync(self, model: Decoder, ours: np.ndarray | jax.Array | None = None) -> float:
        """Largest |log-prob difference| between the server and `model` on the probe tokens
        (`ours`: the model's log-probs of them, probe_logprobs, when the caller has them; waited
        for here, on the probe's thread)."""
        served = np.asarray(self.prompt_logprobs(self._probe_tokens))
        ours = np.asarray(probe_logprobs(model, self._probe_tokens) if ours is None else ours)
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
        if self._probe is not None:  # the last sync's verdict still counts
            await asyncio.get_running_loop().run_in_executor(None, self.probe_verdict)
        if self._recovery is not None:
            self._recovery.cancel()
        if self.loads_adapters:  # before the files go: the server must not keep names whose files are gone
            await asyncio.get_running_loop().run_in_executor(None, adapter_sync.unload_all, self)
        await self.async_client.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        release(self._sync_root)


def probe_logprobs(model: Decoder, tokens: Sequence[int]) -> jax.Array:
    """The model's log-probs of `tokens` (each after the ones before it): the sync probe's reference.
    Dispatched, not waited for (JAX's asynchronous dispatch; `np.asarray` of it waits): a sync
    hands the learner's arrays back as soon as its export is whole, and the forward that reads
    them finishes beside what follows (on the 2-core CPU benchmark it held the trainer's sync
    0.37-0.39 s, now 0.02-0.07 s: BENCHMARKS.md, "vLLM weight sync to 2 CPU servers (files)"). An
    update that donates those arrays meanwhile waits for it: a pending read holds a donated
    buffer. Waited for on several CPU devices (below). Compiled once per architecture: op by op
    it cost 0.2 s of CPU per sync for a 0.3B model."""
    graphdef, params = nnx.split(model)
    out = _probe_jit(graphdef, params, jnp.asarray([list(tokens)], jnp.int32))
    devices = out.sharding.device_set
    if not out.is_fully_addressable:  # parameters split over processes: every process runs this
        from rstar2_jax.sharding import gathered
        out = gathered(out).addressable_data(0)
    if len(devices) > 1 and next(iter(devices)).platform == "cpu":
        # Over several devices these programs gather the split weights: a GPU runs each device's
        # programs in the order issued (one stream), nothing says the CPU runtime does, and two
        # programs' collectives taken in different orders by their peers would wait on each other.
        out.block_until_ready()
    return out[0, 1:]


@functools.partial(jax.jit, static_argnums=0)
def _probe_jit(graphdef, params, tokens):
    return token_logprobs(nnx.merge(graphdef, params), tokens)


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


SYNC_METHODS = ("files", "pull", "nccl")  # the names of rollout.vllm.sync
_PROBES = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="vllm-probe")  # deferred probes
_FILE_SERVERS: dict[tuple[str, str], Any] = {}


def _bind_address(sync_host: str) -> str:
    """Where the file server listens to be reached at `sync_host`: loopback, or every interface."""
    return sync_host if is_loopback(sync_host) else "0.0.0.0"


def _file_server(root: str, host: str):
    """This process's read-only HTTP server of `root` (one per root and address, started on first use)."""
    from rstar2_jax.rollout.engines.weight_pull import WeightFileServer
    if (root, host) not in _FILE_SERVERS:
        server = _FILE_SERVERS[root, host] = WeightFileServer(root, host=_bind_address(host), advertise=host)
        print(f"weight export served at {server.base_url} for the fetchers "
              f"({'they show the job secret' if server.secret else 'open: no secret'})", flush=True)
    return _FILE_SERVERS[root, host]


class _Abandoned(Exception):
    """A bucket a server did not load because another load of the same sync had failed."""


@dataclasses.dataclass(frozen=True)
class WrittenExport:
    """A sync's export once every bucket is written (and the probe's reference dispatched): all a
    second attempt of the same sync needs, without the learner's arrays (background_sync.py)."""
    plan: ExportPlan
    slot: str
    reference: jax.Array  # probe_logprobs: maybe still being computed
    model: Decoder  # its arrays may be donated by then: only its config is read (the probe's message)


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


def start_probes(engines: Sequence[VLLMEngine], model: Decoder, reference: jax.Array, report: SyncReport):
    """Every server's log-prob probe after a sync landed, on the probe pool: waited for with
    probe="wait", else collected later (VLLMEngine.probe_verdict); report.probe_s fills in as they end.
    One probe per server: engines on the same server share its verdict (two prompt_logprobs
    requests of an adapter in one batch crashed vLLM 0.32's CPU EngineCore once in the suite; its
    prompt-logprobs path maps LoRA per sequence, not per token: vllm-project/vllm#16668, #51594)."""
    probed = time.perf_counter()

    def probed_in(_):
        report.probe_s = max(report.probe_s, time.perf_counter() - probed)
    probes: dict[str, concurrent.futures.Future] = {}
    for e in engines:
        if e.url not in probes:
            probes[e.url] = _PROBES.submit(e.check_sync, model, reference)
            probes[e.url].add_done_callback(probed_in)
        e._probe = probes[e.url]
    if engines[0].probe == "wait":
        for e in engines:
            e.probe_verdict()


def finish(engines: Sequence[VLLMEngine], report: SyncReport, start: float):
    """The sync's total time, and the report on every engine (last_sync)."""
    report.total_s = time.perf_counter() - start
    for e in engines:
        e.last_sync = report


def push_to_servers(engines: Sequence[VLLMEngine], params: Any, version: int, *,
                    on_exported: Callable[[], None] | None = None, again: WrittenExport | None = None) -> SyncReport:
    """The learner's weights to every server: one export, bucket by bucket (weight_export.py).
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
    servers go on answering, and the caller retries with the next sync. The previous sync's
    deferred probe is collected first: a failed one raises WeightSyncError before any export.

    `on_exported` is called once the export is whole and the probe's reference dispatched: the
    learner's arrays may be donated (the reference's pending read holds them until it is done),
    and the rest may finish behind the caller
    (background_sync.py; a sync that fails before calls it never). `again`: a second attempt that
    reloads that written export (report.written) instead of writing one (params unused)."""
    for e in engines:
        e.probe_verdict()
    if engines[0].adapters is not None:  # a LoRA run: only the adapters move (adapter_sync.py)
        return adapter_sync.push_adapters(engines, params, version)
    lead = engines[0]
    staged = lead.swap == "staged"
    reference: jax.Array | None  # the probe's reference: the learner's log-probs of the probe (dispatched)
    if again is None:  # an export to write: into the slot not holding the last whole one
        model = lead.as_model(params)
        plan, arrays, reference = lead.export_plan(model), param_arrays(model), None
        slot = lead.slots.begin(plan)
    else:  # the first attempt's export, whole: reloaded as it is (no array is read)
        model, plan, arrays, reference, slot = again.model, again.plan, {}, again.reference, again.slot
    report = SyncReport(version, len(plan.buckets), plan.nbytes)
    start = time.perf_counter()
    paused: dict[VLLMEngine, float] = {}  # server -> when it paused (each entry written by that server's queue)
    failed: list[BaseException] = []      # the errors of servers' loads; one is enough to end the sync

    def pause(e: VLLMEngine):
        if e not in paused:  # it generated until now: only its reloads need it paused
            e._pause()
            paused[e] = time.perf_counter()

    def load(e: VLLMEngine, bucket: Bucket, bucket_dir: str):
        """One server's part of one bucket, on that server's queue (so in bucket order): staged,
        only its copy (pull); streamed, its reload too."""
        if failed:
            raise _Abandoned()  # no server loads more of a sync that is failing: it is rolled back
        try:
            source = e._fetch_part(slot, bucket, version) if e.sync == "pull" else bucket_dir
            if not staged:
                pause(e)
                e._reload_part(source)
        except BaseException as err:
            failed.append(err)
            raise

    def swap(e: VLLMEngine, whole: str):
        """Staged: the server stops for one reload of the whole export."""
        try:
            pause(e)
            e._reload_part(whole)
        except BaseException as err:
            failed.append(err)
            raise

    landed: dict[VLLMEngine, str] = {}
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
            reference = probe_logprobs(model, lead._probe_tokens)
        if export_whole:
            report.written = WrittenExport(plan, slot, reference, model)
            if on_exported is not None:
                on_exported()  # the learner's arrays are free: the rest may run behind the caller
        concurrent.futures.wait(pending)
        if failed:
            raise failed[0]
        landed = {e: (e._commit_pull(version) if e.sync == "pull" else slot) for e in engines}
        if staged:  # every bucket is in: each server stops once, for its reload
            concurrent.futures.wait([queues[e].submit(swap, e, landed[e]) for e in engines])
            if failed:
                raise failed[0]
        report.reload_s = time.perf_counter() - start
        report.paused_from_s = min(paused.values()) - start
        for e in engines:
            e._publish(version)
    except Exception as err:  # noqa: BLE001 - any failure: every server back on its last weights
        report.error = f"{type(err).__name__}: {err}"
        take_part(plan, arrays, start=written)  # the other trainer processes gather every tensor: so must this one
        if reference is None:  # ... and then the probe's reference (its collectives, in that order)
            try:
                probe_logprobs(model, lead._probe_tokens)
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
                e._roll_back()
            except Exception as undo:  # noqa: BLE001 - it is restored when it answers again
                log.error("%s: could not reload its previous weights (%s); restored when it answers", e.url, undo)
    finally:
        for q in queues.values():
            q.shutdown(wait=True, cancel_futures=True)
        for e, since in paused.items():
            try:
                e._resume()
            except Exception as err:  # noqa: BLE001
                log.error("%s: resume failed (%s)", e.url, err)
            report.paused_s = max(report.paused_s, time.perf_counter() - since)
        report.resumed_s = time.perf_counter() - start
    if report.ok:
        if all(e.sync == "pull" for e in engines):
            shutil.rmtree(slot, ignore_errors=True)  # every server holds its fetcher's copy
        else:
            lead.slots.commit(slot)
        for e in engines:
            e._synced_dir, e._synced_model, e.version = landed[e], None, version
        start_probes(engines, model, reference, report)
    finish(engines, report, start)
    log.info("synced weights v%d to %d server(s) in %d bucket(s), %s: %.2f s (export %.2f s, reloaded at %.2f s, "
             "generating again at %.2f s after a pause of at most %.2f s from %.2f s, probes %s)%s", version,
             len(engines), report.buckets, lead.swap, report.total_s, report.export_s, report.reload_s,
             report.resumed_s, report.paused_s, report.paused_from_s,
             f"{report.probe_s:.2f} s" if lead.probe == "wait" else "deferred",
             "" if report.ok else f"; FAILED: {report.error}")
    return report
