import pytest

from tests.sandbox.helpers import SyncSandbox


@pytest.fixture(scope="session")
def sb():
    box = SyncSandbox(workers=3, default_timeout=5.0)
    yield box
    box.close()
