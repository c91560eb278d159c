import pytest

from rstar2_jax import models
from rstar2_jax.models import tiny
from rstar2_jax.models.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tiny.build_tiny_model(tmp_path_factory.mktemp("tiny_rollout"), seed=5)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    return models.load_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    return Tokenizer.from_pretrained(tiny_dir)
