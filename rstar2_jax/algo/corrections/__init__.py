"""Off-policy corrections, registered, and `rl.correction.*` built from what they register.

    rl.correction.names = (token_tis,)          # any of them, together: weights multiply, masks AND
    rl.correction.token_tis.cap = 2.0           # each correction's own settings

Adding a correction: a function registered with `register_correction` in a module here (base.py
says what it receives and returns) and its module's import below; its settings appear as
`rl.correction.<name>.*`, its metrics as `correction/<name>/*`.
"""

from __future__ import annotations

import dataclasses

from rstar2_jax.algo.corrections import decoupled, importance, masks  # noqa: F401  (each registers)
from rstar2_jax.algo.corrections.base import (CORRECTIONS, SAFETY_BOUND, Correction, CorrectionInputs, CorrectionSpec,
                                              apply_correction, combined_correction, compose, correction_metrics,
                                              effective_sample_size, mismatch_metrics, register_correction)
from rstar2_jax.config_types import Section, changed_fields, setting

__all__ = ["CORRECTIONS", "SAFETY_BOUND", "Correction", "CorrectionConfig", "CorrectionInputs", "CorrectionSpec",
           "apply_correction", "combined_correction", "compose", "correction_metrics", "effective_sample_size",
           "mismatch_metrics", "register_correction"]


class _CorrectionBase(Section):
    """`rl.correction.*`: the off-policy corrections applied to every update (none: the paper's)."""

    @property
    def enabled(self) -> bool:
        return bool(self.names)

    def settings_of(self, name: str) -> Section:
        return getattr(self, name)

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
        for other in CORRECTIONS:
            if other in self.names:
                continue
            for name in changed_fields(getattr(self, other)):
                yield (f"{other}.{name}", f"belongs to correction {other!r}, which rl.correction.names does not "
                       f"list (add it: rl.correction.names=({', '.join([*self.names, other])},))")


def _make_correction_config() -> type[Section]:
    fields = [("names", tuple[str, ...], setting((), "corrections applied together (weights multiply, masks AND): "
                                                 + " | ".join(CORRECTIONS) + " (none: the paper); on the command line "
                                                 "--config.rl.correction.names=\"('token_tis', 'geo_mask')\""))]
    fields += [(name, spec.settings, setting(spec.settings, f"settings of the {name!r} correction"))
               for name, spec in CORRECTIONS.items()]
    return dataclasses.make_dataclass("CorrectionConfig", fields, bases=(_CorrectionBase,), frozen=True,
                                      namespace={"__module__": __name__, "__doc__": _CorrectionBase.__doc__})


CorrectionConfig = _make_correction_config()
