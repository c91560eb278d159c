"""The vLLM engine's modes as typed objects, chosen once from `rollout.vllm.*` (vllm_engine/kind.py) or
VLLMEngine's arguments and asked what they do, never compared as strings:

- `SyncWay` (rollout.vllm.sync): how an export's buckets reach a server. FILES: the server reads
  the export where the learner wrote it. PULL: the fetcher beside the server copies each bucket
  over HTTP first (vllm_engine/sync/pull.py; no shared filesystem). NCCL: a GPU broadcast, no files
  (vllm_engine/sync/nccl_group.py). FILES and PULL share one export among several servers (push_to_servers).
- `Reload` (rollout.vllm.reload): staged (one reload of the whole export per server) or streamed
  (each bucket reloaded as it is written).
- `Probe` (rollout.vllm.probe): whether the trainer waits for each sync's log-prob probe.
- `SyncWait` (rollout.vllm.sync_wait): what a sync returns after (vllm_engine/sync/background.py).

A new sync way is a `SyncWay` subclass here and its registration in SYNC_WAYS.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, ClassVar

from rstar2_jax.core.registry import Registry

if TYPE_CHECKING:  # for annotations only: the engine hands itself to its way
    from rstar2_jax.rollout.engines.vllm_engine.sync.export import Bucket


class SyncWay:
    """How a sync's export reaches one server (its engine: `engine` below)."""
    name: ClassVar[str]
    writes_export: ClassVar[bool] = True    # the learner writes the export as files (one export, several servers)
    needs_fetcher: ClassVar[bool] = False   # a fetcher beside each server copies it (rollout.vllm.fetch_urls)
    carries_adapters: ClassVar[bool] = True  # LoRA adapters can go this way (as files)
    keeps_own_copy: ClassVar[bool] = False  # each server ends with a copy of its own (the export can go)
    servers_read_export: ClassVar[bool] = False  # the servers read the export where it is written (sync_dir)
    needs_gpu: ClassVar[bool] = False       # it runs from the learner's GPUs

    def bucket_source(self, engine, slot: str, bucket: Bucket, bucket_dir: str, version: int) -> str:
        """Where `engine`'s server reloads a written bucket from."""
        return bucket_dir

    def landed_dir(self, engine, slot: str, version: int) -> str:
        """The whole export as the server holds it once every bucket is in (what a roll-back reloads)."""
        return slot

    def __repr__(self) -> str:
        return self.name


class Files(SyncWay):
    name = "files"
    servers_read_export = True


class Pull(SyncWay):
    name = "pull"
    needs_fetcher = True
    keeps_own_copy = True

    def bucket_source(self, engine, slot, bucket, bucket_dir, version):
        return engine.fetch_part(slot, bucket, version)

    def landed_dir(self, engine, slot, version):
        return engine.commit_pull(version)


class Nccl(SyncWay):
    name = "nccl"
    writes_export = False  # a broadcast from one whole local copy on the process's first device
    needs_gpu = True
    carries_adapters = False


FILES, PULL, NCCL = Files(), Pull(), Nccl()
SYNC_WAYS: Registry[SyncWay] = Registry("sync way")
for _way in (FILES, PULL, NCCL):
    SYNC_WAYS.register(_way.name, _way)


def sync_way(way: str | SyncWay) -> SyncWay:
    return way if isinstance(way, SyncWay) else SYNC_WAYS[way]


class Reload(enum.Enum):
    STAGED = "staged"      # every bucket written (and fetched) while the servers generate, then one reload each
    STREAMED = "streamed"  # each bucket reloaded while the next is written (paused from the first reload)

    @property
    def reloads_each_bucket(self) -> bool:
        return self is Reload.STREAMED


class Probe(enum.Enum):
    DEFERRED = "deferred"  # beside the next rollouts; a mismatch raises at the next sync
    WAIT = "wait"          # the trainer waits for it every sync

    @property
    def waited_for(self) -> bool:
        return self is Probe.WAIT


class SyncWait(enum.Enum):
    RELOAD = "reload"  # a sync returns once every server holds the new weights
    EXPORT = "export"  # ... once the export is whole: the reload lands behind (vllm_engine/sync/background.py)

    @property
    def in_background(self) -> bool:
        return self is SyncWait.EXPORT


def names(modes: type[enum.Enum]) -> tuple[str, ...]:
    """The setting's choices: the modes' names as the config spells them."""
    return tuple(m.value for m in modes)
