"""Math-Verify in a separate, killable process: one JSON request per line on stdin, one answer
per line on stdout. Runs in its own main thread, so math-verify's signal.alarm timeouts work; the
parent kills it when a pathological input overruns the parent's own deadline."""

import json
import resource
import sys


def _exact_if_rational(a, b):
    """verify compares numbers in floating point: 1/2^99 and 1/2^98 come out equal. When both
    sides are exact rationals, compare them exactly."""
    try:
        a, b = a.doit(), b.doit()
    except (AttributeError, TypeError, ValueError):
        return True
    if getattr(a, "is_Rational", False) and getattr(b, "is_Rational", False):
        return a == b
    return True


def main():
    memory = int(sys.argv[1]) if len(sys.argv) > 1 else 2 << 30
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    for line in sys.stdin:
        req = json.loads(line)
        try:
            gold = parse("$" + req["gold"] + "$", extraction_config=configs, parsing_timeout=req["timeout"])
            pred = parse("$" + req["pred"] + "$", extraction_config=configs, parsing_timeout=req["timeout"])
            ok = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=req["timeout"]))
            if ok:
                ok = _exact_if_rational(gold[0], pred[0])
            out = {"equal": ok}
        except BaseException as e:  # noqa: BLE001 - TimeoutException derives from BaseException
            out = {"equal": False, "error": f"{type(e).__name__}: {e}"[:300]}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
