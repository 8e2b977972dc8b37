"""kareus_megatron/environment.py lists exactly the KAREUS_* variables the package, launch/ and the Makefile spell."""

from __future__ import annotations

import re
from pathlib import Path

from kareus_megatron.environment import ENVIRONMENT, KareusSettings, environment_table, kareus_settings

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
        field = KareusSettings.field_of(v.name)
        for owner in v.read_by.split(", "):
            assert f".{field}" in (ROOT / "kareus_megatron" / owner).read_text(), (v.name, owner)
    table = environment_table()
    assert all(f"| `{v.name}` |" in table for v in ENVIRONMENT)


def test_the_settings_object_has_one_field_per_variable_and_reads_them_all():
    names = [v.name for v in ENVIRONMENT]
    assert sorted(KareusSettings.__dataclass_fields__) == sorted(KareusSettings.field_of(n) for n in names)
    env = {n: f" value of {n} " for n in names} | {"OTHER": "x"}
    got = kareus_settings(env)
    assert all(getattr(got, KareusSettings.field_of(n)) == f"value of {n}" for n in names)
    assert kareus_settings({}) == KareusSettings(**{f: "" for f in KareusSettings.__dataclass_fields__})
    assert [KareusSettings.flag(v) for v in ("", "0", "1", "yes")] == [False, False, True, True]


READ = re.compile(r"(?:environ\.get|getenv)\(\s*[\"']KAREUS_|environ\[\s*[\"']KAREUS_[A-Z_]+[\"']\s*\](?!\s*=)")


def test_no_module_but_environment_py_reads_a_kareus_variable():
    readers = [
        str(f.relative_to(ROOT))
        for f in (ROOT / "kareus_megatron").rglob("*.py")
        if f.name != "environment.py" and READ.search(f.read_text())
    ]
    assert readers == []
