"""GPU-to-GPU weight sync into a vLLM server over NCCL, torch-free (vLLM's native weight
transfer, `--weight-transfer-config '{"backend":"nccl"}'`).

NOT YET RUN ON HARDWARE: it needs a GPU for the learner and another for the server, and the
machines this was written on have at most one. It follows vLLM 0.32's protocol as read from
its source (vllm/distributed/weight_transfer/nccl_common.py, nccl_engine.py); VLLMEngine uses
it only when asked (`sync="nccl"`), falls back to the safetensors path when it cannot start,
and the log-prob probe after every sync checks the result either way.

Protocol: the learner is NCCL rank 0 and mints the unique id (`ncclGetUniqueId`); the server's
workers join as ranks 1..world_size-1 through POST /init_weight_transfer_engine with the id in
base64, concurrently with our `ncclCommInitRank`, then both sides issue a one-element
all-reduce (vLLM's warm-up handshake). Per sync: POST /start_weight_update; POST
/update_weights with the names, dtypes and shapes (it returns once the workers received
everything) while we broadcast each tensor from rank 0 in that order (unpacked); POST
/finish_weight_update with the new weight version.

Start the server with: python -m rstar2_jax.rollout.serve --model DIR \
    --vllm_arg=--weight-transfer-config --vllm_arg='{"backend":"nccl"}'
"""

from __future__ import annotations

import base64
import ctypes
import threading
from typing import Mapping

import jax
import jax.numpy as jnp

# ncclDataType_t values (nccl.h)
_NCCL_DTYPES = {jnp.dtype(jnp.float16): 6, jnp.dtype(jnp.float32): 7, jnp.dtype(jnp.bfloat16): 9}


class NcclUnavailable(RuntimeError):
    pass


class NcclWeightSender:
    def __init__(self, client, *, server_ranks: int = 1, library: str = "libnccl.so.2"):
        """client: the server's VLLMClient; server_ranks: its workers (tensor x pipeline parallel)."""
        try:
            self._nccl = ctypes.CDLL(library)
        except OSError as e:
            raise NcclUnavailable(f"cannot load {library}: {e}") from e
        if jax.devices()[0].platform != "gpu":
            raise NcclUnavailable("NCCL weight sync needs the learner's parameters on a GPU")
        self.client = client
        self.world_size = 1 + server_ranks
        unique_id = (ctypes.c_char * 128)()
        self._check(self._nccl.ncclGetUniqueId(unique_id), "ncclGetUniqueId")
        init_info = {"nccl_unique_id_b64": base64.b64encode(bytes(unique_id)).decode(), "rank_offset": 1,
                     "world_size": self.world_size}
        joined = self._in_thread(client.request, "POST", "/init_weight_transfer_engine", {"init_info": init_info})
        self._comm = ctypes.c_void_p()
        self._check(self._nccl.ncclCommInitRank(ctypes.byref(self._comm), self.world_size, unique_id, 0),
                    "ncclCommInitRank")
        one = jnp.zeros((1,), jnp.float32).block_until_ready()
        ptr = one.unsafe_buffer_pointer()
        self._check(self._nccl.ncclAllReduce(ctypes.c_void_p(ptr), ctypes.c_void_p(ptr), ctypes.c_size_t(1),
                                             _NCCL_DTYPES[one.dtype], 0, self._comm, None), "ncclAllReduce (warm-up)")
        joined()

    def send(self, tensors: Mapping[str, jax.Array], version: int):
        """Broadcast HF-named tensors (device arrays, in the server's dtype) and publish `version`."""
        names = list(tensors)
        arrays = [jnp.asarray(tensors[n]).block_until_ready() for n in names]
        for n, a in zip(names, arrays):
            if a.dtype not in _NCCL_DTYPES:
                raise ValueError(f"{n}: dtype {a.dtype} has no NCCL type here")
        self.client.request("POST", "/start_weight_update")
        info = {"names": names, "dtype_names": [a.dtype.name for a in arrays], "shapes": [list(a.shape) for a in arrays]}
        received = self._in_thread(self.client.request, "POST", "/update_weights", {"update_info": info})
        for n, a in zip(names, arrays):
            ptr = ctypes.c_void_p(a.unsafe_buffer_pointer())
            self._check(self._nccl.ncclBroadcast(ptr, ptr, ctypes.c_size_t(a.size), _NCCL_DTYPES[a.dtype], 0,
                                                 self._comm, None), f"ncclBroadcast({n})")
        received()  # the workers have every tensor once their /update_weights call returns
        self.client.request("POST", "/finish_weight_update", {"weight_version": str(version)})

    def _check(self, status: int, what: str):
        if status != 0:
            raise NcclUnavailable(f"{what} failed with ncclResult {status}")

    @staticmethod
    def _in_thread(fn, *args):
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
