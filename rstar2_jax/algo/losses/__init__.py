"""Policy losses, one module each, and `rl.loss.*` built from what they register.

Adding a loss: a module here that defines its settings Section and registers its function with
`register_loss` (base.py says what it receives and returns), and its import below. Its settings
appear as `rl.loss.<name>.*`; the update, the metrics and `--helpconfig` need nothing else
(docs/DESIGN.md, "Adding a part").
"""

from __future__ import annotations

from rstar2_jax.algo.aggregation import AGGREGATIONS
from rstar2_jax.algo.losses import cispo, clip_higher, gspo, reinforce  # noqa: F401  (each registers its loss)
from rstar2_jax.algo.losses.base import (COMMON_STATS, LOSSES, LossInputs, LossSpec, LossTerms, policy_loss_terms,
                                         register_loss, stat_names)
from rstar2_jax.core.config_types import setting
from rstar2_jax.core.part_sections import PartChoice, part_section
from rstar2_jax.algo.log_ratio import LOG_RATIO_BOUND

__all__ = ["COMMON_STATS", "LOSSES", "LossInputs", "LossSpec", "LossTerms", "PolicyLossConfig", "policy_loss_terms",
           "register_loss", "stat_names"]


class _PolicyLossBase(PartChoice):
    """`rl.loss.*`: the policy loss, how its tokens are aggregated, and each loss's own settings
    (`rl.loss.<loss>.*`; only the selected loss's may differ from their defaults)."""

    def aggregation_name(self) -> str:
        return self.aggregation or LOSSES[self.name].default_aggregation

    def rules(self):
        yield from super().rules()
        if self.name not in LOSSES:
            return
        spec, agg = LOSSES[self.name], self.aggregation_name()
        if agg in AGGREGATIONS and spec.aggregations is not None and agg not in spec.aggregations:
            yield "aggregation", (f"loss {self.name!r} is defined with {', '.join(spec.aggregations)} only, "
                                  f"got {agg!r}")


PolicyLossConfig = part_section(
    "PolicyLossConfig", LOSSES, path="rl.loss", module=__name__, base=_PolicyLossBase,
    selector=("name", str, setting("clip_higher", "the policy loss (each has its own rl.loss.<name>.* settings)",
                                   choices=LOSSES)),
    common=[
        ("aggregation", str | None, setting(None, "token_mean | seq_mean_token_mean | seq_mean_token_sum | "
                                            "constant (None: the loss's own; the paper: token_mean)",
                                            choices=AGGREGATIONS)),
        ("constant_tokens", int, setting(0, "aggregation=constant: C in sum / (sequences x C) (0: the largest "
                                         "stages[].max_response_tokens, Dr. GRPO's maximum response length)",
                                         min=0)),
        ("log_ratio_clamp", float, setting(LOG_RATIO_BOUND, "log(pi / pi_old) clamped to +-this before exp (verl: 20)",
                                           min=1.0)),
    ])
