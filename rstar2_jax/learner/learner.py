"""Learner: owns the train state, computes old log-probs, updates, and hands weights out.

    learner = Learner(model, cfg.rl, temperature=..., constant_tokens=..., mesh=mesh)
    batch.old_logprobs = learner.logprobs(batch.tokens)
    metrics = learner.update(batch)          # mini_batches x epochs optimizer steps (micro-batches
                                             # inside each); fills batch.old_logprobs and
                                             # batch.entropy when missing
    engine.update_weights(learner.model_state(), learner.version)

One update is one new weights version, whatever number of optimizer steps it takes: the batch
is split into `mini_batches` row slices, and every epoch takes one step on each (verl's
ppo_mini_batch_size / ppo_epochs); the old (proximal) log-probs are those of the weights before
the update, so the ratio departs from 1 from the second step on and the clip can bind. 1 x 1 is
the paper's setting. With a KL term, the learner keeps the frozen reference weights (the ones it
was built with) and computes their log-probs once per update.

Where one optimizer step is the whole update (1 x 1, no KL term, no LoRA dropout), the old
log-probs are the current weights' exactly, so by default (rl.old_logprobs=auto) the update takes
them from its own forward pass, stop-gradient, with the entropies and the corrections' inputs: no
separate pass runs, and every ratio is exactly 1 (a separate pass gives 1 +- rounding).

Parameters stay float32 (master weights); the model's compute dtype (e.g. bf16) is the one it
was built with. With a mesh, parameters live on their NamedShardings and batches are sharded
over (data, fsdp): `update` pads a batch with masked rows to a multiple of micro-batches x that
width, so every micro-batch splits evenly over the devices (never silently replicated).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstar2_jax.core import sharding as sharding_lib
from rstar2_jax.algo.corrections import CorrectionInputs, correction_metrics
from rstar2_jax.algo.kl import sequence_kl
from rstar2_jax.learner.batching import TrainBatch, pad_rows
from rstar2_jax.learner.optimizer import make_optimizer
from rstar2_jax.learner.packing import PackingPlan, plan_packing, row_lengths
from rstar2_jax.learner.settings import LearnerSettings
from rstar2_jax.learner.train_step import (TrainState, UpdateConfig, batch_logprobs, packed_apply, packed_gradients,
                                           packed_logprobs, packing_inputs, step_key, train_step)
from rstar2_jax.models import lora
from rstar2_jax.core.shared_jit import shared_jit


class Learner:
    def __init__(self, model: nnx.Module, cfg: LearnerSettings | None = None, *, temperature: float = 1.0,
                 constant_tokens: float | None = None, mesh: Mesh | None = None, own_params: bool = False,
                 optimizer: optax.GradientTransformation | None = None):
        """cfg: the run's `rl` section (or a LearnerSettings). temperature: the sampler's (the
        log-probs are those of the tempered distribution it drew from); constant_tokens: C of
        aggregation=constant (RunConfig.constant_tokens; None: rl.loss.constant_tokens, refused
        at 0 under that aggregation: UpdateConfig.of). optimizer: in place of the settings' AdamW
        (a research variant; tests use plain SGD, whose step is the accumulated gradient itself).
        own_params: the learner takes `model`'s parameter arrays as they are (the caller never
        uses them again: the first update donates them). Otherwise it trains on a copy. Either
        way, parameters already on their mesh shardings (`load_pretrained(mesh=)`) are not moved."""
        self.cfg = cfg = LearnerSettings() if cfg is None else cfg
        self.update_cfg = update = UpdateConfig.of(cfg, temperature=temperature, constant_tokens=constant_tokens)
        # rl.old_logprobs: updates take the old log-probs from their own forward pass where that is
        # exact (refused, not quietly given, where asked for and not exact)
        self.one_pass = cfg.old_logprobs_in_update(lora.config_of(model).dropout if lora.has_adapters(model) else 0.0)
        self.mesh = mesh
        # A model with LoRA adapters (models/lora.py) trains only them: the base is `frozen`, never
        # donated, never differentiated, held in the dtype it was loaded in.
        self.graphdef, params, self.frozen = lora.split_trained(model)
        if not own_params:
            params = jax.tree.map(jnp.copy, params)  # the step donates its state: never the caller's arrays
        self.tx = optimizer or make_optimizer(lr=cfg.lr, warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay,
                                              grad_clip=cfg.grad_clip)
        if mesh is not None:
            params = _placed_on(params, sharding_lib.param_shardings(params, mesh))
            if self.frozen is not None:
                self.frozen = _placed_on(self.frozen, sharding_lib.param_shardings(self.frozen, mesh))
        self.state = self._placed(TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params)))
        self.version = 0
        # The frozen reference of a KL term: the weights the learner starts from (after SFT); with
        # LoRA, the base with the adapters as they start (zero, or their SFT values).
        self.ref_params = jax.tree.map(jnp.copy, params) if update.kl.enabled else None
        # the process's one jitted program per (graph, settings): a second learner like this one
        # (the next cell of an ablation grid) compiles nothing again
        self._train = shared_jit(train_step, self.graphdef, self.tx, update, donate_argnums=(0,))
        self._logprobs = shared_jit(batch_logprobs, self.graphdef, cfg=update, static_argnames=("with_entropy",))
        # packed rows (cfg.token_budget > 0): one compiled shape [width, budget] per pass
        self._packed_logprobs = shared_jit(packed_logprobs, self.graphdef, cfg=update,
                                           static_argnames=("with_entropy",))
        self._packing_inputs = shared_jit(packing_inputs, update)
        self._packed_gradients = shared_jit(packed_gradients, self.graphdef, update, donate_argnums=(1,))
        self._packed_apply = shared_jit(packed_apply, self.tx, donate_argnums=(0,))

    # ------------------------------------------------------------------------------------------
    @property
    def packs(self) -> bool:
        """Whether the learner's passes run on packed rows (cfg.token_budget > 0)."""
        return self.cfg.token_budget > 0

    @property
    def width(self) -> int:
        """The devices a micro-batch's rows are split over."""
        return 1 if self.mesh is None else self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    @property
    def rows_multiple(self) -> int:
        """Batch rows must be a multiple of this: mini-batches x micro-batches x the devices the
        batch is split over (packed: mini-batches; the packed rows are the devices')."""
        if self.packs:
            return self.cfg.mini_batches
        return self.cfg.mini_batches * self.cfg.micro_batches * self.width

    def _placed(self, state: TrainState) -> TrainState:
        """Leaves made on one device (the step, optimizer counters) replicated over the mesh: a
        checkpoint of a state spread over processes holds only global arrays."""
        if self.mesh is None:
            return state
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda x: x if getattr(x.sharding, "mesh", None) == self.mesh
                            else jax.device_put(_host_if_multiprocess(x), replicated), state)

    def _put(self, x: np.ndarray):
        if self.mesh is None:
            return jax.device_put(x)  # a transfer: jnp.asarray would compile a program per new shape
        axes = ("batch",) + (None,) * (x.ndim - 1)
        return jax.device_put(x, sharding_lib.named_sharding(self.mesh, axes, x.shape))

    def _ctx(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def logprobs(self, tokens: np.ndarray, with_entropy: bool = False, params=None):
        """Log-probs [N, T] of `tokens` under the current weights (or `params`); with
        `with_entropy`, the pair (log-probs, entropy), both computed in the same vocabulary chunks."""
        with self._ctx():
            out = self._logprobs(self.state.params if params is None else params, self._put(tokens),
                                 with_entropy=with_entropy, frozen=self.frozen)
            return tuple(map(_host, out)) if with_entropy else _host(out)

    def _plan(self, lengths: np.ndarray) -> PackingPlan:
        return plan_packing(lengths, self.cfg.token_budget, self.width, self.cfg.segments_per_row)

    def _put_all(self, arrays: dict[str, np.ndarray]) -> dict:
        return {k: self._put(v) for k, v in arrays.items()}

    def batch_logprobs(self, batch: TrainBatch, with_entropy: bool = False, params=None):
        """`logprobs` of a batch's tokens, on packed rows when cfg.token_budget is set (then 0
        beyond each row's length): the passes the update runs (old, reference, entropy)."""
        if not self.packs:
            return self.logprobs(batch.tokens, with_entropy, params)
        plan = self._plan(_lengths(batch))
        packed = {"tokens": plan.pack(batch.tokens), **plan.layout()}
        params = self.state.params if params is None else params
        outs = []
        for k in range(plan.micro_batches):
            with self._ctx():
                out = self._packed_logprobs(params, self._put_all({n: plan.micro_batch(v, k) for n, v in packed.items()}),
                                            with_entropy=with_entropy, frozen=self.frozen)
            outs.append(tuple(map(_host, out if with_entropy else (out,))))
        width = batch.tokens.shape[1]
        unpacked = tuple(plan.unpack(plan.joined(list(parts)), width) for parts in zip(*outs))
        return unpacked if with_entropy else unpacked[0]

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One update on `batch`: mini_batches x epochs optimizer steps, one new version (old
        log-probs, and with cfg.token_entropy the token entropies, filled in `batch` when missing:
        from the update's own forward pass where `one_pass`, else from a pass before it).
        Metrics are means over the optimizer steps taken; `old_logprob_pass` says which path ran
        (1: a separate pass computed the old log-probs, or the batch brought them; 0: one pass)."""
        padded = pad_rows(batch, self.rows_multiple)
        one_pass = self.one_pass and padded.old_logprobs is None
        if not one_pass:
            self._fill_old_logprobs(batch, padded)
        arrays = {"tokens": padded.tokens, "loss_mask": padded.loss_mask, "advantages": padded.advantages}
        if not one_pass:
            arrays["old_logprobs"] = padded.old_logprobs
        if self.update_cfg.needs_sampler_logprobs:
            arrays["sampler_logprobs"] = padded.sampler_logprobs
        if self.update_cfg.kl.in_loss:
            arrays["ref_logprobs"] = self.batch_logprobs(padded, params=self.ref_params)
        lengths = _lengths(padded)
        # only padding rows: no step (an optimizer step would still move Adam)
        parts = [(part, part_lengths) for part, part_lengths in zip(mini_batches(arrays, self.cfg.mini_batches),
                                                                    np.split(lengths, self.cfg.mini_batches))
                 if part["loss_mask"].any()]
        # packed once, stepped on every epoch
        parts = [self._packed_part(*p) for p in parts] if self.packs else [part for part, _ in parts]
        steps, computed = [], 0
        for _ in range(self.cfg.epochs):
            for part in parts:
                if self.packs:
                    metrics, tokens, outputs = self._packed_step(part, batch.tokens.shape[1])
                else:
                    with self._ctx():
                        self.state, metrics, outputs = self._train(self.state, self._put_all(part), self.frozen)
                    outputs, tokens = {k: _host(v) for k, v in outputs.items()}, part["tokens"].size
                computed += tokens
                steps.append({k: float(v) for k, v in metrics.items()})
                if one_pass:  # one step (one_pass_problem): its outputs are the whole batch's
                    rows = batch.tokens.shape[0]
                    batch.old_logprobs = outputs["logprobs"][:rows]
                    batch.entropy = outputs["entropy"][:rows] if "entropy" in outputs else None
        self.version += 1
        out = {k: float(np.mean([m[k] for m in steps])) for k in steps[0]} if steps else {}
        out["optimizer_steps"] = float(len(steps))
        out["packed_rows"] = float(self.packs)  # which path ran: a packed update never falls back silently
        out["old_logprob_pass"] = float(not one_pass)  # likewise: a separate old-log-prob pass ran (or was given)
        if steps and lengths.sum():  # positions the optimizer steps computed per real token
            out["computed_per_real_token"] = computed / (float(lengths.sum()) * self.cfg.epochs)
        out.update(sampler_mismatch(batch))
        if batch.old_logprobs is not None and batch.sampler_logprobs is not None:
            c = self.cfg.correction
            out.update(correction_metrics(c.names, c.settings_of, CorrectionInputs(
                batch.old_logprobs, batch.sampler_logprobs, batch.loss_mask > 0)))
        if batch.entropy is not None and batch.num_tokens:
            out["entropy_mean"] = float((batch.entropy * batch.loss_mask).sum() / batch.num_tokens)
        return out

    def _packed_part(self, part: dict[str, np.ndarray], lengths: np.ndarray) -> PackedPart:
        """A padded mini-batch `part` on packed rows: the corrections, the aggregation's row scales
        and normaliser are computed on the padded rows first (they read whole sequences), then
        every per-token input is packed. None of it depends on the weights: packed once per update.
        Without old log-probs (one pass) nothing is computed first: the packed step finds the
        corrections and the count from its own forward pass, by segment."""
        plan = self._plan(lengths)
        per_token = {k: part[k] for k in ("tokens", "loss_mask", "advantages", "old_logprobs", "sampler_logprobs",
                                          "ref_logprobs") if k in part}
        count = total_tokens = None
        if "old_logprobs" in part:
            prep = {k: np.asarray(v) for k, v in self._packing_inputs(part).items()}
            per_token.update(loss_mask=prep["loss_mask"], token_scale=prep["row_scale"])
            if "is_weight" in prep:
                per_token["is_weight"] = prep["is_weight"]
            count, total_tokens = prep["count"], prep["total_tokens"]
        return PackedPart(plan, {**{k: plan.pack(v) for k, v in per_token.items()}, **plan.layout()}, count,
                          total_tokens)

    def _packed_step(self, part: PackedPart, width: int) -> tuple[dict, int, dict]:
        """One optimizer step on a packed mini-batch, micro-batch by micro-batch: (metrics,
        positions computed, per-token outputs [rows, width] on padded rows: a one-pass step's
        log-probs and entropies, else none)."""
        plan, accumulated, outputs = part.plan, None, []
        one_pass = part.count is None
        with self._ctx():
            for k in range(plan.micro_batches):
                mb = self._put_all({n: plan.micro_batch(v, k) for n, v in part.arrays.items()})
                accumulated, out = self._packed_gradients(self.state.params, accumulated, mb,
                                                          1.0 if one_pass else part.count, self.frozen,
                                                          step_key(self.state.step, k))
                outputs.append(out)  # on the device: the host reads them after the step, not between micro-batches
            self.state, metrics = self._packed_apply(self.state, accumulated, part.count, part.total_tokens)
        unpacked = {n: plan.unpack(plan.joined([_host(o[n]) for o in outputs]), width)
                    for n in (outputs[0] if outputs else {})}
        return metrics, plan.computed_tokens, unpacked

    def _fill_old_logprobs(self, batch: TrainBatch, padded: TrainBatch):
        """The old log-probs (and with cfg.token_entropy the entropies) of `padded` and of
        `batch` (its first rows), computed when missing."""
        rows = batch.tokens.shape[0]
        if padded.old_logprobs is None and self.cfg.token_entropy:
            padded.old_logprobs, padded.entropy = self.batch_logprobs(padded, with_entropy=True)
            batch.old_logprobs, batch.entropy = padded.old_logprobs[:rows], padded.entropy[:rows]
        elif padded.old_logprobs is None:
            padded.old_logprobs = self.batch_logprobs(padded)
            batch.old_logprobs = padded.old_logprobs[:rows]

    def sequence_kl(self, batch: TrainBatch) -> np.ndarray:
        """Each row's KL to the frozen reference [N] (cfg.kl's estimator summed over its
        model tokens), from the current weights' log-probs, which it stores in `batch` (the
        update then reuses them): the KL-in-reward term, known before the advantages."""
        if self.ref_params is None:
            raise ValueError("sequence_kl needs a reference: cfg.kl.coef > 0")
        padded = pad_rows(batch, self.rows_multiple)
        self._fill_old_logprobs(batch, padded)
        ref = self.batch_logprobs(padded, params=self.ref_params)[:batch.tokens.shape[0]]
        return sequence_kl(self.cfg.kl.estimator, batch.old_logprobs, ref, batch.loss_mask)

    def reset_optimizer(self):
        """Fresh optimizer moments (the paper resets at the start of stage 3)."""
        self.state = self._placed(self.state.replace(opt_state=self.tx.init(self.state.params)))

    def model_state(self):
        """Every parameter of the model as an nnx.State (with LoRA: the base and the adapters), for
        engines."""
        return lora.whole(self.state.params, self.frozen)

    def model(self) -> nnx.Module:
        return lora.merged(self.graphdef, self.state.params, self.frozen)


class PackedPart(NamedTuple):
    """A mini-batch ready for packed optimizer steps: its plan, its packed arrays [rows, budget]
    (and the cuDNN segment tables), the aggregation's normaliser and its token count (None: a
    one-pass step, which counts them in its forward pass)."""
    plan: PackingPlan
    arrays: dict[str, np.ndarray]
    count: np.ndarray | None
    total_tokens: np.ndarray | None


def _host(x) -> np.ndarray:
    """A device array on the host, also when it is sharded over processes."""
    return np.asarray(sharding_lib.gathered(x))


def _lengths(batch: TrainBatch) -> np.ndarray:
    """Each row's tokens: as recorded by make_batch, else up to its last model token."""
    return batch.lengths if batch.lengths is not None else row_lengths(batch.loss_mask)


def mini_batches(arrays: dict[str, np.ndarray], count: int):
    """`count` consecutive row slices of every array (rows divide evenly: the learner pads)."""
    rows = next(iter(arrays.values())).shape[0]
    size = rows // count
    for k in range(count):
        yield {name: x[k * size:(k + 1) * size] for name, x in arrays.items()}


def _placed_on(params, shardings):
    """`params` on `shardings`; a leaf already there is kept as it is (no copy, no host trip)."""
    def place(x, target):
        if getattr(x, "sharding", None) == target:
            return x
        if isinstance(x, jax.Array) and not x.is_fully_addressable:  # global already: reshard on the devices
            return sharding_lib.resharder(target)(x)
        return jax.device_put(_host_if_multiprocess(x), target)
    return jax.tree.map(place, params, shardings)


def _host_if_multiprocess(tree):
    """With several processes, device arrays go through the host before a global device_put:
    jax 0.10 builds a broken array when a process-local device array is put on a sharding that
    replicates over processes (its shards then fail in orbax). One process: unchanged."""
    return jax.tree.map(np.asarray, tree) if jax.process_count() > 1 else tree


def sampler_mismatch(batch: TrainBatch) -> dict[str, float]:
    """How far the sampler's log-probs are from the learner's, on model tokens.

    A broken weight sync or re-tokenization drift shows up here at once (it should be ~1e-5 on
    one device in float32, and stay small in bf16)."""
    m = batch.loss_mask > 0
    if not m.any() or batch.old_logprobs is None:
        return {}
    diff = (batch.old_logprobs - batch.sampler_logprobs)[m]
    ratio = np.exp(-diff)  # sampler -> learner importance ratio
    return {"logprob_mismatch_mean": float(np.abs(diff).mean()), "logprob_mismatch_max": float(np.abs(diff).max()),
            "importance_ratio_std": float(ratio.std()), "importance_ratio_max": float(ratio.max())}
