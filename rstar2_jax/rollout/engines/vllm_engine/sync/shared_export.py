"""Several vLLM servers behind one scheduler that take each sync from one export: the learner
writes the weights once and every server reloads them in parallel (push_to_servers), instead of
one export per server. VLLMEngine.sync_units groups them; the scheduler syncs this unit as it
would one engine (`sync_weights`), without knowing what it holds."""

from __future__ import annotations

from typing import Any, Sequence

from rstar2_jax.rollout.engines.vllm_engine.sync import background as background_sync
from rstar2_jax.rollout.engines.vllm_engine.sync.push import push_to_servers
from rstar2_jax.rollout.engines.vllm_engine.sync.shared_servers import SyncUnit
from rstar2_jax.rollout.engines.vllm_engine.sync.synced_server import SyncedServer


class SharedExport(SyncUnit):
    """One sync unit (shared_servers.py) for VLLMEngines sharing one export."""

    def __init__(self, engines: Sequence[SyncedServer]):
        self.engines = list(engines)

    @property
    def version(self) -> int:
        return min(e.version for e in self.engines)

    def synced_dirs(self) -> dict[str, str]:
        return {url: d for e in self.engines for url, d in e.synced_dirs().items()}

    def sync_error(self) -> str | None:
        return next((err for err in (e.sync_error() for e in self.engines) if err), None)

    @property
    def lands_in_background(self) -> bool:
        return self.engines[0].lands_in_background

    def update_weights(self, params: Any, version: int) -> None:
        push = background_sync.push_in_background if self.lands_in_background else push_to_servers
        push(self.engines, params, version)

    def adopt_weights(self, params: Any, version: int, synced: dict[str, str] | None = None) -> None:
        for e in self.engines:
            e.adopt_weights(params, version, synced)

    def expect_landing(self, params: Any, version: int) -> None:
        """The primary lands the one export behind: one verdict for every server."""
        background_sync.await_landing(self.engines, version)

    def settle_sync(self) -> list[str | None]:
        """The one landing, once (each engine's own settle_sync would count it once per server)."""
        return [r.error for r in background_sync.settle(self.engines)]

    def export_error(self) -> str | None:
        return self.engines[0].export_error()

    def take_part_in_sync(self, params: Any) -> None:
        """One export's collectives (the primary makes one, not one per server)."""
        self.engines[0].take_part_in_sync(params)
