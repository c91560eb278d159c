"""Hypothesis runs derandomized: the same examples on every machine, so a CI failure reproduces."""

from hypothesis import settings

settings.register_profile("repo", derandomize=True, deadline=None)
settings.load_profile("repo")


import pytest  # noqa: E402


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
def benchmark_dir(tmp_path_factory):
    """A data directory of small benchmark files in the public sets' formats (tests/benchmark_files.py)."""
    from tests.benchmark_files import write_benchmarks
    return write_benchmarks(tmp_path_factory.mktemp("benchmarks"))
