"""Execution semantics of execute_python_code_with_standard_io(code, input)."""

import pytest

from sandbox import ExecResult


def test_prints_go_to_stdout(sb):
    r = sb.run("print('a')\nprint('b', 2)")
    assert (r.status, r.stdout, r.stderr, r.exit_code) == ("ok", "a\nb 2\n", "", 0)


def test_last_expression_repr_when_nothing_printed(sb):
    assert sb.run("x = 21\nx * 2").stdout == "42\n"
    assert sb.run("'text'").stdout == "'text'\n"
    assert sb.run("[1, 2][0]; None").stdout == ""            # None is not shown
    assert sb.run("print('shown')\n1 + 1").stdout == "shown\n"  # something was printed: no repr


def test_stdin_is_the_input(sb):
    r = sb.run("a = int(input())\nb = int(input())\nprint(a + b)", stdin="3\n4\n")
    assert r.stdout == "7\n"
    assert sb.run("import sys\nprint(len(sys.stdin.read()))", stdin="é" * 10).stdout == "10\n"


def test_exception_gives_concise_traceback_of_user_frames_only(sb):
    r = sb.run("def f(x):\n    return 1 / x\n\nf(0)")
    assert r.status == "error" and r.exit_code == 1
    assert r.stderr.startswith("Traceback (most recent call last):\n")
    assert 'File "<code>", line 4, in <module>' in r.stderr and 'line 2, in f' in r.stderr
    assert "return 1 / x" in r.stderr and r.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "zygote" not in r.stderr and "sandbox" not in r.stderr


def test_syntax_error_is_an_error(sb):
    r = sb.run("def (")
    assert r.status == "error" and "SyntaxError" in r.stderr


def test_sys_exit_codes(sb):
    assert sb.run("import sys; print('x'); sys.exit(0)").status == "ok"
    r = sb.run("import sys; sys.exit(3)")
    assert (r.status, r.exit_code) == ("error", 3)
    r = sb.run("raise SystemExit('bye')")
    assert (r.status, r.stderr) == ("error", "bye\n")


def test_timeout_says_so(sb):
    r = sb.run("import time\ntime.sleep(10)", timeout=0.5)
    assert r.status == "timeout" and "TimeoutError" in r.stderr
    assert 0.5 <= r.duration_s < 2.0


def test_preloaded_math_stack_is_fast(sb):
    r = sb.run("import sympy, numpy\nx = sympy.Symbol('x')\nprint(sympy.factor(x**2 - 1), numpy.arange(3).sum())")
    assert r.stdout == "(x - 1)*(x + 1) 3\n"
    assert r.duration_s < 0.2  # a fresh interpreter importing sympy alone takes ~0.3 s


def test_stdlib_modules_not_preloaded_still_import(sb):
    assert sb.run("import fractions, decimal, statistics, heapq, json\nprint(statistics.mean([1, 2, 3]))").stdout == "2\n"


def test_result_round_trips_through_dict():
    r = ExecResult("ok", "out", "", 0, 0.1, False)
    assert ExecResult.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="unknown status"):
        ExecResult("weird")


@pytest.mark.parametrize("kwargs,message", [
    (dict(code=3), "code must be a string"),
    (dict(code="1", stdin=None), "stdin must be a string"),
    (dict(code="1", timeout=0), "timeout must be in"),
    (dict(code="1", timeout=10_000), "timeout must be in"),
    (dict(code="1", timeout="5"), "timeout must be a number"),
])
def test_bad_requests_are_rejected_before_running(sb, kwargs, message):
    with pytest.raises(ValueError, match=message):
        sb.call(sb.sb.run(**kwargs))
