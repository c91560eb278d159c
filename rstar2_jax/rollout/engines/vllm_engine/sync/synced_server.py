"""SyncedServer: what the sync's functions (push.py, background.py, adapters.py, payloads.py)
use of one server's engine, as a type. VLLMEngine (server_steps.ServerSyncSteps) is the one
implementation; the functions name this protocol, not the engine, which imports them."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # types only; none of these modules imports this one
    from jax.typing import DTypeLike

    from rstar2_jax.models.decoder import Decoder
    from rstar2_jax.models.lora import LoRAConfig
    from rstar2_jax.rollout.engines.vllm_engine.client import VLLMClient
    from rstar2_jax.rollout.engines.vllm_engine.modes import Probe, Reload, SyncWay
    from rstar2_jax.rollout.engines.vllm_engine.sync.export import Bucket, ExportPlan, ExportSlots
    from rstar2_jax.rollout.engines.vllm_engine.sync.report import Landing, SyncReport


class SyncedServer(Protocol):
    url: str
    version: int
    model_name: str
    client: VLLMClient
    way: SyncWay
    reload: Reload
    probe: Probe
    export_dtype: DTypeLike | None  # None: the params' own
    adapters: LoRAConfig | None
    slots: ExportSlots
    sync_root: str
    sync_base: str
    sync_host: str
    fetch_url: str | None
    synced_dir: str | None
    probe_tokens: list[int]
    landing: Landing | None  # sync_wait=export: the last sync, landing or landed (background.py)
    closing: threading.Event
    pending_probe: concurrent.futures.Future | None
    loaded_adapters: dict[int, str]
    loads_adapters: bool
    sync_failures: int
    reloads_after_restart: int
    last_sync: SyncReport | None

    def as_model(self, params: Any) -> Decoder: ...
    def export_plan(self, model: Decoder) -> ExportPlan: ...
    def pause(self) -> None: ...
    def reload_part(self, bucket_dir: str) -> None: ...
    def fetch_part(self, slot: str, bucket: Bucket, version: int) -> str: ...
    def commit_pull(self, version: int) -> str: ...
    def publish(self, version: int) -> None: ...
    def resume(self) -> None: ...
    def roll_back(self) -> None: ...
    def landed(self, synced_dir: str, version: int) -> None: ...
    def adopt_weights(self, params: Any, version: int, synced: dict[str, str] | None = None) -> None: ...
    def synced_dirs(self) -> dict[str, str]: ...
    def sync_error(self) -> str | None: ...
    def export_error(self) -> str | None: ...
    def take_part_in_sync(self, params: Any) -> None: ...
    @property
    def lands_in_background(self) -> bool: ...
    def reload_whole_weights(self) -> None: ...
    def probe_verdict(self) -> float | None: ...
    def check_sync(self, model: Decoder, ours: Any = None) -> float: ...
