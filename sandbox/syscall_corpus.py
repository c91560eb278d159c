"""What policy code does in the sandbox, as a corpus of calls: the workload whose system calls the
seccomp allow-list (syscall_policy.py) was measured on, and that the tests run under it.

Each entry is (name, code, stdin, expected stdout). Math with the preloaded libraries, the
standard library's usual suspects (files in /tmp, subprocesses, threads, multiprocessing, time,
random, hashing, json, re, decimal), input(), a traceback and an exit.
"""

CORPUS = (
    ("print", "print(2 ** 100)", "", "1267650600228229401496703205376\n"),
    ("last_expression", "x = 6 * 7\nx", "", "42\n"),
    ("input", "a, b = map(int, input().split())\nprint(a + b)", "3 4\n", "7\n"),
    ("sympy", "import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 5*x + 6, x), sp.factorint(360),"
              " sp.integrate(sp.sin(x)**2, (x, 0, sp.pi)))", "", "[2, 3] {2: 3, 3: 2, 5: 1} pi/2\n"),
    ("numpy", "import numpy as np\na = np.arange(16.0).reshape(4, 4) + np.eye(4)\n"
              "print(round(float(np.linalg.det(a)), 6), np.linalg.solve(a, np.ones(4)).shape, np.fft.fft([1, 0, 0, 0]).real)",
     "", "-49.0 (4,) [1. 1. 1. 1.]\n"),
    ("fractions_itertools", "from fractions import Fraction\nimport itertools, math\n"
                            "print(sum(Fraction(1, n) for n in range(1, 6)), "
                            "sum(1 for p in itertools.permutations(range(5)) if p[0] < p[-1]), math.comb(30, 15))",
     "", "137/60 60 155117520\n"),
    ("decimal_re_json_hashlib", "import decimal, re, json, hashlib, random\ndecimal.getcontext().prec = 30\n"
                                "random.seed(0)\nprint(decimal.Decimal(2).sqrt(), re.findall(r'\\d+', 'a1b22'), "
                                "json.dumps({'k': [1, 2]}), hashlib.sha256(b'x').hexdigest()[:8], random.randint(1, 9))",
     "", "1.41421356237309504880168872421 ['1', '22'] {\"k\": [1, 2]} 2d711642 7\n"),
    ("files_in_tmp", "import os, tempfile, shutil\nd = tempfile.mkdtemp()\np = os.path.join(d, 'f.txt')\n"
                     "open(p, 'w').write('hi')\nshutil.copy(p, p + '.2')\nos.rename(p + '.2', p + '.3')\n"
                     "print(sorted(os.listdir(d)), os.path.getsize(p + '.3'))\nshutil.rmtree(d)",
     "", "['f.txt', 'f.txt.3'] 2\n"),
    ("subprocess", "import subprocess, sys\n"
                   "print(subprocess.run([sys.executable, '-c', 'print(3 * 3)'], capture_output=True, text=True).stdout, end='')",
     "", "9\n"),
    ("threads", "import threading, queue\nq = queue.Queue()\nts = [threading.Thread(target=q.put, args=(i,)) for i in range(4)]\n"
                "[t.start() for t in ts]\n[t.join() for t in ts]\nprint(sorted(q.get() for _ in range(4)))",
     "", "[0, 1, 2, 3]\n"),
    ("multiprocessing", "import multiprocessing as mp\ndef f(x):\n    return x * x\n"
                        "with mp.Pool(2) as p:\n    print(p.map(f, range(5)))", "", "[0, 1, 4, 9, 16]\n"),
    ("concurrent_futures", "from concurrent.futures import ProcessPoolExecutor\n"
                           "with ProcessPoolExecutor(2) as ex:\n    print(list(ex.map(abs, [-1, -2])))", "", "[1, 2]\n"),
    ("time_signal", "import time, signal\nsignal.signal(signal.SIGALRM, lambda *a: None)\nsignal.setitimer("
                    "signal.ITIMER_REAL, 0.01)\ntime.sleep(0.02)\nprint(time.time() > 0, time.monotonic() > 0)",
     "", "True True\n"),
    ("asyncio", "import asyncio\nasync def f():\n    await asyncio.sleep(0.01)\n    return 5\nprint(asyncio.run(f()))",
     "", "5\n"),
    ("mmap_statvfs", "import mmap, os\nm = mmap.mmap(-1, 4096)\nm[:3] = b'abc'\nprint(m[:3], os.statvfs('/tmp').f_bsize > 0)",
     "", "b'abc' True\n"),
    ("socketpair", "import socket\na, b = socket.socketpair()\na.sendall(b'ping')\nprint(b.recv(4))", "", "b'ping'\n"),
    ("resource", "import resource, os\nprint(resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 0, os.cpu_count() > 0, "
                 "len(os.sched_getaffinity(0)) > 0)", "", "True True True\n"),
    ("traceback", "def f():\n    return 1 / 0\ntry:\n    f()\nexcept ZeroDivisionError as e:\n    print(type(e).__name__)",
     "", "ZeroDivisionError\n"),
    ("exit", "import sys\nprint('bye')\nsys.exit(0)", "", "bye\n"),
)
