"""The learner's weights as HF-named safetensors files, written bucket by bucket, for vLLM servers.

    plan = model_plan(model, dtype, bucket_bytes)       # which tensors go in which bucket
    slots = ExportSlots(root)                           # two directories, used in turn
    slot = slots.begin(plan)
    for bucket in plan.buckets:
        part = slots.write(slot, bucket, param_arrays(model))  # one bucket's file; the servers load it
    slots.commit(slot)                                  # the newest whole export

Why streaming: the export used to gather every tensor, cast and laid out, then write one file:
the whole model in the export dtype was held beside the learner's state (59 GB on one GPU for a
14B run). Here a device holds at most two tensors in the export dtype beyond the learner's own
state (the one being copied to the host and the next), and the servers reload bucket k while
bucket k+1 is written (push.push_to_servers); a bucket lives in host memory (the file).

Why whole decoder layers per bucket: vLLM's in-place reload processes a layer once every tensor of
it has arrived (its fused q/k/v and gate/up projections are loaded from several checkpoint tensors),
and keeps the old weights of a layer that received none. A bucket of whole layers is a valid partial
reload; a layer split over two buckets would leave half of its fused weight unset.

Why the writer is written this way (measured on the 2-core CPU VM, BENCHMARKS.md "vLLM weight
sync"): a safetensors file is a JSON header and raw bytes, so each tensor is written straight into
the file's pages (mmap) at its offset, with no intermediate copy; on CPU the HF layout change (a
transpose) is done while writing, STRIP_ROWS source rows at a time, so each destination row
receives whole cache lines per strip (faster than XLA's CPU transpose and numpy's whole-array
one), and the copy of a tensor is split over the host's cores by rows of the destination. On an
accelerator the device lays the tensor out (fast there) and the host copies contiguous bytes. The
two slots are reused from sync to sync: rewriting pages that exist runs at memory speed, allocating
fresh tmpfs pages does not; and the previous whole export stays intact while the next is written,
so a sync that fails half-way can be undone.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import mmap
import os
import re
import shutil
from typing import Any, Iterable, Iterator, Mapping, Sequence

import jax
import numpy as np

from rstar2_jax.models import weight_map
from rstar2_jax.models.weight_map import WeightSpec

# Source rows per strip of the host transpose (ours [in, out] -> HF's [out, in]): each strip
# writes `STRIP_ROWS` contiguous values per destination row. 64 float32 (256 bytes, four cache
# lines) against 16: the export alone 1.51-1.70 GB/s against 1.06-1.17 on a 2-core VM, 32 and
# 128-256 in between (BENCHMARKS.md, "vLLM weight sync to 2 CPU servers (files)").
STRIP_ROWS = 64
# Threads copying one tensor into the export, and the least bytes worth a thread of their own.
MAX_EXPORT_THREADS = 8
MIN_PART_BYTES = 1 << 20
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class ExportTensor:
    """One parameter as the servers read it: its HF name, layout rule and shapes."""
    path: str                     # our parameter path, e.g. "layers.3.mlp.up_proj"
    spec: WeightSpec              # HF name and layout kind (models/weight_map.py)
    shape: tuple[int, ...]        # ours
    hf_shape: tuple[int, ...]
    dtype: np.dtype               # as written

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.hf_shape)) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Bucket:
    index: int
    tensors: tuple[ExportTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def file_name(self) -> str:
        return f"model-b{self.index:05d}.safetensors"

    @property
    def dir_name(self) -> str:
        """The bucket's own directory (a link to its file): what a partial reload reads."""
        return f"b{self.index:05d}"


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    buckets: tuple[Bucket, ...]
    bucket_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def file_names(self) -> list[str]:
        return [b.file_name for b in self.buckets]

    @property
    def tensors(self) -> list[ExportTensor]:
        """Every tensor, in the export's order."""
        return [t for b in self.buckets for t in b.tensors]


def layer_key(hf_name: str) -> str:
    """Which decoder layer a tensor belongs to ("top" for the embedding, final norm and head)."""
    m = _LAYER.match(hf_name)
    return m.group(1) if m else "top"


def export_plan(shapes: Mapping[str, Sequence[int]], dtype, bucket_bytes: int) -> ExportPlan:
    """Buckets of whole decoder layers, in the model's order, each up to `bucket_bytes` in `dtype`
    (a layer larger than that is a bucket of its own). `shapes`: our parameter path -> shape."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    dtype = np.dtype(dtype)
    specs = weight_map.weight_specs(list(shapes))
    groups: dict[str, list[ExportTensor]] = {}
    for path, shape in shapes.items():
        spec = specs[path]
        shape = tuple(int(d) for d in shape)
        groups.setdefault(layer_key(spec.hf), []).append(
            ExportTensor(path, spec, shape, tuple(weight_map.hf_shape(spec, shape)), dtype))
    order = sorted(groups, key=lambda k: (k != "top", int(k) if k.isdigit() else -1))
    buckets: list[list[ExportTensor]] = [[]]
    for key in order:
        size = sum(t.nbytes for t in groups[key])
        if buckets[-1] and sum(t.nbytes for t in buckets[-1]) + size > bucket_bytes:
            buckets.append([])
        buckets[-1].extend(sorted(groups[key], key=lambda t: t.spec.hf))
    return ExportPlan(tuple(Bucket(i, tuple(ts)) for i, ts in enumerate(buckets) if ts), int(bucket_bytes))


def param_arrays(model) -> dict[str, Any]:
    """Our parameter path -> its array (or ShapeDtypeStruct, for an abstract model)."""
    from flax import nnx

    from rstar2_jax.models.checkpoint import _param_paths
    return {path: var.get_value() for path, var in _param_paths(nnx.state(model, nnx.Param)).items()}


def model_plan(model, dtype, bucket_bytes: int) -> ExportPlan:
    """export_plan for a Decoder (real or abstract); dtype None: the parameters' own."""
    arrays = param_arrays(model)
    dtype = dtype or next(iter(arrays.values())).dtype
    return export_plan({path: x.shape for path, x in arrays.items()}, dtype, bucket_bytes)


def safetensors_header(bucket: Bucket) -> bytes:
    """The file's header (length-prefixed JSON, padded to 8 bytes as the format asks)."""
    offset, entries = 0, {}
    for t in bucket.tensors:
        name = t.dtype.name
        if name not in SAFETENSORS_DTYPES:
            raise ValueError(f"{t.spec.hf}: dtype {name} cannot be exported (one of {sorted(SAFETENSORS_DTYPES)})")
        entries[t.spec.hf] = {"dtype": SAFETENSORS_DTYPES[name], "shape": list(t.hf_shape),
                              "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header


def lays_out_on_device() -> bool:
    """Whether the device changes the layout (accelerators), or the host while writing (CPU)."""
    return jax.devices()[0].platform != "cpu"


def laid_out_by_device(x: jax.Array) -> bool:
    """Whether host_tensors gives `x` in the HF layout: on an accelerator, for a tensor on one
    device. A tensor split over devices is cast where it lies and laid out by the host: XLA would
    replicate the transposed copy on every device (measured: tests/rl/plan_memory_main.py)."""
    return lays_out_on_device() and len(x.sharding.device_set) == 1


def one_ahead(items: Sequence, dispatch) -> Iterator[tuple[Any, Any]]:
    """(item, dispatch(item)) for each item, item k+1's dispatched before item k is handed out:
    the device works on the next tensor while the caller copies or sends the current one, and at
    most two results are alive."""
    ahead = dispatch(items[0]) if items else None
    for i, item in enumerate(items):
        current, ahead = ahead, dispatch(items[i + 1]) if i + 1 < len(items) else None
        yield item, current
        del current


def host_tensors(bucket: Bucket, arrays: Mapping[str, jax.Array], to_host: bool = True) -> Iterator[np.ndarray | None]:
    """The bucket's tensors on the host, one after another: in the HF layout when the device lays
    them out (a tensor on one accelerator; see lays_out_on_device), else in ours (write_bucket
    transposes: on CPU, and for a tensor split over devices). Cast on the device either way (half
    the bytes cross for bf16). Tensor k+1's device work and its copy to the host are started before
    tensor k is handed out, so the device lays out and sends one while the host copies the other
    (the overlap of the transfer is not measured on a GPU yet): at most two tensors in the export
    dtype are held on a device beyond the learner's state (whole, when the parameters are split
    over processes: each is gathered; to_host=False: only that, for a process that does not write)."""
    def dispatch(t: ExportTensor):
        x = arrays[t.path]
        if laid_out_by_device(x):
            return weight_map.to_hf_on_device(t.spec, x, t.dtype)
        x = x.astype(t.dtype) if x.dtype != t.dtype else x
        if not x.is_fully_addressable:  # split over processes: every process takes part in the gather
            from rstar2_jax.core.sharding import gathered
            x = gathered(x).addressable_data(0)
        return x

    def dispatch_and_send(t: ExportTensor):
        x = dispatch(t)
        if to_host:  # the device-to-host copy starts now, beside the host's copy of the tensor before
            x.copy_to_host_async()
        return x

    for _, x in one_ahead(bucket.tensors, dispatch_and_send):
        if to_host:
            yield np.asarray(x)
        else:  # waited for all the same: one gather at a time (processes.local_copy says why)
            jax.block_until_ready(x)
            yield None
        del x


def take_part(plan: ExportPlan, arrays: Mapping[str, jax.Array], start: int = 0):
    """The export's collectives without the export, from bucket `start` on: what a trainer process
    other than the one that writes runs (the parameters are split over processes, so each tensor
    is gathered by all of them, in the same order), and what the writer runs after a failure."""
    if jax.process_count() == 1:
        return
    for bucket in plan.buckets[start:]:
        for _ in host_tensors(bucket, arrays, to_host=False):
            pass


def export_threads() -> int:
    """Threads that copy into the export: the cores this process may run on, at most 8."""
    return max(1, min(MAX_EXPORT_THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


_POOL: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None


def _copy_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of at least `threads` threads, kept between exports."""
    global _POOL
    if _POOL is None or _POOL[0] < threads:
        if _POOL is not None:
            _POOL[1].shutdown(wait=False)
        _POOL = threads, concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="weight-export")
    return _POOL[1]


def _transpose_rows(dst: np.ndarray, src: np.ndarray):
    """dst[o, i] = src[i, o], STRIP_ROWS source rows at a time."""
    for i in range(0, src.shape[0], STRIP_ROWS):
        np.copyto(dst[:, i:i + STRIP_ROWS], src[i:i + STRIP_ROWS].T)


def copy_to_hf(dst: np.ndarray, x: np.ndarray, transpose: bool, threads: int | None = None,
               min_part_bytes: int = MIN_PART_BYTES):
    """Copy tensor `x` into `dst` (HF's shape), transposing ours [in, out] to HF's [out, in] when
    `transpose`; split over `threads` (export_threads() by default) by ranges of dst's rows, each
    thread writing its own contiguous part of the file. numpy's copy releases the GIL, and one
    thread's strided copy leaves the memory system idle most of the time: the export on 2 threads
    on a 2-core VM 1.7-1.8x one (BENCHMARKS.md, "vLLM weight sync to 2 CPU servers (files)")."""
    src = x.reshape(dst.shape[::-1]) if transpose else x.reshape(dst.shape)
    threads = export_threads() if threads is None else threads
    rows = dst.shape[0]
    parts = min(threads, max(1, dst.nbytes // min_part_bytes), rows)
    if parts <= 1:
        return _transpose_rows(dst, src) if transpose else np.copyto(dst, src)
    cuts = [rows * j // parts for j in range(parts + 1)]

    def part(j: int):
        a, b = cuts[j], cuts[j + 1]
        return _transpose_rows(dst[a:b], src[:, a:b]) if transpose else np.copyto(dst[a:b], src[a:b])
    pool = _copy_pool(parts)
    futures = [pool.submit(part, j) for j in range(parts)]
    concurrent.futures.wait(futures)  # every part done before any error surfaces: the mmap closes after
    for f in futures:
        f.result()


def write_bucket(path: str, bucket: Bucket, tensors: Iterable[np.ndarray], laid_out: Sequence[bool]):
    """Write `bucket` to the safetensors file `path`, rewriting in place when it already has this
    size (its pages exist: memory speed), each tensor straight to its offset; `laid_out[i]`:
    tensor i is in the HF layout (else ours, transposed here)."""
    header = safetensors_header(bucket)
    size = len(header) + bucket.nbytes
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size != size:
            try:  # reserve the pages now: a full tmpfs would otherwise kill the writer with SIGBUS mid-copy
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise OSError(e.errno, f"no room for the weight export's {size / 2**20:.0f} MiB bucket in "
                                       f"{os.path.dirname(path)} ({e.strerror}): set rollout.vllm.sync_dir to a "
                                       "larger directory the servers can read") from e
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as mm:
            mm[:len(header)] = header
            offset = len(header)
            for t, x, hf in zip(bucket.tensors, tensors, laid_out):
                dst = np.frombuffer(mm, np.uint8, t.nbytes, offset).view(t.dtype).reshape(t.hf_shape)
                copy_to_hf(dst, x, transpose=t.spec.kind == "linear" and not hf)
                offset += t.nbytes
                del dst  # the mmap cannot close while a view of it lives
    finally:
        os.close(fd)


class ExportSlots:
    """Two export directories under `root`, written in turn. A slot holds every bucket's file
    (flat: what a whole reload or a fetcher reads) and, per bucket, a directory with a link to
    its file (what a partial reload reads). `latest` is the newest whole export."""

    def __init__(self, root: str):
        self.root = root
        self.latest: str | None = None

    def begin(self, plan: ExportPlan) -> str:
        """The slot the next export goes to (not `latest`), laid out for `plan`."""
        slot = os.path.join(self.root, "slot-b" if self.latest and self.latest.endswith("slot-a") else "slot-a")
        os.makedirs(slot, exist_ok=True)
        wanted = set(plan.file_names) | {b.dir_name for b in plan.buckets}
        for name in os.listdir(slot):  # another plan's leftovers (a changed bucket size)
            if name not in wanted:
                p = os.path.join(slot, name)
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
        for b in plan.buckets:
            link = os.path.join(self.bucket_dir(slot, b), "model.safetensors")
            if not os.path.lexists(link):
                os.makedirs(os.path.dirname(link), exist_ok=True)
                os.symlink(os.path.join("..", b.file_name), link)
        return slot

    @staticmethod
    def bucket_dir(slot: str, bucket: Bucket) -> str:
        """The directory a partial reload of `bucket` reads (a link to its file in `slot`)."""
        return os.path.join(slot, bucket.dir_name)

    def write(self, slot: str, bucket: Bucket, arrays: Mapping[str, jax.Array]) -> str:
        """Bucket `bucket` of `arrays` (our parameter path -> array) into `slot`; its directory."""
        laid_out = [laid_out_by_device(arrays[t.path]) for t in bucket.tensors]
        tensors = host_tensors(bucket, arrays)
        try:
            write_bucket(os.path.join(slot, bucket.file_name), bucket, tensors, laid_out)
        finally:
            for _ in tensors:  # a failed write still takes part in the rest of the bucket's gathers
                pass
        return self.bucket_dir(slot, bucket)

    def commit(self, slot: str):
        self.latest = slot

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)
