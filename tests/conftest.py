"""Session-wide test settings."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _data_cache(tmp_path_factory):
    """The token cache of every test (and of the `tptrain` processes they start) in a temporary directory,
    never the user's ~/.cache (nor a $TPTRAIN_CACHE of theirs)."""
    os.environ["TPTRAIN_CACHE"] = str(tmp_path_factory.mktemp("data-cache"))
    yield
