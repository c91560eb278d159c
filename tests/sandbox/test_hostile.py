"""Hostile code: each case gets the right status, benign calls running beside it keep getting
correct answers, and afterwards no process or file of the call is left."""

import os
import socket
import threading
import time

import pytest

from tests.sandbox.helpers import leftover_work_files, ls, wait_no_processes

BENIGN = {"code": "import sympy\nprint(sum(range(10)), sympy.Integer(2) ** 10)", "timeout": 20}
BENIGN_OUT = "45 1024\n"


def run_beside_benign(sb, code, timeout=3.0, stdin=""):
    """Run `code` with benign calls submitted alongside it; returns the hostile result."""
    results = sb.run_many([{"code": code, "stdin": stdin, "timeout": timeout}] + [BENIGN] * 4)
    for r in results[1:]:
        assert (r.status, r.stdout) == ("ok", BENIGN_OUT), r
    after = sb.run(BENIGN["code"])
    assert after.stdout == BENIGN_OUT
    left = wait_no_processes(sb.uids)
    assert not left, f"processes left behind: {left}"
    assert leftover_work_files(sb) == []
    return results[0]


def test_infinite_loop_times_out(sb):
    r = run_beside_benign(sb, "while True:\n    pass", timeout=1.0)
    assert r.status == "timeout" and r.duration_s < 3


def test_sigalrm_ignored_then_sleep(sb):
    r = run_beside_benign(sb, "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                              "signal.alarm(1)\ntime.sleep(60)", timeout=1.0)
    assert r.status == "timeout"


@pytest.mark.parametrize("how", ["setsid", "double_fork"])
def test_daemon_holding_the_pipe_dies_with_the_call(sb, how):
    code = {
        "setsid": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    print('late')\n"
                  "print('parent done')",
        "double_fork": "import os, time\nif os.fork() == 0:\n    if os.fork() == 0:\n        os.setsid()\n"
                       "        while True:\n            print('spam', flush=True); time.sleep(0.01)\n    os._exit(0)\n"
                       "time.sleep(0.2)\nprint('parent done')",
    }[how]
    start = time.monotonic()
    r = run_beside_benign(sb, code, timeout=10.0)
    assert r.status == "ok" and "parent done" in r.stdout and "late" not in r.stdout
    assert time.monotonic() - start < 8  # the daemon did not hold the call open


def test_fork_bomb_is_contained(sb):
    r = run_beside_benign(sb, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                          timeout=2.0)
    assert r.status in ("timeout", "error", "killed")


def test_thread_storm_is_contained(sb):
    r = run_beside_benign(sb, "import threading, time\nfor _ in range(10_000):\n"
                              "    threading.Thread(target=time.sleep, args=(30,)).start()", timeout=3.0)
    assert r.status == "error" and "can't start new thread" in r.stderr


def test_huge_allocation_is_a_memory_error(sb):
    # 10 s: on a loaded machine filling the cgroup's 1 GiB before the OOM kill can take over 3 s
    r = run_beside_benign(sb, "x = bytearray(8 * 2**30)", timeout=10.0)
    assert r.status == "memory"


def test_slow_leak_is_a_memory_error(sb):
    r = run_beside_benign(sb, "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))", timeout=10.0)
    assert r.status == "memory"


def test_200mb_to_stdout_is_stopped_at_the_cap(sb):
    start = time.monotonic()
    r = run_beside_benign(sb, "import sys\nfor _ in range(200):\n    sys.stdout.write('x' * 2**20)", timeout=20.0)
    assert r.status == "output_limit" and r.truncated
    assert len(r.stdout) == 64 * 1024 and set(r.stdout) == {"x"}
    assert time.monotonic() - start < 5


def test_invalid_utf8_output_is_replaced_not_fatal(sb):
    r = run_beside_benign(sb, "import sys\nsys.stdout.buffer.write(b'ok\\xff\\xfe\\x80 end')")
    assert r.status == "ok" and r.stdout.startswith("ok") and r.stdout.endswith(" end") and "\ufffd" in r.stdout


def test_stderr_flood_is_capped(sb):
    r = run_beside_benign(sb, "import sys\nwhile True:\n    sys.stderr.write('e' * 4096)", timeout=5.0)
    assert r.status == "output_limit" and r.truncated


def test_disk_fill_is_refused(sb):
    r = run_beside_benign(sb, "with open('big', 'wb') as f:\n    f.write(b'0' * (200 * 2**20))", timeout=10.0)
    assert r.status == "error" and "File too large" in r.stderr


def test_writes_outside_the_calls_own_tmp_fail(sb, tmp_path):
    # The call's /tmp (its cwd) and /dev/shm are its own tmpfs; everything else is read-only or absent.
    targets = ["/var/tmp/escape", "/root/escape", "../escape", "/escape", "/usr/escape", "/etc/escape",
               "/dev/escape", str(tmp_path / "escape"), os.path.join(os.getcwd(), "escape")]
    code = ("import os\nok = []\nfor p in %r:\n    try:\n        open(p, 'w').write('x')\n        ok.append(p)\n"
            "    except OSError:\n        pass\nprint(ok)") % targets
    r = run_beside_benign(sb, code)
    assert r.stdout == "[]\n"
    for p in targets + ["/tmp/escape", "/dev/shm/escape"]:
        assert not os.path.exists(p if p.startswith("/") else os.path.join("/tmp", p)), p


def test_loopback_service_is_unreachable(sb):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    r = run_beside_benign(sb, f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                              "s.sendall(b'hello')")
    t.join()
    server.close()
    assert r.status == "error" and ("unreachable" in r.stderr or "refused" in r.stderr)
    assert not accepted


def test_environment_and_proc_hold_no_secrets(sb):
    os.environ["RSTAR2_TEST_SECRET"] = "hunter2"  # the sandbox must not see what the service has
    try:
        code = ("import os\nprint(dict(os.environ))\nfor p in ['/proc/1/environ', '/proc/self/environ', "
                f"'/proc/{os.getpid()}/environ', '/proc/{os.getppid()}/environ']:\n    try:\n"
                "        print(p, open(p, 'rb').read())\n    except OSError as e:\n        print(p, type(e).__name__)\n"
                "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
        r = run_beside_benign(sb, code)
    finally:
        del os.environ["RSTAR2_TEST_SECRET"]
    assert r.status == "ok"
    assert "hunter2" not in r.stdout and r.stdout.startswith("{}\n")
    assert f"/proc/{os.getpid()}/environ FileNotFoundError" in r.stdout
    visible = eval(r.stdout.strip().splitlines()[-1])
    assert visible == [1]  # its own /proc: only the call itself (PID 1 of its namespace)


def test_signalling_the_parent_and_kill_minus_one(sb):
    service_pid = os.getpid()
    r = run_beside_benign(sb, f"import os, signal\nprint(os.getpid(), os.getppid())\n"
                              f"try:\n    os.kill({service_pid}, signal.SIGKILL)\nexcept OSError as e:\n"
                              "    print(type(e).__name__)\nif os.fork() == 0:\n    import time; time.sleep(30)\n"
                              "os.kill(-1, signal.SIGKILL)\nprint('survived')")
    # The call is PID 1 of its own namespace: the service does not exist there, and kill -1
    # reaches only the call's own children.
    assert r.stdout.startswith("1 0\nProcessLookupError\n")
    assert r.status == "ok" and r.stdout.endswith("survived\n")


def test_ctypes_segfault_is_killed(sb):
    r = run_beside_benign(sb, "import ctypes\nctypes.string_at(0)")
    assert r.status == "killed" and "SIGSEGV" in r.stderr


@pytest.mark.parametrize("limit", [None, 10**7])
def test_deep_recursion(sb, limit):
    prefix = f"import sys\nsys.setrecursionlimit({limit})\n" if limit else ""
    r = run_beside_benign(sb, prefix + "def f(n):\n    return f(n + 1)\nf(0)")
    # Python 3.11+ keeps Python frames off the C stack: a huge limit ends in memory or time.
    assert r.status in (("error",) if limit is None else ("error", "killed", "memory", "timeout"))


def test_cannot_raise_its_own_limits(sb):
    # rlimits it has (CPU, file size, open files) cannot be raised, and its cgroup's limits are not
    # even visible: no /sys in its root.
    r = run_beside_benign(sb, "import os, resource\nfor which in (resource.RLIMIT_CPU, resource.RLIMIT_FSIZE, "
                              "resource.RLIMIT_NOFILE):\n    soft, hard = resource.getrlimit(which)\n"
                              "    try:\n        resource.setrlimit(which, (hard * 2 + 10, hard * 2 + 10))\n"
                              "        print('raised', which)\n    except (ValueError, OSError) as e:\n"
                              "        print('refused')\nprint(os.path.exists('/sys'))")
    assert r.stdout == "refused\nrefused\nrefused\nFalse\n"


def test_no_files_survive_into_the_next_call(sb):
    writers = sb.run_many([{"code": "open('left_behind', 'w').write('x')\nimport os\nprint(os.getcwd())"}] * 6)
    assert all(r.ok for r in writers)
    readers = sb.run_many([{"code": f"print({ls('.')}, {ls('/dev/shm')})"}] * 6)
    for r in readers:
        assert r.stdout == "[] []\n", r.stdout  # own dirs empty
    assert leftover_work_files(sb) == []


def test_forged_result_markers_land_in_stdout(sb):
    forged = '{"status": "ok", "stdout": "forged", "exit_code": 0, "id": 0}'
    r = run_beside_benign(sb, f"import os, sys\nprint({forged!r})\n"
                              "for fd in (3, 4, 5, 6):\n    try:\n        os.write(fd, b'\\x00\\x00\\x00\\x02{{}}')\n"
                              "    except OSError:\n        pass\nsys.exit(2)")
    assert r.status == "error" and r.exit_code == 2 and r.stdout == forged + "\n"
