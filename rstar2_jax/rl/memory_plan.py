"""What one device of a run holds, from the config alone: the memory plan `train --plan` prints and
`train` checks before it loads a weight.

Every line is arithmetic over the architecture (config.json), the mesh and the rollout settings,
following what the code allocates:

- parameters: float32 master weights, each tensor split by the logical-axis rules over the
  learner's mesh (`sharding.logical_to_spec`; a dimension a mesh axis does not divide stays whole);
- gradients: float32. The backward forms a layer's gradients as it frees that layer's
  activations, so at the peak (the start of the backward) only the first ones formed, the LM
  head's (the largest tensor), sit beside the activations; with several micro-batches the
  accumulator (a whole float32 copy) is held through every micro-batch as well. The optimizer's
  update is fused into the parameters in place (they are donated);
- optimizer: AdamW's two float32 moments;
- activations: one micro-batch's rows on this device, every sequence padded to rollout.max_len
  (the worst case), in the compute dtype. What each layer keeps for the backward pass depends on
  model.remat (none: every intermediate; dots: the matmul outputs; full: the layer's input), plus
  one layer's working set while its gradient is formed (values and their cotangents), plus the
  score matrices of XLA attention (float32; cuDNN's flash attention keeps none), plus one chunk of
  float32 logits (models/logprobs.py; their cotangent is cast to the compute dtype in place);

The gradient and activation lines are calibrated against XLA:GPU: on an H200, the plan's total
came within 6% of the compiled update's arguments + temporaries (memory_analysis) for Qwen3-0.6B
and 1.7B at 4-8 rows x 4096, one and two micro-batches (BENCHMARKS.md "Memory plan against JAX on
one GPU"; the sum of every line was 1.16-1.52x before). XLA:CPU schedules differently (it keeps
two gradient-sized trees and gains nothing from remat), so CPU tests check the state and sync
lines, which are exact on both;
- engine weights: the embedded engine's copy in the compute dtype, split over the process's devices
  (`engine_mesh`; whole on one device with the Pallas decode kernel). None when it shares the
  learner's (float32, one device, one process, on-policy), or when rollouts run on vLLM servers;
- KV pool: the embedded engine's cache (paged: its pages; else slots x max_len), split by KV heads;
- weight sync (vLLM runs): what the sync holds on a device beyond the learner's state. One trainer
  process: two tensors in the export dtype (the one being copied to the host and the next being
  laid out: vllm_engine/sync/export.host_tensors), the two largest, split over the learner's mesh as the
  parameters are; the export's buckets live in host memory. Several trainer processes: the same
  two, whole (each tensor is gathered over the processes). NCCL: a whole float32 copy on each
  process's first device;
- allowance: XLA's workspace, compiled programs and fragmentation, taken as 5% of the device (an
  allowance, not a measurement: a device check of the plan against JAX's peak is in SCALING.md).

The figures are the model's; `tests/rl/test_memory_plan.py` checks them against hand-computed
numbers for Qwen3-0.6B, 1.7B and 14B.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from rstar2_jax.learner.packing import segment_bound
from rstar2_jax.learner.settings import AUTO_TOKEN_BUDGET
from rstar2_jax.models.config import ModelConfig
from rstar2_jax.models.logprobs import LOGPROB_CHUNK
from rstar2_jax.models.shard_sizes import shard_bytes, shard_shape, split_dim
from rstar2_jax.models.resolve import DTYPES
from rstar2_jax.rl.config import RunConfig
from rstar2_jax.rollout.engines.engine_kind import EnginePlanInputs
from rstar2_jax.rollout.engines.engine_kind import PlanLine as Line  # one line type: the engines add theirs
from rstar2_jax.rollout.engines.factory import engine_kind
from rstar2_jax.core.sharding import DEVICE_MEMORY_GIB

GiB = 2**30
ALLOWANCE_FRACTION = 0.05

# What to change when a learner's line does not fit (an engine's lines carry their own: PlanLine.remedy).
REMEDIES = {
    "parameters": "a larger mesh (mesh.fsdp, mesh.tensor)",
    "gradients": "a larger mesh (mesh.fsdp, mesh.tensor)",
    "optimizer": "a larger mesh (mesh.fsdp, mesh.tensor)",
    "activations": "more rl.micro_batches (fewer rows at once; packed: a smaller rl.token_budget or "
                   "rl.segments_per_row), model.remat=full, model.attention=cudnn, or a larger mesh.fsdp",
}


class MemoryPlanError(ValueError):
    """A run whose memory plan does not fit its devices (train refuses it before loading weights)."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    lines: tuple[Line, ...]
    capacity: float | None          # bytes per device; None: unknown (CPU), nothing is checked
    mesh: dict[str, int]
    engine_devices: int
    # the names of the lines on the engine's own devices (rollout.jax.devices); empty: every line
    # is on every device (the engine shares the learner's)
    engine_apart: tuple[str, ...] = ()

    def side(self, engine: bool) -> tuple[Line, ...]:
        """The lines one device holds: a learner's (engine=False) or, apart, an engine's."""
        if not self.engine_apart:
            return self.lines
        return tuple(line for line in self.lines
                     if (line.name in self.engine_apart) == engine or line.name == "allowance")

    @property
    def total(self) -> float:
        """The fullest device's bytes."""
        return max(sum(line.bytes for line in self.side(engine)) for engine in (False, True))

    def line(self, name: str) -> Line:
        return next(line for line in self.lines if line.name == name)

    def overflow(self) -> Line | None:
        """The first line at which a device's running total passes its memory (None: it fits)."""
        if self.capacity is None:
            return None
        for engine in (False, True):
            running = 0.0
            for line in self.side(engine):
                running += line.bytes
                if running > self.capacity:
                    return line
        return None

    def table(self) -> str:
        mesh = " x ".join(f"{k} {v}" for k, v in self.mesh.items())
        where = " of its own" if self.engine_apart else ""
        out = [f"memory per device (GiB; learner mesh {mesh}, engine over {self.engine_devices} device(s){where}):"]
        sides = [("", self.lines)] if not self.engine_apart else [
            ("on each learner device:", self.side(False)), ("on each engine device:", self.side(True))]
        for title, lines in sides:
            if title:
                out.append(f" {title}")
            for line in lines:
                out.append(f"  {line.name:<16}{line.bytes / GiB:>9.2f}   {line.how}")
            total = sum(line.bytes for line in lines)
            out.append(f"  {'total':<16}{total / GiB:>9.2f}")
            if self.capacity is not None:
                out.append(f"  {'device':<16}{self.capacity / GiB:>9.2f}")
                out.append(f"  {'headroom':<16}{(self.capacity - total) / GiB:>9.2f}")
        if self.capacity is None:
            out.append("  device memory unknown (this platform reports none): not checked; "
                       "set mesh.device_kind (h100, h200, mi300x) or mesh.device_memory_gb to check")
        return "\n".join(out)

    def refusal(self) -> str | None:
        """Why the run cannot start (None: it fits, or the device's memory is unknown)."""
        line = self.overflow()
        if line is None:
            return None
        lines = self.side(bool(self.engine_apart) and line.name in self.engine_apart)
        running = sum(x.bytes for x in lines[:lines.index(line) + 1])
        return (f"memory plan: the run does not fit a {self.capacity / GiB:.1f} GiB device: at {line.name!r} "
                f"({line.bytes / GiB:.2f} GiB) the total reaches {running / GiB:.2f} GiB (all lines: "
                f"{self.total / GiB:.2f} GiB). Try {line.remedy or REMEDIES.get(line.name, 'a larger mesh')}; "
                "train --plan prints every line")


def mesh_sizes(cfg: RunConfig, devices: int) -> dict[str, int]:
    """The (data, fsdp, tensor) sizes of cfg.mesh over `devices` devices (one -1 takes the rest)."""
    axes = cfg.mesh.axes()
    if -1 in axes.values():
        known = int(np.prod([v for v in axes.values() if v != -1]))
        axes[next(k for k, v in axes.items() if v == -1)] = max(devices // known, 1)
    return axes


def activation_bytes(arch: ModelConfig, cfg: RunConfig, mesh: dict[str, int]) -> tuple[float, str]:
    """One micro-batch's activations on one device during the update, and how they were counted."""
    rl = cfg.rl
    if rl.token_budget > 0:  # packed: one row of rl.token_budget positions per device per micro-batch
        rows, seq = 1, rl.token_budget
    else:  # one optimizer step takes a mini-batch (rl.mini_batches per epoch), micro-batch by micro-batch
        rows = math.ceil(rl.batch_problems * rl.group_size / rl.mini_batches / rl.micro_batches /
                         (mesh["data"] * mesh["fsdp"]))
        seq = cfg.rollout.max_len
    tokens = rows * seq
    b = jnp.dtype(DTYPES[cfg.model.dtype]).itemsize
    h, hd = arch.hidden_size, arch.head_dim
    q = split_dim(arch.num_heads, "q_heads", mesh) * hd
    kv = split_dim(arch.num_kv_heads, "kv_heads", mesh) * hd
    mlp = split_dim(arch.intermediate_size, "mlp", mesh)
    vocab = split_dim(arch.vocab_size, "vocab", mesh)
    # per-token widths of what a layer keeps for its backward pass
    cudnn = cfg.model.attention == "cudnn"
    kept = {"none": 4 * h + q + 2 * kv + q + 4 * mlp,   # norms, residuals, q/k/v, attention out, gate/up/act/product
            "dots": 2 * h + q + 2 * kv + 2 * mlp,       # matmul outputs
            "dots_attention": 2 * h + q + 2 * kv + 2 * mlp + q * cudnn,  # and cuDNN attention's output
            "full": h}[cfg.model.remat]                  # the layer's input
    bound = segment_bound(rl.segments_per_row) if rl.token_budget > 0 else 1
    statistics = 0.0
    if cudnn and cfg.model.remat in ("none", "dots_attention"):
        # cuDNN's softmax statistics, kept for its backward kernel: float32 per head and token, per
        # segment slot of a packed row ([rows x bound, heads, positions])
        statistics = arch.num_layers * tokens * bound * split_dim(arch.num_heads, "q_heads", mesh) * 4
    working = 2 * (3 * h + q + 2 * kv + q + 3 * mlp)    # one layer recomputed: values and cotangents
    scores = 0.0
    if cfg.model.attention == "xla":                     # [heads, S, S] float32 per row
        per_layer_scores = rows * split_dim(arch.num_heads, "q_heads", mesh) * seq * seq * 4
        scores = per_layer_scores * (arch.num_layers if cfg.model.remat == "none" else 2)
    logits = rows * min(LOGPROB_CHUNK, seq) * vocab * 4
    segments = 0.0
    if rl.token_budget > 0 and cudnn:
        # cuDNN's packed backward: a float32 accumulator [rows x segment bound, heads, budget, head_dim]
        # for the layer under way, whatever the rows hold. Not in cuDNN's documentation: the fit that
        # put the plan within 4% of four H200 peaks (BENCHMARKS.md, "Packed rows on an H200: MFU...").
        segments = rows * bound * split_dim(arch.num_heads, "q_heads", mesh) * seq * hd * 4
    total = (arch.num_layers * tokens * kept * b + tokens * working * b + scores + logits + segments
             + statistics)
    packed = "packed " if rl.token_budget > 0 else ""
    extra = f" (score matrices {scores / GiB:.1f} GiB)" if scores else ""
    if segments:
        extra = f" (its packed backward {segments / GiB:.1f} GiB at rl.segments_per_row={rl.segments_per_row})"
    if statistics:
        extra += f" (its softmax statistics {statistics / GiB:.1f} GiB)"
    how = (f"{rows} {packed}row(s) x {seq} positions per micro-batch, remat {cfg.model.remat}, {cfg.model.attention} "
           f"attention{extra}")
    return float(total), how


def memory_plan(arch: ModelConfig, cfg: RunConfig, *, devices: int, devices_per_process: int,
                capacity: float | None) -> MemoryPlan:
    """The plan for `cfg` on `devices` devices in all, `devices_per_process` per trainer process,
    each of `capacity` bytes (None: unknown). rl.token_budget=-1 (auto) counts as padded rows, as
    the Learner reads it: resolve_token_budget makes it a number first."""
    kind = engine_kind(cfg.rollout)
    own = kind.devices_of_its_own(cfg.rollout)
    if own and own >= devices_per_process:
        raise MemoryPlanError(f"rollout.jax.devices={own} leaves the learner {devices_per_process - own} of each "
                              f"process's {devices_per_process} devices: set it to at most {devices_per_process - 1}")
    devices -= kind_devices(cfg, devices, devices_per_process)  # the learner's share
    mesh = mesh_sizes(cfg, devices)
    params = shard_bytes(arch, mesh, 4)
    n_params = f"{_param_count(arch) / 1e9:.2f}B parameters"
    if cfg.model.lora.enabled:
        lines = _lora_state_lines(arch, cfg, mesh)
    else:
        lines = [Line("parameters", params, f"float32 master weights, {n_params}, split by the logical-axis rules"),
                 Line("gradients", *_gradient_bytes(arch, cfg, mesh, params)),
                 Line("optimizer", 2 * params, "AdamW: two float32 moments")]
        if cfg.rl.kl.enabled:
            lines.append(Line("reference weights", params, "float32, frozen: the KL term's reference (rl.kl.coef > 0)"))
    lines.append(Line("activations", *activation_bytes(arch, cfg, mesh)))

    engine_lines, engine_devices = kind.plan(EnginePlanInputs(
        arch, cfg.rollout, cfg.model.dtype, cfg.model.decode_attention, devices=devices,
        devices_per_process=devices_per_process, learner_mesh=mesh, on_policy=cfg.rl.max_staleness == 0))
    lines += engine_lines
    if capacity is not None:
        lines.append(Line("allowance", ALLOWANCE_FRACTION * capacity,
                          f"{ALLOWANCE_FRACTION:.0%} of the device: XLA workspace, programs, fragmentation"))
    return MemoryPlan(tuple(lines), capacity, mesh, engine_devices,
                      tuple(line.name for line in engine_lines) if own else ())


def _lora_state_lines(arch: ModelConfig, cfg: RunConfig, mesh: dict[str, int]) -> list[Line]:
    """A LoRA run's state (models/lora.py): the base frozen in the compute dtype and split as full
    training splits it; the adapters, their gradients and moments float32 (counted whole: they are
    a few MB to a few hundred)."""
    from rstar2_jax.models.lora import adapter_parameters
    b = jnp.dtype(DTYPES[cfg.model.dtype]).itemsize
    n = adapter_parameters(cfg.model.lora, arch)
    accumulator = cfg.rl.micro_batches > 1 or cfg.rl.token_budget > 0
    lines = [Line("parameters", shard_bytes(arch, mesh, b) + 4 * n,
                  f"the base frozen in {cfg.model.dtype} ({_param_count(arch) / 1e9:.2f}B), split by the logical-axis "
                  f"rules, + {n / 1e6:.2f}M float32 adapter parameters (rank {cfg.model.lora.rank})"),
             Line("gradients", 4 * n * (2 if accumulator else 1), "float32, the adapters' only"
                  + (" (and their accumulator)" if accumulator else "")),
             Line("optimizer", 8 * n, "AdamW: two float32 moments of the adapters")]
    if cfg.rl.kl.enabled:
        lines.append(Line("reference weights", 4 * n, "the adapters as they started (the base is shared)"))
    return lines


def _gradient_bytes(arch: ModelConfig, cfg: RunConfig, mesh: dict[str, int], params: float) -> tuple[float, str]:
    """Gradients at the update's peak (module docstring): the LM head's, plus the accumulator
    with several micro-batches."""
    head = shard_shape(("embed", "vocab"), (arch.hidden_size, arch.vocab_size), mesh)
    first = float(np.prod(head) * 4)
    if cfg.rl.micro_batches > 1 or cfg.rl.token_budget > 0:  # packed: micro-batches follow from the tokens
        return params + first, "float32: the accumulator + the LM head's of the micro-batch under way"
    return first, "float32: the LM head's, formed first (the rest as the backward frees activations)"


def _param_count(arch: ModelConfig) -> int:
    from rstar2_jax.models.flops import param_count
    return param_count(arch)


# ----------------------------------------------------------------------------------------------
def architecture(cfg: RunConfig) -> ModelConfig:
    """The run's architecture from config.json alone (model.path), or the tiny model's settings."""
    if cfg.model.path:
        from rstar2_jax.models.hub import config_file  # a hub id: its config.json alone, through the cache
        return ModelConfig.from_json_file(config_file(cfg.model.path))
    from rstar2_jax.models.tiny import tiny_config
    return tiny_config(num_layers=cfg.model.tiny_layers, hidden_size=cfg.model.tiny_hidden,
                       intermediate_size=3 * cfg.model.tiny_hidden)


def device_capacity(cfg: RunConfig) -> float | None:
    """mesh.device_memory_gb, else mesh.device_kind's, else what the first device reports (None on
    CPU: no limit)."""
    if cfg.mesh.device_memory_gb:
        return cfg.mesh.device_memory_gb * GiB
    if cfg.mesh.device_kind:
        return DEVICE_MEMORY_GIB[cfg.mesh.device_kind] * GiB
    import jax
    try:  # this process's own device (another process's cannot be asked)
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a platform without memory statistics: unknown
        stats = {}
    return float(stats["bytes_limit"]) if "bytes_limit" in stats else None


def _topology(cfg: RunConfig, processes: int) -> tuple[int, int]:
    """(devices, devices per process) the config declares: the mesh's sizes, and
    mesh.devices_per_process, else the mesh's devices over `processes`."""
    import jax
    declared = list(cfg.mesh.axes().values())
    if -1 in declared:
        devices = (cfg.mesh.devices_per_process * processes if cfg.mesh.devices_per_process
                   else jax.device_count())
    else:
        devices = int(np.prod(declared))
    return devices, cfg.mesh.devices_per_process or max(devices // processes, 1)


def plan_for_launch(cfg: RunConfig, processes: int) -> MemoryPlan:
    """The plan for the topology the config declares (rl.token_budget resolved first when auto)."""
    devices, per_process = _topology(cfg, processes)
    return memory_plan(architecture(cfg), resolve_token_budget(cfg, processes), devices=devices,
                       devices_per_process=per_process, capacity=device_capacity(cfg))


def _with_budget(cfg: RunConfig, budget: int) -> RunConfig:
    return dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, token_budget=budget))


def auto_token_budget(arch: ModelConfig, cfg: RunConfig, *, devices: int, devices_per_process: int,
                      capacity: float) -> int:
    """The largest packed-row budget the plan fits: rollout.max_len (a row must hold the longest
    rollout) doubled while the plan still fits, up to a step's kept tokens on one device (a larger
    row would hold nothing more). When even rollout.max_len does not fit, that: the plan then
    refuses it, naming the line."""
    longest, rl = cfg.rollout.max_len, cfg.rl
    mesh = mesh_sizes(cfg, devices - kind_devices(cfg, devices, devices_per_process))
    per_device = math.ceil(rl.batch_problems * rl.group_size / (mesh["data"] * mesh["fsdp"])) * longest
    best, budget = longest, longest
    while budget <= max(per_device, longest):
        if memory_plan(arch, _with_budget(cfg, budget), devices=devices, devices_per_process=devices_per_process,
                       capacity=capacity).refusal():
            break
        best, budget = budget, 2 * budget
    return best


def kind_devices(cfg: RunConfig, devices: int, devices_per_process: int) -> int:
    """The devices the engine keeps for itself over the whole job (rollout.jax.devices per process)."""
    return engine_kind(cfg.rollout).devices_of_its_own(cfg.rollout) * max(devices // devices_per_process, 1)


def resolve_token_budget(cfg: RunConfig, processes: int, accelerator: bool | None = None) -> RunConfig:
    """cfg with rl.token_budget=-1 (auto) made a number: for an accelerator (the default backend
    is one, or mesh.device_memory_gb declares the device a plan is made for; `accelerator`
    overrides both), packed rows at auto_token_budget, unless rl.micro_batches > 1 asks for padded
    micro-batches; on the CPU, padded rows (0). Other values are kept."""
    if cfg.rl.token_budget != AUTO_TOKEN_BUDGET:
        return cfg
    if accelerator is None:
        import jax
        accelerator = jax.default_backend() != "cpu" or bool(cfg.mesh.device_memory_gb or cfg.mesh.device_kind)
    capacity = device_capacity(cfg)
    if not accelerator or cfg.rl.micro_batches > 1 or capacity is None:
        return _with_budget(cfg, 0)
    devices, per_process = _topology(cfg, processes)
    return _with_budget(cfg, auto_token_budget(architecture(cfg), cfg, devices=devices,
                                               devices_per_process=per_process, capacity=capacity))
