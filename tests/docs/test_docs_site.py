"""`make docs`: the site builds in strict mode, its generated reference covers the code, a broken link fails it,
and the README stays a short page that links into the site."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kareus_megatron.cli.main import COMMANDS, build_parser
from kareus_megatron.plan.io import SCHEMA_PATH

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _make_docs(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`make docs ARGS` in `cwd` with this interpreter's environment; the install step is taken as done."""
    bin_dir = os.path.dirname(sys.executable)
    if not Path(bin_dir, "mkdocs").is_file():
        pytest.fail(
            f"mkdocs is not installed in {bin_dir}: pip install -e '.[docs]' (make install-test does)", pytrace=False
        )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep)}
    return subprocess.run(
        ["make", "--no-print-directory", "-o", ".venv/.test", "docs", f"BIN={bin_dir}", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every long option of `parser` and of its subcommands."""
    out = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out |= _options(sub)
    return out


def _schema_fields(schema: dict) -> set[str]:
    return {f for obj in [schema, *schema.get("$defs", {}).values()] for f in obj.get("properties", {})}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site `make docs` builds from the checkout, into a new directory (`make test` builds site/ beside the
    suite)."""
    out = tmp_path_factory.mktemp("site")
    r = _make_docs(ROOT, f"SITE={out}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_reference_pages_cover_the_code(site: Path):
    """Every subcommand and flag, every plan field, every GPU preset with its sources; every nav page built."""
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for name in COMMANDS:
        assert f'id="kareus-{name}"' in cli, name
    assert 'id="kareus-launch-run"' in cli and 'id="kareus-launch-comparison"' in cli
    missing = sorted(o for o in _options(build_parser()) if o not in cli)
    assert not missing, f"flags missing from the CLI reference: {missing}"
    plan = (site / "reference" / "plan-format" / "index.html").read_text()
    fields = _schema_fields(json.loads(SCHEMA_PATH.read_text()))
    assert len(fields) > 30 and not sorted(f for f in fields if f"<code>{f}</code>" not in plan)
    presets = (site / "reference" / "presets" / "index.html").read_text()
    gpus = tomllib.loads((ROOT / "kareus_megatron" / "hardware" / "gpus.toml").read_text())
    for name, table in gpus.items():
        assert f'id="{name}"' in presets, name
        assert f"<code>{table['sm_clock_max_mhz']}</code>" in presets
    assert "[A100-WP] table 3" in presets and "[PERSEUS]" in presets  # each number's source, from its comment
    assert (site / "img" / "predict-default.png").stat().st_size > 10_000
    nav = re.findall(r":\s+([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert len(nav) >= 25
    for page in nav:
        assert (site / page.removesuffix(".md").removesuffix("index") / "index.html").is_file(), page


def test_a_broken_link_fails_the_build(tmp_path: Path):
    """Strict mode is really on: a link to a missing page and a missing anchor each fail `make docs`."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    for name in ("mkdocs.yml", "Makefile"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "kareus_megatron").symlink_to(ROOT / "kareus_megatron")
    page = tmp_path / "docs" / "getting-started.md"
    bad = {"no-such-page.md": "[gone](no-such-page.md)", "no-such-anchor": "[gone](sources.md#no-such-anchor)"}
    page.write_text(page.read_text() + "".join(f"\n{link}\n" for link in bad.values()))
    r = _make_docs(tmp_path)  # one build: strict mode reports every warning, then fails
    assert r.returncode != 0
    for name, link in bad.items():
        assert name in r.stdout + r.stderr, f"{link} was not reported"


def test_readme_is_short_and_links_into_the_site():
    """≤ 250 lines with both commands; every relative link of the README points at a file of the checkout."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert re.search(r"^make demo\b", readme, re.M) and re.search(r"^make test\b", readme, re.M)
    links = [m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme) if "://" not in m]
    assert len(links) >= 15
    assert not [link for link in links if not (ROOT / link).exists()]
