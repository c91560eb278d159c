"""Off-policy corrections, registered, and `rl.correction.*` built from what they register.

    rl.correction.names = (token_tis,)          # any of them, together: weights multiply, masks AND
    rl.correction.token_tis.cap = 2.0           # each correction's own settings

Adding a correction: a function registered with `register_correction` in a module here (base.py
says what it receives and returns) and its module's import below; its settings appear as
`rl.correction.<name>.*`, its metrics as `correction/<name>/*`.
"""

from __future__ import annotations

from rstar2_jax.algo.corrections import decoupled, importance, masks  # noqa: F401  (each registers)
from rstar2_jax.algo.corrections.base import (CORRECTIONS, Correction, CorrectionInputs, CorrectionSpec,
                                              apply_correction, combined_correction, compose, correction_metrics,
                                              effective_sample_size, mismatch_metrics, register_correction)
from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.core.part_sections import PartChoice, part_section

__all__ = ["CORRECTIONS", "Correction", "CorrectionConfig", "CorrectionInputs", "CorrectionSpec",
           "apply_correction", "combined_correction", "compose", "correction_metrics", "effective_sample_size",
           "mismatch_metrics", "register_correction"]


class _CorrectionBase(PartChoice):
    """`rl.correction.*`: the off-policy corrections applied to every update (none: the paper's)."""

    @property
    def enabled(self) -> bool:
        return bool(self.names)

    def chosen(self) -> tuple[str, ...]:
        return self.names

    def settings_of(self, name: str) -> Section:
        return self.settings(name)

    def not_chosen(self, other: str) -> str:
        return (f"belongs to correction {other!r}, which rl.correction.names does not list (add it: "
                f"rl.correction.names=({', '.join([*self.names, other])},))")

    def rules(self):
        for i, name in enumerate(self.names):
            problem = CORRECTIONS.problem(name)
            if problem and ("," in name or "(" in name):
                problem = (f"{name!r} is not one name: on the command line a list is a Python tuple, "
                           "--config.rl.correction.names=\"('token_tis', 'geo_mask')\"")
            if problem:
                yield f"names[{i}]", problem
        dup = sorted({n for n in self.names if self.names.count(n) > 1})
        if dup:
            yield "names", f"lists {', '.join(dup)} twice (a correction applies once)"
        yield from super().rules()


CorrectionConfig = part_section(
    "CorrectionConfig", CORRECTIONS, path="rl.correction", module=__name__, base=_CorrectionBase,
    selector=("names", tuple[str, ...], setting((), "corrections applied together (weights multiply, masks AND): "
                                                + " | ".join(CORRECTIONS) + " (none: the paper); on the command "
                                                "line --config.rl.correction.names=\"('token_tis', 'geo_mask')\"")))
