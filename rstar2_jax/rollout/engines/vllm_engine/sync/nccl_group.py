"""GPU-to-GPU weight sync into a vLLM server over NCCL (vLLM's native weight transfer,
`--weight-transfer-config '{"backend":"nccl"}'`), through CuPy's NCCL binding (`cupy.cuda.nccl`,
the optional extra `pip install rstar2-jax[nccl]`): no torch on the trainer side.

HAS NOT RUN ON GPUs: it needs a GPU for the learner and another for the server, and the machines
this was written on had none at once with vLLM. What has run (tests/rollout/test_vllm_engine.py):
against a real vLLM CPU server started with the NCCL backend, the request sequence up to where a
GPU is needed, with a recording stand-in for CuPy's module beside it: the server's worker takes
our join request (a standard-base64 unique id of 128 bytes, rank offset 1, the world size,
unpacked broadcasts) and fails only at its accelerator; the update's names, dtypes and shapes pass
vLLM's validation and fail only because no NCCL group exists; and the tensors go out one at a time
in that order. VLLMEngine uses this sender only when asked (`rollout.vllm.sync=nccl`, refused at
launch on a host without GPUs), falls back to the safetensors path when it cannot start, and the
log-prob probe checks the result either way.

Protocol (vLLM 0.32: vllm/distributed/weight_transfer/nccl_engine.py, nccl_common.py): the learner
is NCCL rank 0 and mints the unique id; the server's workers join as ranks 1..world_size-1 through
POST /init_weight_transfer_engine, concurrently with our ncclCommInitRank (there is no store
barrier), then both sides issue a one-element all-reduce (vLLM's warm-up handshake) before
anything else. Per sync: POST /start_weight_update; POST /update_weights with every tensor's HF
name, dtype and shape (it returns once the workers have received them all) while we broadcast
each tensor from rank 0 in that order, one at a time (unpacked); POST /finish_weight_update with
the new weight version. Tensors are laid out and cast on the sending GPU one at a time, gathered
there first when the learner splits them over devices or processes: at most two are held beyond
the learner's state, as with the files path (vllm_engine/sync/export.py).
"""

from __future__ import annotations

import base64
import threading
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp

from rstar2_jax.models import weight_map
from rstar2_jax.rollout.engines.vllm_engine.sync.export import ExportPlan, ExportTensor, one_ahead

NCCL_TYPES = {"float16": 6, "float32": 7, "bfloat16": 9}  # ncclDataType_t (nccl.h)
NCCL_SUM = 0
UNIQUE_ID_BYTES = 128


class NcclUnavailable(RuntimeError):
    """NCCL sync cannot start here (no CuPy or GPU, or the server could not join): use files."""


class CupyNccl:
    """The part of `cupy.cuda.nccl` the sender uses, on the current CUDA device and stream 0."""

    def __init__(self):
        try:
            from cupy.cuda import nccl, runtime
        except ImportError as e:
            raise NcclUnavailable(f"CuPy's NCCL binding is not importable ({e}): pip install 'rstar2-jax[nccl]' "
                                  "(cupy-cuda12x), or use rollout.vllm.sync=files") from e
        if jax.devices()[0].platform != "gpu":
            raise NcclUnavailable("NCCL weight sync needs the learner's parameters on a GPU")
        self._nccl, self._runtime = nccl, runtime

    def unique_id(self) -> tuple[Any, bytes]:
        """(the id as CuPy takes it, its 128 raw bytes)."""
        uid = self._nccl.get_unique_id()  # bytes in CuPy >= 13, a tuple of signed chars before
        raw = bytes(uid) if isinstance(uid, (bytes, bytearray)) else bytes(b & 0xFF for b in uid)
        return uid, raw

    def communicator(self, world_size: int, uid: Any, rank: int):
        return self._nccl.NcclCommunicator(world_size, uid, rank)

    def all_reduce(self, comm, ptr: int, count: int, dtype: int):
        comm.allReduce(ptr, ptr, count, dtype, NCCL_SUM, 0)

    def broadcast(self, comm, ptr: int, count: int, dtype: int, root: int = 0):
        comm.broadcast(ptr, ptr, count, dtype, root, 0)

    def synchronize(self):
        self._runtime.deviceSynchronize()


def update_info(plan: ExportPlan) -> dict:
    """/update_weights' description of every tensor, in the order they are broadcast."""
    tensors = plan.tensors
    return {"names": [t.spec.hf for t in tensors], "dtype_names": [t.dtype.name for t in tensors],
            "shapes": [list(t.hf_shape) for t in tensors]}


def sending_device_tensors(plan: ExportPlan, arrays, device=None) -> Iterable[tuple[ExportTensor, jax.Array]]:
    """Each tensor of the plan in the HF layout and export dtype on `device` (this process's first),
    one after another, the next laid out while the current one is broadcast."""
    device = device or jax.local_devices()[0]

    def lay_out(t: ExportTensor) -> jax.Array:
        x = arrays[t.path]
        if not x.is_fully_addressable:  # split over processes: all take part in the gather
            from rstar2_jax.core.sharding import gathered
            x = gathered(x.astype(t.dtype)).addressable_data(0)
        if x.sharding.device_set != {device}:
            x = jax.device_put(x, device)
        return weight_map.to_hf_on_device(t.spec, x, t.dtype)

    yield from one_ahead(plan.tensors, lay_out)


class NcclWeightSender:
    def __init__(self, client, *, server_ranks: int = 1, nccl: CupyNccl | None = None):
        """client: the server's VLLMClient; server_ranks: its workers (tensor x pipeline parallel);
        nccl: the binding (default CuPy's)."""
        self.nccl = nccl or CupyNccl()
        self.client = client
        self.world_size = 1 + server_ranks
        uid, raw = self.nccl.unique_id()
        if len(raw) != UNIQUE_ID_BYTES:
            raise NcclUnavailable(f"ncclGetUniqueId gave {len(raw)} bytes, not {UNIQUE_ID_BYTES}")
        init_info = {"nccl_unique_id_b64": base64.b64encode(raw).decode(),  # standard base64, as vLLM asks
                     "rank_offset": 1, "world_size": self.world_size, "packed": False}
        joined = _in_thread(client.request, "POST", "/init_weight_transfer_engine", {"init_info": init_info})
        try:
            self.comm = self.nccl.communicator(self.world_size, uid, 0)  # while the workers join
            one = jnp.zeros((1,), jnp.float32).block_until_ready()
            self.nccl.all_reduce(self.comm, one.unsafe_buffer_pointer(), 1, NCCL_TYPES["float32"])  # the handshake
            self.nccl.synchronize()
        finally:
            try:
                joined()
            except Exception as e:  # noqa: BLE001 - the server's workers could not join
                raise NcclUnavailable(f"the server's workers could not join the NCCL group: {e}") from e

    def send(self, plan: ExportPlan, tensors: Iterable[tuple[ExportTensor, jax.Array]], version: int):
        """Broadcast `tensors` (sending_device_tensors of `plan`) and publish `version`."""
        for t in plan.tensors:
            if t.dtype.name not in NCCL_TYPES:
                raise ValueError(f"{t.spec.hf}: dtype {t.dtype.name} has no NCCL type here")
        self.client.request("POST", "/start_weight_update")
        received = _in_thread(self.client.request, "POST", "/update_weights", {"update_info": update_info(plan)})
        for t, x in tensors:  # (a failure here leaves the request waiting for broadcasts: not joined)
            x.block_until_ready()
            self.nccl.broadcast(self.comm, x.unsafe_buffer_pointer(), x.size, NCCL_TYPES[t.dtype.name])
            self.nccl.synchronize()  # the buffer is freed next: NCCL must be done reading it
        try:
            received()  # the workers have every tensor once their /update_weights call returns
        except Exception as e:  # noqa: BLE001
            # vLLM's workers may be left mid-reload (layers without weights): the caller's files
            # sync reloads every tensor (VLLMEngine falls back to it on NcclUnavailable)
            raise NcclUnavailable(f"the server did not take the NCCL update: {e}") from e
        self.client.request("POST", "/finish_weight_update", {"weight_version": str(version)})


def _in_thread(fn, *args: Sequence):
    """Run fn(*args) in a thread; the returned callable joins it and re-raises its error."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join():
        thread.join()
        if "error" in out:
            raise out["error"]
        return out.get("value")
    return join
