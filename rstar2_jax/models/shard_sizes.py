"""One device's share of each parameter, from the architecture alone (no weights, no devices):
the same logical-axis rules that place the tensors (`sharding.logical_to_spec`), over mesh sizes
given as numbers. The memory plan and the engines' plan lines count with these."""

from __future__ import annotations

import functools
import types

import numpy as np

from rstar2_jax.core import sharding
from rstar2_jax.models.config import ModelConfig


def shard_bytes(arch: ModelConfig, mesh: dict[str, int], dtype_bytes: int) -> float:
    """Bytes of one device's shard of every parameter, split by the logical-axis rules."""
    return float(sum(shard_sizes(arch, mesh)) * dtype_bytes)


def shard_sizes(arch: ModelConfig, mesh: dict[str, int]) -> list[int]:
    """Elements of one device's shard of each parameter, split by the logical-axis rules."""
    return [int(np.prod(shard_shape(axes, shape, mesh))) for axes, shape in parameter_layout(arch)]


@functools.lru_cache(maxsize=32)
def parameter_layout(arch: ModelConfig) -> tuple[tuple[tuple, tuple[int, ...]], ...]:
    """(logical axes, shape) of every parameter of `arch`: an abstract model traced once per
    architecture (about a second; a memory plan asks for it many times)."""
    from flax import nnx

    from rstar2_jax.models.checkpoint import abstract_model

    out = []
    for _, var in nnx.to_flat_state(nnx.state(abstract_model(arch), nnx.Param)):
        shape = tuple(var.get_value().shape)
        out.append((tuple(getattr(var, "axes", None) or (None,) * len(shape)), shape))
    return tuple(out)


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
