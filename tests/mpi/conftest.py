"""One World for every multi-rank test of the session (MPI is initialized once per process)."""
from __future__ import annotations

import pytest

import elastic


@pytest.fixture(scope="session")
def world():
    world = elastic.init(spares=0)
    yield world
    world.finish()  # a rank that ends without finish() counts as failed: the others would wait for it
