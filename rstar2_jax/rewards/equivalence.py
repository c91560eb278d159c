"""is_equivalent(pred, gold): textual normalisation first, then math-verify in a killable worker.

math-verify catches what strings miss (1/2 vs 0.5, \\frac{1}{2} vs \\dfrac12, x+1 vs 1+x); the
normalisation catches what it misses or gets wrong (leading zeros, thousands separators, units,
degrees, percent, text after a number, bracket style of matrices, spellings of the imaginary
unit, choice letters) and a guard removes its false positive of matching one element of a list
("5, 6, 7" against 7: math-verify reads the last number). Where normalising changed an answer,
the raw strings are checked too, so the result is never below math-verify alone on a true pair
(tests/rewards/test_grader_vs_math_verify.py measures it per category).

The worker process has a memory cap and each check a time cap: a pathological answer (power
towers, deep nesting, megabytes of text) costs at most `timeout_s` and compares unequal.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading

from rstar2_jax.rewards.answer import choice_letter, normalize, top_level_items

MAX_ANSWER_CHARS = 2000


class _VerifyWorker:
    def __init__(self, timeout_s: float = 5.0, memory_bytes: int = 2 << 30):
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self):
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verify_worker.py")
        self._proc = subprocess.Popen([sys.executable, script, str(self.memory_bytes)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)

    def _kill(self):
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def equal(self, pred: str, gold: str) -> bool:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            inner = max(1, int(self.timeout_s) - 1)
            try:
                self._proc.stdin.write(json.dumps({"pred": pred, "gold": gold, "timeout": inner}) + "\n")
                self._proc.stdin.flush()
                ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout_s)
                if not ready:
                    self._kill()  # overran its own alarm: a pathological input
                    return False
                line = self._proc.stdout.readline()
            except (BrokenPipeError, OSError):
                self._kill()
                return False
            if not line:
                self._kill()  # died (e.g. out of memory)
                return False
            return bool(json.loads(line).get("equal"))

    def close(self):
        with self._lock:
            self._kill()


_worker = _VerifyWorker()


def set_verify_limits(timeout_s: float = 5.0, memory_bytes: int = 2 << 30):
    """Caps for the shared math-verify worker (per check time, worker address space)."""
    global _worker
    _worker.close()
    _worker = _VerifyWorker(timeout_s, memory_bytes)


def is_equivalent(pred: str | None, gold: str) -> bool:
    if pred is None or not pred.strip():
        return False
    if len(pred) > MAX_ANSWER_CHARS:
        return False
    p, g = normalize(pred), normalize(gold)
    if p == g:
        return True
    gold_letter = choice_letter(gold)
    if gold_letter is not None:
        return choice_letter(pred) == gold_letter
    if top_level_items(p) != top_level_items(g):
        return False  # "5, 6, 7" is not 7, whatever a parser picks out of it
    if _worker.equal(p, g):
        return True
    # Never below math-verify alone: where the normalisation changed a side, the raw strings get
    # their own check (math-verify reads some forms better untouched).
    return (p, g) != (pred.strip(), gold.strip()) and _worker.equal(pred.strip(), gold.strip())
