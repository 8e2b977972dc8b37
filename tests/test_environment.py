"""kareus_megatron/environment.py lists exactly the KAREUS_* variables the package, launch/ and the Makefile spell."""

from __future__ import annotations

import re
from pathlib import Path

from kareus_megatron.environment import ENVIRONMENT, environment_table

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bKAREUS_[A-Z][A-Z_]*[A-Z]\b")


def _spelled() -> set[str]:
    files = [*(ROOT / "kareus_megatron").rglob("*.py"), *(ROOT / "launch").rglob("*.py"), ROOT / "Makefile"]
    return {m for f in files for m in NAME.findall(f.read_text())}


def test_every_variable_the_code_reads_is_documented_and_none_is_stale():
    listed = {v.name for v in ENVIRONMENT}
    assert len(listed) == len(ENVIRONMENT)
    assert _spelled() == listed
    for v in ENVIRONMENT:
        assert v.meaning.endswith(".") and v.read_by
        for owner in v.read_by.split(", "):
            assert v.name in (ROOT / "kareus_megatron" / owner).read_text(), (v.name, owner)
    table = environment_table()
    assert all(f"| `{v.name}` |" in table for v in ENVIRONMENT)
