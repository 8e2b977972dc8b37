"""The suite's order (tests/conftest.py SLOWEST_FIRST_S): every file it names exists, and the slowest run first."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SLOWEST_FIRST_S

ROOT = Path(__file__).resolve().parents[1]


def test_every_weighted_file_exists():
    assert [f for f in SLOWEST_FIRST_S if not (ROOT / f).is_file()] == []


def test_the_collection_starts_with_the_slowest_file(request: pytest.FixtureRequest):
    items = request.session.items
    if len(items) < 1000:  # a run of a few files: nothing to order
        pytest.skip("only the whole suite is ordered")
    files = [item.path.relative_to(ROOT).as_posix() for item in items]
    present = [f for f in SLOWEST_FIRST_S if f in set(files)]  # `make test-fast` deselects the end-to-end files
    assert files[0] == max(present, key=SLOWEST_FIRST_S.__getitem__)
