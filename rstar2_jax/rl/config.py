"""The run's config: the sections each module owns, put together, and the rules across them.

    cfg = base_config()                  # a ConfigDict of every field at its default
    cfg.rl.steps = 40                    # experiment files set values (experiments/*.py)
    run_cfg = RunConfig.from_config(cfg) # typed and checked: ConfigValueError lists every problem

Sections and where they live: model (models/resolve.py), data (data/tasks/), sft
(learner/sft.py), rollout (rollout/engines/factory.py), sandbox (rollout/sandboxes.py), rl.roc
(rl/roc_modes/), rl.loss (algo/losses/), mesh (core/sharding.py), checkpoint (core/checkpoints.py),
logging (trackers/__init__.py);
rl, stages and eval are the trainer's own (here). `python -m rstar2_jax.train --helpconfig`
prints every field with its documentation.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping, Sequence

import ml_collections
import numpy as np

from rstar2_jax.algo import KLConfig
from rstar2_jax.algo.advantages import AdvantageConfig
from rstar2_jax.algo.reward_shaping import OverlongConfig
from rstar2_jax.core.checkpoints import CheckpointConfig
from rstar2_jax.core.config_types import ConfigProblem, ConfigValueError, Section, setting
from rstar2_jax.data.tasks import TASKS, DataConfig, kept_template_conflicts
from rstar2_jax.learner.settings import LearnerSettings
from rstar2_jax.core.part_sections import unread_settings
from rstar2_jax.learner.sft import SFTConfig
from rstar2_jax.models.resolve import PolicyModelConfig
from rstar2_jax.rl.carry import StalenessConfig
from rstar2_jax.rl.dynamic_sampling import DynamicSamplingConfig
from rstar2_jax.rl.idle_watch import IdleConfig
from rstar2_jax.trackers import LoggingConfig
from rstar2_jax.rl.roc_modes import RoCConfig
from rstar2_jax.rollout.engines.factory import ENGINES, RolloutConfig, engine_kind
from rstar2_jax.rollout.prompt import FORMATS, make_format
from rstar2_jax.rollout.sandboxes import SandboxConfig
from rstar2_jax.core.sharding import MeshConfig

FILTER_MODES = ("offline", "online")


@dataclasses.dataclass(frozen=True)
class StageConfig(Section):
    """From `start_step` on, these rollout limits apply (the token budget covers all turns)."""
    all_fields_required: typing.ClassVar[bool] = True
    start_step: int = setting(0, "the RL step the stage begins at (the first stage: 0)", min=0)
    max_response_tokens: int = setting(400, "tokens after the prompt, all turns together", min=1)
    max_turns: int = setting(4, "assistant turns", min=1)
    filter_solved_k: int = setting(0, "drop problems the policy solves k/k (0: off)", min=0)
    filter_mode: str = setting("offline", "offline: the paper's pre-pass of k rollouts per problem when the stage "
                               "begins (resumable); online: drop a problem when the first k of its rollouts in a "
                               "step all score", choices=FILTER_MODES)
    reset_optimizer: bool = setting(False, "reset the optimizer state at the stage's first step")


@dataclasses.dataclass(frozen=True)
class EvalConfig(Section):
    before_and_after: bool = setting(True, "evaluate greedy and sampled on the eval problems before and after RL")
    every: int = setting(0, "RL steps between held-out evaluations during RL, greedy and sampled on the eval "
                         "problems (0: none); logged as eval/step_<N>/ at step N, kept in the checkpoint's run "
                         "state so a resumed run neither repeats nor loses one", min=0)


@dataclasses.dataclass(frozen=True)
class RLConfig(LearnerSettings):
    """`rl.*`: GRPO-RoC; the learner's own settings (lr, loss, ...) come from LearnerSettings."""
    steps: int = setting(12, "RL steps (raise it to extend a finished run)", min=0)
    batch_problems: int = setting(16, "problems per step", min=1)
    group_size: int = setting(4, "G: rollouts kept per problem (advantages need a group of 2+)", min=2)
    oversample: int = setting(2, "rollouts per problem = group_size x oversample (RoC keeps G of them)", min=1)
    advantage: AdvantageConfig = setting(AdvantageConfig, "the group-relative advantage (rl.advantage.name; each "
                                         "estimator's own rl.advantage.<name>.*)")
    max_staleness: int = setting(0, "async rollouts: versions a sampled token may lag the learner (0: on-policy, "
                                 "the paper)", min=0)
    tis_cap: float = setting(0.0, "replaced by rl.correction (kept so older runs' config.json reads): must be 0; "
                             "set rl.correction.names=(token_tis,) and rl.correction.token_tis.cap instead", min=0.0)
    staleness: StalenessConfig = setting(StalenessConfig, "what a step does about its slowest groups (rl/carry.py)")
    roc: RoCConfig = setting(RoCConfig, "Resample-on-Correct")
    dynamic_sampling: DynamicSamplingConfig = setting(DynamicSamplingConfig, "DAPO's draw-until-informative")
    overlong: OverlongConfig = setting(OverlongConfig, "DAPO's soft overlong punishment")
    idle: IdleConfig = setting(IdleConfig, "steps that train nothing (no kept rollout): warn, or stop the run "
                               "(rl/idle_watch.py)")

    @classmethod
    def upgrade_values(cls, mapping):
        if isinstance(mapping.get("advantage"), str):  # a name before estimators had settings
            mapping["advantage"] = {"name": mapping["advantage"]}
        return mapping

    def rules(self):
        yield from super().rules()
        if self.tis_cap:
            yield "tis_cap", (f"is replaced by rl.correction: set rl.correction.names=(token_tis,) and "
                              f"rl.correction.token_tis.cap={self.tis_cap} (and rl.tis_cap=0)")
        if self.token_budget > 0 and self.micro_batches > 1:
            yield "micro_batches", (f"is {self.micro_batches}, but with rl.token_budget ({self.token_budget}) the "
                                    "micro-batches follow from the tokens: set rl.micro_batches=1 (or "
                                    "rl.token_budget=0 for padded rows)")
        if self.segments_per_row & (self.segments_per_row - 1):
            yield "segments_per_row", (f"is {self.segments_per_row}; it must be a power of two (the packed rows' "
                                       f"segment tables are sized in powers of two): "
                                       f"{1 << (self.segments_per_row - 1).bit_length()} or "
                                       f"{1 << (self.segments_per_row.bit_length() - 1)}")
        if self.mini_batches > self.batch_problems * self.group_size:
            yield "mini_batches", (f"{self.mini_batches} mini-batches cannot split a step's at most "
                                   f"{self.batch_problems * self.group_size} kept rollouts (rl.batch_problems x "
                                   "rl.group_size); lower it")
        ds = self.dynamic_sampling
        if self.staleness.carries and ds.enabled:
            yield "staleness.policy", ("carry does not combine with rl.dynamic_sampling (a step's top-ups would wait "
                                       "on groups carried into it); use policy=wait, or turn dynamic sampling off")
        if ds.enabled and ds.bound(self.batch_problems) < self.batch_problems:
            yield "dynamic_sampling.max_problems", (f"{ds.max_problems} is below rl.batch_problems "
                                                    f"({self.batch_problems}): the step's own draw already passes "
                                                    "it (raise it, or 0 for 4 x rl.batch_problems)")

    @property
    def rollouts_per_problem(self) -> int:
        return self.group_size * self.oversample


@dataclasses.dataclass(frozen=True)
class RunConfig(Section):
    seed: int = setting(0, "every seed of the run derives from it (data order, rollouts, RoC draws)", min=0)
    run_name: str = setting("tiny_arith", "the name in traces and metrics", nonempty=True)
    model: PolicyModelConfig = setting(PolicyModelConfig, "the policy model")
    data: DataConfig = setting(DataConfig, "the task")
    format: str = setting("tiny", "prompt format: tiny (the demo's) | compact | rstar2 (the paper's)", choices=FORMATS)
    sft: SFTConfig = setting(SFTConfig, "the SFT warm start")
    rollout: RolloutConfig = setting(RolloutConfig, "rollout engine and sampling")
    sandbox: SandboxConfig = setting(SandboxConfig, "the code sandbox")
    rl: RLConfig = setting(RLConfig, "GRPO-RoC")
    stages: tuple[StageConfig, ...] = setting((StageConfig(),), "rollout limits from a step on (the first at 0)")
    eval: EvalConfig = setting(EvalConfig, "evaluation")
    mesh: MeshConfig = setting(MeshConfig, "device mesh")
    distributed: bool = setting(False, "jax.distributed.initialize() before anything (several processes)")
    checkpoint: CheckpointConfig = setting(CheckpointConfig, "checkpoints")
    logging: LoggingConfig = setting(LoggingConfig, "trackers besides metrics.jsonl (TensorBoard, W&B, MLflow)")

    def _checked_engine_kind(self):
        """The rollout engine's kind, for the checks that ask it; None for a name the registry does
        not have (that name is refused on its own, and the other checks still run)."""
        return engine_kind(self.rollout) if self.rollout.engine in ENGINES else None

    def rules(self):
        r, rl = self.rollout, self.rl
        kind = self._checked_engine_kind()
        if kind and (why := kind.attention_refusal(r, self.model.decode_attention)):
            yield "model.decode_attention", why
        if self.sft.steps and self.data.task in TASKS and not TASKS[self.data.task].has_sft_data:
            yield "sft.steps", (f"must be 0 for data.task={self.data.task!r}: it has no SFT data (fine-tune first "
                                "with python -m rstar2_jax.sft and set model.path)")
        if self.model.lora.enabled and kind and (why := kind.adapter_refusal(r, self.model.lora.rank)):
            yield "model.lora.rank", why
        lora_dropout = self.model.lora.dropout if self.model.lora.enabled else 0.0
        if lora_dropout and (why := rl.one_pass_refusal(lora_dropout)) and not rl.one_pass_refusal():
            yield "rl.old_logprobs", why  # (without LoRA dropout the rl section's own rule says it)
        if 0 < rl.token_budget < r.max_len:
            yield "rl.token_budget", (f"{rl.token_budget} tokens is below rollout.max_len ({r.max_len}), the longest "
                                      "rollout a stage allows: a packed row must hold it (raise rl.token_budget to "
                                      f">= {r.max_len})")
        if not self.stages:
            yield "stages", "needs at least one stage (start_step=0)"
            return
        if self.stages[0].start_step != 0:
            yield "stages[0].start_step", f"the first stage must start at step 0, got {self.stages[0].start_step}"
        starts = [s.start_step for s in self.stages]
        if starts != sorted(starts) or len(set(starts)) != len(starts):
            yield "stages", f"must be ordered by start_step, each its own step; got {starts}"
        for i, stage in enumerate(self.stages):
            if stage.max_response_tokens >= r.max_len:
                yield (f"stages[{i}].max_response_tokens", f"must be in (0, rollout.max_len={r.max_len}), "
                       f"got {stage.max_response_tokens}")
            if rl.overlong.cache_tokens >= stage.max_response_tokens:
                yield "rl.overlong.cache_tokens", (f"{rl.overlong.cache_tokens} must be below stages[{i}]."
                                                   f"max_response_tokens ({stage.max_response_tokens})")
            if stage.filter_mode == "online" and stage.filter_solved_k > rl.rollouts_per_problem:
                yield (f"stages[{i}].filter_solved_k", f"{stage.filter_solved_k} exceeds the rollouts per problem "
                       f"(rl.group_size x rl.oversample = {rl.rollouts_per_problem})")

    def topology_problems(self, processes: int) -> list[ConfigProblem]:
        """What this config cannot do with `processes` trainer processes."""
        sizes = self.mesh.axes()
        devices = int(np.prod(list(sizes.values())))
        per_process = self.mesh.devices_per_process
        if -1 not in sizes.values() and devices % processes:
            return [ConfigProblem("mesh", f"data x fsdp x tensor = {devices} devices cannot be split evenly over "
                                  f"{processes} processes (each process brings the same number of devices)")]
        if -1 not in sizes.values() and per_process and devices % per_process:
            return [ConfigProblem("mesh.devices_per_process", f"{per_process} does not divide the mesh's {devices} "
                                  "devices")]
        if -1 not in sizes.values() and per_process and processes > 1 and per_process * processes != devices:
            return [ConfigProblem("mesh.devices_per_process", f"{processes} processes x {per_process} devices is not "
                                  f"the mesh's {devices} devices")]
        kind = self._checked_engine_kind()
        own = kind.devices_of_its_own(self.rollout) if kind is not None else 0  # the engine's own, per process
        if own and per_process and own >= per_process:  # known before launch (issue 80: refused only at start)
            return [ConfigProblem(f"rollout.{self.rollout.engine}.devices", f"{own} of each process's {per_process} devices "
                                  f"(mesh.devices_per_process) leaves the learner {per_process - own}: set it to at "
                                  f"most {per_process - 1} (0: the engine shares the learner's devices)")]
        return []

    def warnings(self) -> list[str]:
        """Settings that run but are probably not meant (printed by train, never an error)."""
        out = unread_settings(self)
        out += kept_template_conflicts(self.data, self.format, make_format(self.format).answer_format)
        corrections = self.rl.correction.names
        if self.rl.max_staleness > 0 and not corrections:
            out.append(f"rl.max_staleness={self.rl.max_staleness} without rl.correction.names: nothing corrects for "
                       "tokens sampled by older weights (asynchronous RL usually sets one, e.g. "
                       "--config.rl.correction.names='(\"token_tis\",)')")
        if engine_kind(self.rollout).lands_in_background(self.rollout) and self.rl.max_staleness == 0:
            out.append("rollout.vllm.sync_wait=export with rl.max_staleness=0: each step's rollouts need the weights "
                       "of the update just before it, so they wait for the reload the trainer no longer waits for "
                       "(nothing overlaps; asynchronous steps, rl.max_staleness >= 1, do)")
        if self.rl.staleness.carries and not corrections:
            out.append("rl.staleness.policy=carry without rl.correction.names: carried groups are trained one version "
                       "staler than rl.max_staleness and nothing corrects them")
        if corrections and self.rl.max_staleness == 0 and not self.sampler_differs_from_learner \
                and not self.rl.staleness.carries:
            out.append(f"rl.correction.names={', '.join(corrections)} with rl.max_staleness=0, the embedded float32 "
                       "engine and the learner's own weights: sampler and learner are the same policy, so every "
                       "weight is ~1 and nothing is corrected (the corrections matter for k > 0, a bf16 engine, "
                       "or vLLM)")
        kl = self.rl.kl
        if not kl.enabled and (kl.estimator, kl.place) != (KLConfig().estimator, KLConfig().place):
            out.append(f"rl.kl.estimator={kl.estimator!r} / rl.kl.place={kl.place!r} set but rl.kl.coef is 0: "
                       "there is no KL term (set rl.kl.coef > 0)")
        return out

    @property
    def sampler_differs_from_learner(self) -> bool:
        """The engine samples with other numerics than the float32 learner: bf16 weights, or vLLM."""
        return not engine_kind(self.rollout).samples_like_learner(self.rollout, self.model.dtype)

    @property
    def constant_tokens(self) -> int:
        """C of aggregation=constant: rl.loss.constant_tokens, else the largest stage's budget."""
        return self.rl.loss.constant_tokens or max(s.max_response_tokens for s in self.stages)

    def stage_index(self, step: int) -> int:
        return max(i for i, s in enumerate(self.stages) if s.start_step <= step)

    def stage(self, step: int) -> StageConfig:
        return self.stages[self.stage_index(step)]

    @classmethod
    def from_config(cls, cfg: ml_collections.ConfigDict | Mapping[str, Any], processes: int = 1) -> RunConfig:
        """The typed, checked config of a ConfigDict (or plain mapping); ConfigValueError lists
        every problem, those of running on `processes` processes included."""
        mapping = cfg.to_dict() if isinstance(cfg, ml_collections.ConfigDict) else cfg
        run_cfg, problems = cls.parse(mapping)
        if run_cfg is not None:
            problems += run_cfg.topology_problems(processes)
        if problems:
            raise ConfigValueError(problems)
        return run_cfg


def base_config() -> ml_collections.ConfigDict:
    """Every field of a run at its default: what experiment files start from and overlay."""
    return RunConfig.defaults()


def validate(cfg: ml_collections.ConfigDict | RunConfig, processes_count: int | None = None) -> RunConfig:
    """The run's typed config, every field checked (against `processes_count` trainer processes,
    default: this job's) before anything runs; ConfigValueError lists every problem."""
    if isinstance(cfg, RunConfig):
        cfg = cfg.to_dict()
    if processes_count is None:
        import jax  # the job's processes (1 unless jax.distributed is initialized)
        processes_count = jax.process_count()
    return RunConfig.from_config(cfg, processes_count)


def check_prompt_room(fmt, tokenizer, problems, stages: Sequence[StageConfig], max_len: int):
    """The longest prompt of `problems` plus every stage's response budget must fit max_len."""
    longest = max(len(tokenizer.encode(fmt.prompt(p.question))) for p in problems)
    for i, stage in enumerate(stages):
        if longest + stage.max_response_tokens > max_len:
            raise ConfigValueError([f"the longest prompt ({longest} tokens) + stages[{i}].max_response_tokens "
                                    f"({stage.max_response_tokens}) exceeds rollout.max_len ({max_len})"])
