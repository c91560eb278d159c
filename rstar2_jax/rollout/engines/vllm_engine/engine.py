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
import time
from typing import Hashable, Sequence


from rstar2_jax.core import processes
from rstar2_jax.models.decoder import Decoder
from rstar2_jax.rollout.engines.vllm_engine.sync import adapters as adapter_sync
from rstar2_jax.rollout.engines.vllm_engine.sync import background as background_sync
from rstar2_jax.rollout.engines.accounting import OwnerLedger, current_owner
from rstar2_jax.rollout.engines.base import Completion, Engine, ServerLoad, checked_prompt, empty_completion
from rstar2_jax.rollout.engines.vllm_engine.sync.export_roots import release
from rstar2_jax.rollout.engines.vllm_engine.sync.shared_export import SharedExport
from rstar2_jax.rollout.engines.vllm_engine.sync.server_steps import ServerSyncSteps
from rstar2_jax.rollout.engines.vllm_engine.settings import VLLMSettings, vllm_settings
from rstar2_jax.rollout.engines.vllm_engine.client import (AsyncVLLMClient, ServerRequestError, ServerUnavailable, VLLMClient,
                                                    server_load)
from rstar2_jax.rollout.engines.sampling import SamplingParams

log = logging.getLogger(__name__)


class VLLMEngine(ServerSyncSteps, Engine):
    """model: a Decoder of the served architecture (its graph is used to export and to probe
    synced weights; its parameters are the starting point, and need not be the server's)."""

    def __init__(self, url: str, model: Decoder | None = None, settings: VLLMSettings | None = None, *,
                 model_name: str | None = None, fetch_url: str | None = None, bucket_bytes: int | None = None,
                 probe_length: int = 32, request_timeout: float = 600.0, restart_timeout: float = 600.0,
                 max_concurrency: int = 256, nccl_server_ranks: int = 1, **overrides):
        """settings: `rollout.vllm.*` (settings.py's VLLMSettings, where every default and rule is;
        None: its defaults), with `overrides` of its fields by name (None: the section's value):
        sync ("files": the server reads the export from sync_dir, this host's /dev/shm by default,
        a shared filesystem path when it runs on another host; "pull": the fetcher at `fetch_url`,
        beside the server, copies the export from this process's file server at sync_host, no
        shared filesystem: vllm_engine/sync/pull.py; "nccl": GPU broadcast), reload ("staged" |
        "streamed"), probe ("deferred" | "wait"; vllm_engine/sync/push.py's docstring), sync_wait
        ("reload" | "export": vllm_engine/sync/background.py), export_dtype (a name or a dtype),
        probe_tolerance. bucket_bytes: the export's bucket in bytes (vllm_engine/sync/export.py,
        host memory; None: sync_bucket_mb's). A `model` with LoRA adapters (models/lora.py): a
        sync moves only them, and the server, started with adapters enabled
        (ServerOptions.lora_rank), loads each version (vllm_engine/sync/adapters.py)."""
        v = self.settings = vllm_settings(settings, overrides)
        self._check_sync_settings(model, v, fetch_url)
        self.client = VLLMClient(url, timeout=request_timeout)  # control plane (the Engine's sync calls)
        self.async_client = AsyncVLLMClient(url, timeout=request_timeout, max_connections=max_concurrency)
        self.url = self.client.url
        self.version = 0
        self.restart_timeout = restart_timeout
        self.retries = 0                       # requests sent again after a server failure
        info = self.client.request("GET", "/v1/models", timeout=30.0)["data"][0]
        self.model_name = model_name or info["id"]
        self.max_model_len = int(info.get("max_model_len") or 0) or None
        self._start_sync_state(model, v, probe_length=probe_length, nccl_server_ranks=nccl_server_ranks,
                               bucket_bytes=bucket_bytes or max(1, int(v.sync_bucket_mb * 2**20)))
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
        prompt, max_tokens = checked_prompt(prompt_ids, sampling.max_tokens, self.max_model_len)
        if max_tokens <= 0:
            return empty_completion(self.version)
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


    async def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        return await self.async_client.request(method, path, body, timeout)

    def load(self) -> ServerLoad:
        return server_load(self.client.get_text("/metrics"))


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


    # ------------------------------------------------------------------------------------------
    # weight sync

    weights_on_servers = True


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


