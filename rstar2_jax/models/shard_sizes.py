"""One device's share of each parameter, from the architecture alone (no weights, no devices):
the same logical-axis rules that place the tensors (`sharding.logical_to_spec`), over mesh sizes
given as numbers. The memory plan and the engines' plan lines count with these."""

from __future__ import annotations

import types

import numpy as np

from rstar2_jax import sharding
from rstar2_jax.models.config import ModelConfig


def shard_bytes(arch: ModelConfig, mesh: dict[str, int], dtype_bytes: int) -> float:
    """Bytes of one device's shard of every parameter, split by the logical-axis rules."""
    return float(sum(shard_sizes(arch, mesh)) * dtype_bytes)


def shard_sizes(arch: ModelConfig, mesh: dict[str, int]) -> list[int]:
    """Elements of one device's shard of each parameter, split by the logical-axis rules."""
    from flax import nnx

    from rstar2_jax.models.checkpoint import abstract_model

    sizes = []
    for _, var in nnx.to_flat_state(nnx.state(abstract_model(arch), nnx.Param)):
        shape = var.get_value().shape
        sizes.append(int(np.prod(shard_shape(getattr(var, "axes", None) or (None,) * len(shape), shape, mesh))))
    return sizes


def shard_shape(axes, shape, mesh: dict[str, int]) -> tuple[int, ...]:
    """One device's part of a tensor with logical `axes`, by the same rules that place it
    (`sharding.logical_to_spec`: a dimension a mesh axis does not divide stays whole)."""
    spec = sharding.logical_to_spec(axes, shape, types.SimpleNamespace(shape=mesh))  # reads only .shape
    out = []
    for dim, part in zip(shape, spec):
        parts = (part,) if isinstance(part, str) else (part or ())
        out.append(dim // int(np.prod([mesh[a] for a in parts])) if parts else dim)
    return tuple(out)


def split_dim(size: int, axis: str, mesh: dict[str, int]) -> int:
    """A dimension of logical `axis` on one device."""
    return shard_shape((axis,), (size,), mesh)[0]
