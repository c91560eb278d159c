"""The sync side of one VLLMEngine: its sync settings and state, the steps of one sync on its
server (pause, reload a bucket, publish, resume, roll back: push.py runs them for every server at
once), what it did (SyncReport), the probe after it, and the shared-server protocol's unit
(SyncUnit, shared_servers.py). VLLMEngine (vllm_engine/engine.py) is generation and restart
recovery over these; nothing here generates.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from rstar2_jax.models import lora
from rstar2_jax.models.checkpoint import save_pretrained
from rstar2_jax.models.decoder import Decoder
from rstar2_jax.models.lora import LoRAConfig
from rstar2_jax.models.resolve import DTYPES
from rstar2_jax.rollout.engines.vllm_engine.client import VLLMClient
from rstar2_jax.rollout.engines.vllm_engine.modes import FILES, Probe, Reload, SyncWait, sync_way
from rstar2_jax.rollout.engines.vllm_engine.settings import VLLMSettings
from rstar2_jax.rollout.engines.vllm_engine.sync import background as background_sync
from rstar2_jax.rollout.engines.vllm_engine.sync.export import Bucket, ExportPlan, ExportSlots, model_plan, param_arrays
from rstar2_jax.rollout.engines.vllm_engine.sync.export_roots import export_root, remove_orphaned_exports
from rstar2_jax.rollout.engines.vllm_engine.sync.payloads import ADAPTERS, WHOLE_WEIGHTS
from rstar2_jax.rollout.engines.vllm_engine.sync.probe import WeightSyncError, probe_logprobs
from rstar2_jax.rollout.engines.vllm_engine.sync.file_server import bind_address, file_server
from rstar2_jax.rollout.engines.vllm_engine.sync.push import push_to_servers
from rstar2_jax.rollout.engines.vllm_engine.sync.reach import default_sync_root
from rstar2_jax.rollout.engines.vllm_engine.sync.report import Landing, SyncReport
from rstar2_jax.rollout.engines.vllm_engine.sync.shared_servers import SyncUnit
from sandbox.job_secret import check_open_service, job_secret

log = logging.getLogger(__name__)


class ServerSyncSteps(SyncUnit):
    """Mixed into VLLMEngine: everything of a sync that concerns its one server."""

    client: VLLMClient
    url: str
    model_name: str
    version: int

    def _check_sync_settings(self, model: Decoder | None, v: VLLMSettings, fetch_url: str | None):
        """Before the server is asked anything: a bad combination raises here."""
        self.way = sync_way(v.sync)  # each mode a typed object (vllm_engine/modes.py)
        self.reload, self.probe, self.sync_wait = Reload(v.reload), Probe(v.probe), SyncWait(v.sync_wait)
        self.landing: Landing | None = None  # sync_wait=export: the last sync, landing or landed
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
        self.sync_host = v.sync_host
        if self.way.needs_fetcher:  # refused now, not at the first sync: the export would be open to the network
            check_open_service("the trainer's weight export server", bind_address(v.sync_host), job_secret())

    def _start_sync_state(self, model: Decoder | None, v: VLLMSettings, *, probe_length: int, nccl_server_ranks: int,
                          bucket_bytes: int):
        """Once the server answered: the export directories and what a sync keeps."""
        sync_dir = v.sync_dir or None
        self.probe_tolerance = v.probe_tolerance
        self.export_dtype = DTYPES[v.export_dtype] if v.export_dtype else None
        self.reloads_after_restart = 0
        self._template = model
        self._graphdef = nnx.split(model)[0] if model is not None else None
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

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """log p(token t | tokens before t) for t >= 1 under the served weights (at T = 1)."""
        out = self.client.request("POST", "/v1/completions", {
            "model": self.served_name, "prompt": [int(t) for t in token_ids], "max_tokens": 1, "temperature": 1.0,
            "prompt_logprobs": 0, "return_token_ids": True})
        entries = out["choices"][0]["prompt_logprobs"]
        return [float(entries[i][str(int(t))]["logprob"]) for i, t in enumerate(token_ids) if i > 0]

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

    @property
    def lands_in_background(self) -> bool:
        """sync_wait=export, for a sync of whole weights through files (adapters and NCCL: waited for)."""
        return self.sync_wait.in_background and self.payload.can_land_in_background and self.way.writes_export

    def settle_sync(self) -> list[str | None]:
        return [r.error for r in background_sync.settle([self])]

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
        from rstar2_jax.rollout.engines.vllm_engine.sync.fetcher import ask_to_fetch
        url = file_server(self._sync_base, self.sync_host).url_for(slot)
        return ask_to_fetch(self.fetch_url, url, bucket.file_name, bucket.dir_name, version)

    def commit_pull(self, version: int) -> str:
        """sync=pull, every bucket reloaded: the fetcher's whole copy (what a roll-back reloads)."""
        from rstar2_jax.rollout.engines.vllm_engine.sync.fetcher import ask_to_commit
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
