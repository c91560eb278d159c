"""Suite-wide setup: derandomized Hypothesis, a JAX compilation cache made for this run, and the
fixtures every package shares.

The compilation cache: the suite compiles the same tiny-model programs in hundreds of tests and
dozens of subprocesses (training runs, CLIs); a persistent cache halves a short training
subprocess (13.7 s -> 7.2 s measured). It lives in a directory created when the run starts and
removed when it ends, so a clean clone always starts cold and nothing left by an earlier run can
make a test pass. The controller creates it before pytest-xdist starts its workers, which (and
every subprocess they start) inherit it through the environment; so do XLA's fast-compile flags
(tests/xla_flags.py: the suite mostly compiles).

Between test modules a worker releases its compiled programs once their code's memory maps hold a
quarter of the kernel's limit (tests/compiled_programs.py: kept, they pile up over the run until
LLVM aborts the worker).
"""

import os
import shutil
import tempfile

from hypothesis import settings

settings.register_profile("repo", derandomize=True, deadline=None)
settings.load_profile("repo")


import pytest  # noqa: E402

from tests.xla_flags import xla_flags  # noqa: E402

_CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # the tiny model's programs compile fast but are many
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    # No size cap (JAX_COMPILATION_CACHE_MAX_SIZE): a cap turns on JAX's LRU eviction, which takes
    # one file lock, shared by every process of the run, around each read and write, and under it
    # lists and reads the whole directory on every write (jax/_src/lru_cache.py); with thousands of
    # entries that serialised the suite's compiles: tests/models, algo and learner took 697 s with
    # the cap and 515 s without (BENCHMARKS.md, "Test suite"). The entries are small (~20 KB each).
    # Without the lock a process may read an entry another is still writing: JAX then warns and
    # compiles (compiler._cache_read), which tests/test_compile_cache.py checks.
}


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller set the environment up
        return
    cache = tempfile.mkdtemp(prefix="rstar2-jax-test-jit-cache-")
    config._rstar2_jit_cache = cache
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    os.environ.update(_CACHE_ENV)
    # compile quickly, run a little slower: the suite mostly compiles (tests/xla_flags.py)
    os.environ["XLA_FLAGS"] = xla_flags(*os.environ.get("XLA_FLAGS", "").split())


# Tests that share a module-scoped fixture (a vLLM server, an ablation grid) run on one xdist
# worker, so it is built once.
@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = shared_fixture_group(item)
        if group and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))


def shared_fixture_group(item) -> str | None:
    """The xdist group of a test: the module of a module-scoped fixture it uses, else None
    (scheduled freely)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in item.fixturenames:
        fixturedefs = info.name2fixturedefs.get(name) or ()
        if fixturedefs and fixturedefs[-1].scope == "module":
            return item.module.__name__
    return None


@pytest.hookimpl(trylast=True)  # after the module's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """Moving on to another module: release this process's compiled programs if their memory maps
    crowd the kernel's limit, where LLVM would abort the worker (tests/compiled_programs.py)."""
    if nextitem is not None and nextitem.path == item.path:
        return
    from tests.compiled_programs import release_if_crowded
    problem = release_if_crowded()
    if problem:
        pytest.fail(f"{problem} (after {item.nodeid})", pytrace=False)


def pytest_unconfigure(config):
    cache = getattr(config, "_rstar2_jit_cache", None)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """One tiny random Qwen3 directory (model + tokenizer) shared by the session."""
    from rstar2_jax.models import tiny
    return tiny.build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=5)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from rstar2_jax import models
    return models.load_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from rstar2_jax.models.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def seed0_warm_start(tmp_path_factory):
    """The session's SFT'd tiny policy (tests/warm_start.py): (key, its directory); the model is
    `<directory>/model`. Built once for every xdist worker of the run."""
    from tests.warm_start import seed0_warm_start as build
    return build(session_shared_dir(tmp_path_factory))


def session_shared_dir(tmp_path_factory):
    """A directory of this test session that all its xdist workers see: under xdist each worker's
    base temp is `<session dir>/popen-gwN`; without xdist the base temp is the session's own (its
    parent then holds every earlier session's, which must not be shared)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def benchmark_dir(tmp_path_factory):
    """A data directory of small benchmark files in the public sets' formats (tests/benchmark_files.py)."""
    from tests.benchmark_files import write_benchmarks
    return write_benchmarks(tmp_path_factory.mktemp("benchmarks"))
