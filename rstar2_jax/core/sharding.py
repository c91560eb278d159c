"""Device mesh and logical-axis sharding rules.

Every parameter and activation of the decoder is annotated with *logical* axis names
('embed', 'mlp', 'vocab', ...). A rule table maps each logical name to a mesh axis of the
(data, fsdp, tensor) mesh, so one table decides how the whole model is laid out:

- fsdp shards parameters (and the batch) and gathers them per layer (ZeRO-3 style);
- tensor shards heads, MLP width and vocabulary (Megatron style);
- data replicates parameters and shards the batch.

A dimension whose size the mesh axis does not divide is replicated instead (e.g. 2 KV heads on
a tensor axis of 4), so any config runs on any mesh, at worst with less sharding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstar2_jax.core.config_types import Section, setting

MESH_AXES = ("data", "fsdp", "tensor")
# What JAX can use of one device with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (the recipes' setting;
# JAX's default is 0.75), from the memory the device reports: H100 80 GB 79.6 GiB, H200 (as the
# lent machines report it) 139 GiB, MI300X 192 GiB.
DEVICE_MEMORY_GIB = {"h100": 76.0, "h200": 132.0, "mi300x": 182.0}


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
    """`mesh.*`: the (data, fsdp, tensor) mesh over all devices (used when there is more than one)."""
    data: int = setting(1, "batch-parallel replicas (-1: the devices the other axes leave)", min=-1)
    fsdp: int = setting(-1, "parameter and batch shards, gathered per layer (-1: the rest)", min=-1)
    tensor: int = setting(1, "shards of heads, MLP width and vocabulary (-1: the rest)", min=-1)
    devices_per_process: int = setting(0, "devices each trainer process drives (a host's GPUs), for the memory "
                                       "plan and its engine; 0: the mesh's devices over the processes", min=0)
    device_memory_gb: float = setting(0.0, "memory of one device in GiB, for the memory plan's check before "
                                      "launch (0: mesh.device_kind's, else what the device reports; a CPU "
                                      "reports none)", min=0.0)
    device_kind: str = setting("", "the accelerator a plan is made for, which brings its memory (DEVICE_MEMORY_GIB: "
                               "h100 76, h200 132, mi300x 182 GiB usable); '' : mesh.device_memory_gb or what the "
                               "device reports", choices=("",) + tuple(DEVICE_MEMORY_GIB))

    def axes(self) -> dict[str, int]:
        """{data, fsdp, tensor}: the make_mesh arguments."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def rules(self):
        sizes = self.axes()
        for axis, size in sizes.items():
            if size == 0:
                yield axis, "must be >= 1, or -1 for the devices the other axes leave"
        if list(sizes.values()).count(-1) > 1:
            yield "", f"at most one mesh axis may be -1, got {sizes}"

# logical axis -> mesh axis (or tuple of mesh axes, or None for replicated)
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("sequence", None),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("cache_sequence", None),
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh. One axis may be -1: it takes the remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} tensor={tensor}")
    if -1 in sizes:
        known = int(np.prod([s for s in sizes if s != -1]))
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices cannot be split into data={data} fsdp={fsdp} tensor={tensor}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} needs "
                         f"{int(np.prod(sizes))} devices, have {len(devices)}")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def logical_to_spec(axes: Iterable[str | None], shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None, rules=DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec for logical `axes`; with `shape` and `mesh`, non-divisible dims replicate."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for i, name in enumerate(axes):
        if name is not None and name not in table:
            raise KeyError(f"no sharding rule for logical axis {name!r}")
        mesh_axes = table.get(name) if name is not None else None
        if isinstance(mesh_axes, str):
            mesh_axes = (mesh_axes,)
        if mesh_axes:
            # A mesh axis can shard only one dimension of a tensor.
            mesh_axes = tuple(a for a in mesh_axes if a not in used)
            if mesh is not None:
                mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1)
            if shape is not None and mesh is not None and mesh_axes:
                size = int(np.prod([mesh.shape[a] for a in mesh_axes]))
                if shape[i] % size:
                    mesh_axes = ()
        if not mesh_axes:
            spec.append(None)
        else:
            used.update(mesh_axes)
            spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, axes: Iterable[str | None], shape: Sequence[int] | None = None,
                   rules=DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))


def param_shardings(state, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings for an `nnx.State` (or abstract state) of annotated parameters.

    Each variable carries its logical axes as the `axes` metadata set by the model.
    """
    from flax import nnx

    def one(var):
        axes = getattr(var, "axes", None)
        value = var.get_value() if hasattr(var, "get_value") else var.value
        if axes is None:
            axes = (None,) * len(value.shape)
        return var.replace(named_sharding(mesh, axes, value.shape, rules))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def constrain(x: jax.Array, axes: Sequence[str | None], rules=DEFAULT_RULES) -> jax.Array:
    """Sharding constraint on an activation when a mesh is set (`jax.set_mesh`), else a no-op."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh, rules))


def gathered(x: jax.Array) -> jax.Array:
    """`x` whole on every device of its mesh. An array sharded over several processes cannot be
    read by any one of them (np.asarray fails); its replicated copy can."""
    if x.is_fully_addressable:
        return x
    return resharder(NamedSharding(x.sharding.mesh, PartitionSpec()))(x)


@functools.cache
def resharder(target: jax.sharding.Sharding):
    """The identity, compiled to put its output on `target`: one jitted function per target, so
    a tensor shape is traced and compiled once per process. (A fresh `jax.jit(lambda ...)` per
    call traced, lowered and looked the program up again for every tensor of every weight sync
    and every update's gathers: 1.4 s of each 3-step, two-process tiny run's 1.5 s syncs.)"""
    return jax.jit(lambda a: a, out_shardings=target)


@functools.cache
def caster(dtype):
    """`x.astype(dtype)` (None: kept) as a jitted function, one per dtype: a fresh buffer either
    way, never the argument's."""
    return jax.jit(lambda x: x if dtype is None else x.astype(dtype))
