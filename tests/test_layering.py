"""The package's layering: the planner never imports torch, the runtime never imports the search.

Each check imports a set of modules in a fresh interpreter and lists what ended up in sys.modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "kareus_megatron"
ORDER = ["hardware", "workload", "cost", "search", "plan", "runtime"]


def _loaded_after(imports: list[str]) -> set[str]:
    code = "import sys\n" + "".join(f"import {m}\n" for m in imports) + "print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=True, cwd=ROOT,
                         capture_output=True, text=True).stdout
    return set(out.split())


def _modules(*packages: str) -> list[str]:
    mods = []
    for pkg in packages:
        for path in sorted((PKG / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            mods.append(".".join(p for p in rel.parts if p != "__init__"))
    return mods


def test_planner_never_imports_torch_or_the_runtime():
    loaded = _loaded_after(_modules("hardware", "workload", "cost", "search", "plan") + ["kareus_megatron.cli.main"])
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "megatron", "deepspeed")}
    assert not {m for m in loaded if m.startswith("kareus_megatron.runtime")}
    assert "matplotlib" not in loaded  # plotting is imported lazily, by the commands that draw


def test_package_imports_follow_the_data_flow():
    """A module in package P imports only from packages before P (runtime and plan may use layer_vocab)."""
    allowed_extra = {"kareus_megatron.workload.layer_vocab", "kareus_megatron.errors"}
    bad = []
    for pkg in ORDER:
        later = ORDER[ORDER.index(pkg) + 1:]
        for path in (PKG / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                for name in names:
                    parts = name.split(".")
                    if parts[0] != "kareus_megatron" or len(parts) < 2 or name in allowed_extra:
                        continue
                    if parts[1] in later or parts[1] == "cli":
                        bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_runtime_never_imports_search_or_cost():
    loaded = _loaded_after(["kareus_megatron.runtime.session", "kareus_megatron.runtime.clock_controller",
                            "kareus_megatron.megatron", "kareus_megatron.launch"])
    assert not {m for m in loaded if m.startswith(("kareus_megatron.search", "kareus_megatron.cost"))}
