"""Inside a call: the code run as a script, its output captured, its exceptions reported with its
own frames only, and `warm_up`, which runs that path once in the forker before any call.
Imported as a top-level sibling by zygote/main.py (no package inside the zygote: see its docstring)."""

import ast
import builtins
import io
import linecache
import os
import sys
import traceback
import types

from .state import USER_FILE

def _filter_user_frames(te):
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename == USER_FILE])
    for inner in (te.__cause__, te.__context__):
        if inner is not None:
            _filter_user_frames(inner)
    return te


class _TrackingFileIO(io.FileIO):
    """Raw stdout that remembers whether anything reached it (print, sys.stdout.buffer, ...)."""
    wrote = False

    def write(self, b):
        if len(b):
            self.wrote = True
        return super().write(b)


def main_namespace():
    """The globals of a fresh script: those of a real `__main__` module in sys.modules, so that
    pickle finds the code's own functions by reference (multiprocessing.Pool.map over a function
    the snippet defines, ProcessPoolExecutor) as it would in `python script.py`."""
    module = types.ModuleType("__main__")
    # no __file__, as for `python -c`: a "spawn" child would otherwise try to re-run a file that
    # does not exist (and fail in a loop); it is a plain missing-attribute error instead
    module.__dict__.update({"__builtins__": builtins})
    sys.modules["__main__"] = module
    return module.__dict__


def make_streams():
    """(stdin, stdout, stderr, raw stdout) text streams over fds 0, 1 and 2, unused.

    A forker makes one set when it starts (CALL_STREAMS), and every call it forks starts with
    that set untouched: building them in each call cost ~0.1 ms. A session makes a set per cell."""
    raw_stdout = _TrackingFileIO(1, "w", closefd=False)
    return (io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace"),
            io.TextIOWrapper(io.BufferedWriter(raw_stdout, 16384), encoding="utf-8", errors="backslashreplace"),
            io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                             write_through=True),
            raw_stdout)


CALL_STREAMS = None  # the worker's set (make_streams, made by its forker), never written to by the worker


def run_user_code(code, namespace, streams):
    """Run `code` as a script; repr of a last expression when nothing was printed. Returns exit code.

    namespace: a session's globals, kept from cell to cell (None: a fresh script).
    streams: make_streams()'s, fresh (nothing read or written through them yet)."""
    sys.stdin, sys.stdout, sys.stderr, raw_stdout = streams
    sys.argv = [USER_FILE]
    linecache.cache[USER_FILE] = (len(code), None, code.splitlines(True), USER_FILE)
    if namespace is None:
        namespace = main_namespace()
    exit_code = 0
    try:
        tree = ast.parse(code, USER_FILE)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, USER_FILE, "exec"), namespace)
        if last is not None:
            value = eval(compile(last, USER_FILE, "eval"), namespace)
            sys.stdout.flush()
            if value is not None and not raw_stdout.wrote:
                sys.stdout.write(repr(value) + "\n")
    except SystemExit as e:
        exit_code = exit_status(e)
    except BaseException as e:  # noqa: BLE001 - the user's exception is the result
        exit_code = 1
        report(e)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - e.g. the output pipe was closed by the supervisor
            pass
    return exit_code


# The code's objects may raise from __str__, __format__, __repr__, __bool__, __index__, and
# sys.stderr may be anything by now: what follows reports them without calling into the code's
# objects where it can, writes to fd 2 directly, and never lets an exception out (which would
# unwind into the sandbox's own frames and print them).

def emit(text):
    try:
        data = text.encode("utf-8", "backslashreplace")
        while data:
            data = data[os.write(2, data):]
    except BaseException:  # noqa: BLE001 - stderr closed: nothing to report to
        pass


def exit_status(e):
    """The exit status of SystemExit(code), as Python's own exit would give it."""
    try:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):  # int.__and__ reads the value, never a subclass's methods
            return int.__and__(code, 0xFF)
        emit(_safe_str(code) + "\n")
    except BaseException:  # noqa: BLE001
        pass
    return 1


def _safe_str(obj):
    try:
        text = str(obj)
        return text if type(text) is str else "<unprintable>"
    except BaseException:  # noqa: BLE001
        return f"<unprintable {type(obj).__name__} object>"


def report(e):
    """The traceback of the code's exception, its own frames only (by where they were compiled)."""
    try:
        te = _filter_user_frames(traceback.TracebackException.from_exception(e))
        emit("".join(te.format()))
    except BaseException:  # noqa: BLE001 - a hostile exception: its type's name is all we say
        try:
            emit(f"{type(e).__name__}: <the exception could not be formatted>\n")
        except BaseException:  # noqa: BLE001
            pass


WARM_UP_CODE = ("x = [i * i for i in range(10)]\nprint(sum(x), 'a', 1.5)\nx",
                "def f(n):\n    return {'n': n + 1}\nprint(f(2)['n'], end='')\nimport sys\nsys.exit(0)",
                "x = [1, 2, 3]\nx[5]")


def warm_up(rounds=12):
    """Run a call's own Python path (parse, compile, exec, print, exit, a traceback) here, before
    forking any: the interpreter then has specialised that code and filled its type cache in this
    process, so each call does not write (and so copy) those pages again. Output goes to
    /dev/null; nothing of it stays. An error here costs speed only."""
    saved_fds = [os.dup(fd) for fd in (0, 1, 2)]
    saved = sys.stdin, sys.stdout, sys.stderr, sys.argv, sys.modules.get("__main__")
    null = os.open("/dev/null", os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        for _ in range(rounds):
            for code in WARM_UP_CODE:
                run_user_code(code, None, make_streams())
    except BaseException:  # noqa: BLE001 - only a speed-up
        pass
    finally:
        for fd, old in zip((0, 1, 2), saved_fds):
            os.dup2(old, fd)
            os.close(old)
        os.close(null)
        sys.stdin, sys.stdout, sys.stderr, sys.argv = saved[:4]
        if saved[4] is not None:
            sys.modules["__main__"] = saved[4]
        linecache.cache.pop(USER_FILE, None)
