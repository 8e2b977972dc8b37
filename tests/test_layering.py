"""The package's layering, read from the source and checked at run time.

Static: every module of kareus_megatron is parsed into an import graph of package modules: ``import x``
and ``from x import y`` at module level, inside functions and under ``if TYPE_CHECKING``, relative ones
resolved, and the lazy imports of modules that call ``importlib.import_module`` (their module names are
string constants, e.g. cost/__init__.py's export table). The graph has no cycle, and every edge between
two layers is allowed by LAYERS below.

Run time: a fresh interpreter imports a set of modules and lists what ended up in sys.modules (the
planner never loads torch, megatron, deepspeed, the runtime or matplotlib; the runtime never loads the
search, the cost model, report/ or jobs/).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "kareus_megatron"
PKG_DIR = ROOT / PKG
PACKAGE_ROOT = "__init__"  # the layer of kareus_megatron/__init__.py itself

# A layer is the first name under kareus_megatron (a subpackage or a top-level module). The data flows
# hardware -> workload -> cost -> search -> plan; report/ and jobs/ read and write what a cluster runs
# from the plans, without the search, the runtime or torch (so they run on a laptop or a submit host);
# the runtime executes a plan on the training ranks and never needs the search or the cost model;
# megatron.py, deepspeed.py and launch.py are the runtime's entry points for users; plotting/ draws for
# the commands; cli/ is the `kareus` command and sits on top of the planner side.
# The bottom modules (BOTTOM) and the package root may be imported by every layer; each layer's entry
# lists the other layers it may import.
BOTTOM = ("errors", "vocab", "jsonl", "files", "versions", "environment")
LAYERS: dict[str, frozenset[str]] = {
    PACKAGE_ROOT: frozenset(),  # the version string only: every import of the package runs it
    "errors": frozenset({"environment"}),  # KAREUS_ERROR_DIR
    "vocab": frozenset(),
    "jsonl": frozenset(),
    "files": frozenset({"errors"}),
    "versions": frozenset(),
    "environment": frozenset(),  # the KAREUS_* table (docs; tests/test_environment.py)
    "hardware": frozenset(),
    "workload": frozenset({"hardware"}),
    "cost": frozenset({"workload", "hardware"}),
    "search": frozenset({"cost", "workload", "hardware"}),
    "plan": frozenset({"search", "cost", "workload", "hardware"}),
    "report": frozenset({"plan", "cost", "workload", "hardware"}),
    "jobs": frozenset({"report", "plan", "workload", "hardware"}),
    "runtime": frozenset({"plan", "hardware"}),
    "megatron": frozenset({"megatron_spec", "runtime", "plan", "hardware"}),
    "megatron_spec": frozenset({"runtime", "plan", "hardware"}),
    "deepspeed": frozenset({"runtime", "plan", "hardware"}),
    "launch": frozenset({"runtime", "plan", "hardware"}),
    "plotting": frozenset({"jobs", "report", "plan", "search", "cost", "workload", "hardware"}),
    "cli": frozenset({"plotting", "jobs", "report", "plan", "search", "cost", "workload", "hardware"}),
}

# Single modules allowed one more layer than their own, each for one reason; they import it only inside the
# functions that need it, so loading the runtime still loads neither (test_runtime_never_imports_...):
# the simulated GPU's truth costs instructions with the cost model (only under KAREUS_SIMULATED_TRUTH), and the
# closed loop's rank-0 worker reads the run log through its one reader (only under --kareus-plan auto).
MODULE_ALLOWANCES: dict[str, frozenset[str]] = {
    "kareus_megatron.runtime.closed_loop.truth": frozenset({"cost"}),
    "kareus_megatron.runtime.closed_loop.auto_worker": frozenset({"report"}),
}

# Edges that break LAYERS and are to be fixed in the code: (importing module, imported module) -> why
# it is wrong. Each must still be in the graph (remove the entry once the import is gone).
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}


# ----------------------------------------------------------------------------------------------------
# The import graph


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, e.g. kareus_megatron.plan.io
    dst: str  # imported package module
    line: int
    lazy: bool  # named by a string constant (an importlib.import_module table), not an import statement

    def where(self, files: dict[str, Path]) -> str:
        return f"{files[self.src].relative_to(ROOT)}:{self.line}"


def package_modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is its __init__.py)."""
    out = {}
    for path in sorted(PKG_DIR.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def layer_of(module: str) -> str:
    return PACKAGE_ROOT if module == PKG else module.split(".")[1]


def _in_package(name: str) -> bool:
    return name == PKG or name.startswith(PKG + ".")


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def module_imports(module: str, path: Path, modules: dict[str, Path]) -> tuple[list[Edge], list[str]]:
    """The package modules `module` imports, and the package names it imports that are no module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: list[Edge] = []
    missing: list[str] = []
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    # Module names in strings are imports only where the module imports by name; elsewhere they are
    # command lines (jobs/ writes `python -m kareus_megatron.launch ...`), not imports.
    imports_by_name = any(
        isinstance(n, ast.Call) and _callee(n) in ("import_module", "__import__") for n in ast.walk(tree)
    )

    def add(dst: str, line: int, lazy: bool = False) -> None:
        if dst != module:
            edges.append(Edge(module, dst, line, lazy))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _in_package(alias.name):
                    continue
                if alias.name in modules:
                    add(alias.name, node.lineno)
                else:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if not _in_package(name):
                continue
            if name not in modules:
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {name} import ...")
                continue
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                add(sub if sub in modules else name, node.lineno)  # a submodule, or a name of `name`
        elif not imports_by_name:
            continue
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
            add(node.value, node.lineno, lazy=True)  # "kareus_megatron.cost.kernel" in a lazy-export table
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            prefix = str(node.values[0].value)  # f"kareus_megatron.cli.{name}": every listed name
            if prefix.endswith(".") and prefix[:-1] in modules and _in_package(prefix):
                for s in sorted(strings):
                    if prefix + s in modules:
                        add(prefix + s, node.lineno, lazy=True)
    return edges, missing


def import_graph() -> tuple[dict[str, Path], list[Edge], list[str]]:
    files = package_modules()
    edges: list[Edge] = []
    missing: list[str] = []
    for module, path in files.items():
        e, m = module_imports(module, path, files)
        edges += e
        missing += m
    return files, edges, missing


def strongly_connected_components(nodes: list[str], succ: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit): components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(succ.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ.get(w, ()))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def cycle_in(component: list[str], by_pair: dict[tuple[str, str], Edge]) -> list[Edge]:
    """One shortest cycle through the component's first module (BFS inside the component)."""
    members = set(component)
    start = component[0]
    prev: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for (a, b), e in by_pair.items():
            if a != v or b not in members:
                continue
            if b == start:
                path = [e]
                while path[0].src != start:
                    path.insert(0, prev[path[0].src])
                return path
            if b not in prev:
                prev[b] = e
                queue.append(b)
    raise AssertionError(f"no cycle found in component {component}")


def _short(module: str) -> str:
    return module.removeprefix(PKG + ".")


# ----------------------------------------------------------------------------------------------------
# Static checks


def test_graph_covers_every_module_and_every_import_resolves():
    files, edges, missing = import_graph()
    assert len(files) == len(list(PKG_DIR.rglob("*.py")))
    if missing:
        pytest.fail("package imports of modules that do not exist:\n" + "\n".join(missing), pytrace=False)
    # the parser sees every kind of import (guards it against silently finding nothing)
    pairs = {(e.src, e.dst) for e in edges}
    assert (f"{PKG}.cost", f"{PKG}.cost.kernel") in pairs  # lazy-export table
    assert (f"{PKG}.cli.main", f"{PKG}.cli.env") in pairs  # f-string import_module
    assert len(pairs) > 100


def test_cycle_finder_on_a_small_graph():
    """a -> b -> c -> a and d <-> e are cycles; c -> d, e -> f and the self-import f -> f are not."""
    pairs = [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d"), ("e", "f"), ("f", "f")]
    succ: dict[str, list[str]] = {}
    for a, b in pairs:
        succ.setdefault(a, []).append(b)
    comps = strongly_connected_components(list("fedcba"), succ)
    assert sorted(comps) == [["a", "b", "c"], ["d", "e"]]
    by_pair = {(a, b): Edge(a, b, i, False) for i, (a, b) in enumerate(pairs)}
    assert [(e.src, e.dst) for e in cycle_in(["a", "b", "c"], by_pair)] == [("a", "b"), ("b", "c"), ("c", "a")]


def test_import_graph_has_no_cycle():
    files, edges, _ = import_graph()
    succ: dict[str, list[str]] = {}
    by_pair: dict[tuple[str, str], Edge] = {}
    for e in edges:
        if (e.src, e.dst) not in by_pair:
            succ.setdefault(e.src, []).append(e.dst)
            by_pair[(e.src, e.dst)] = e
    components = strongly_connected_components(sorted(files), succ)
    report = []
    for comp in components:
        cycle = cycle_in(comp, by_pair)
        report.append(
            f"cycle among {len(comp)} modules ({', '.join(_short(m) for m in comp)}):\n"
            + "\n".join(
                f"    {_short(e.src)} -> {_short(e.dst)}{' (lazy)' if e.lazy else ''}   [{e.where(files)}]"
                for e in cycle
            )
        )
    if components:
        pytest.fail("import cycles in kareus_megatron:\n" + "\n".join(report), pytrace=False)


def test_every_layer_is_in_the_table():
    files = package_modules()
    unknown = sorted({layer_of(m) for m in files} - set(LAYERS))
    if unknown:
        pytest.fail(
            f"layers {unknown} of kareus_megatron are not in LAYERS (tests/test_layering.py): add each "
            "with the layers it may import, following the data flow described there",
            pytrace=False,
        )
    assert set(BOTTOM) <= set(LAYERS) and not set(LAYERS) - {layer_of(m) for m in files}, (
        f"LAYERS names layers that no longer exist: {sorted(set(LAYERS) - {layer_of(m) for m in files})}"
    )


def _top_level(path: Path, line: int) -> bool:
    """Whether the statement at `line` of `path` is at module level (not inside a function)."""
    tree = ast.parse(path.read_text())
    inner = {
        n.lineno
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
        if hasattr(n, "lineno")
    }
    return line not in inner


def test_imports_follow_the_layer_table():
    files, edges, _ = import_graph()
    bad, seen_known = [], set()
    for e in edges:
        src, dst = layer_of(e.src), layer_of(e.dst)
        if src == dst or src not in LAYERS:  # an unknown layer fails test_every_layer_is_in_the_table
            continue
        if dst in MODULE_ALLOWANCES.get(e.src, ()):
            if not e.lazy and _top_level(files[e.src], e.line):
                bad.append(f"{e.where(files)}: {_short(e.src)} may import {dst} only inside a function")
            continue
        if dst in LAYERS[src] or (src not in BOTTOM and src != PACKAGE_ROOT and dst in (*BOTTOM, PACKAGE_ROOT)):
            continue
        if (e.src, e.dst) in KNOWN_VIOLATIONS:
            seen_known.add((e.src, e.dst))
            continue
        may = sorted(LAYERS[src]) + ([] if src in BOTTOM or src == PACKAGE_ROOT else [*BOTTOM])
        bad.append(
            f"{e.where(files)}: {_short(e.src)} ({src}) imports {_short(e.dst)} ({dst})"
            f"{' lazily' if e.lazy else ''}; {src} may import only {', '.join(may) or 'nothing of the package'}"
        )
    if bad:
        pytest.fail(
            "imports against the layer table (LAYERS in tests/test_layering.py):\n" + "\n".join(bad), pytrace=False
        )
    stale = sorted(set(KNOWN_VIOLATIONS) - seen_known)
    assert not stale, f"KNOWN_VIOLATIONS entries no longer in the graph (remove them): {stale}"


# ----------------------------------------------------------------------------------------------------
# Run-time checks: what a fresh interpreter loads


def _loaded_after(imports: list[str], then: str = "") -> set[str]:
    code = "import sys\n" + "".join(f"import {m}\n" for m in imports) + then + "print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], check=True, cwd=ROOT, capture_output=True, text=True
    ).stdout
    return set(out.split())


def _modules_of(*layers: str) -> list[str]:
    return [m for m in package_modules() if layer_of(m) in layers]


def _top(loaded: set[str], *names: str) -> set[str]:
    return {m for m in loaded if m.split(".")[0] in names}


def _under(loaded: set[str], *layers: str) -> set[str]:
    return {m for m in loaded if m.startswith(PKG + ".") and layer_of(m) in layers}


def test_planner_never_imports_torch_or_the_runtime():
    """Every planner module and every `kareus` command module, with the parser built (which imports them)."""
    loaded = _loaded_after(
        _modules_of("hardware", "workload", "cost", "search", "plan", "cli"), then=f"{PKG}.cli.main.build_parser()\n"
    )
    assert not _top(loaded, "torch", "megatron", "deepspeed")
    assert not _under(loaded, "runtime", "megatron", "deepspeed", "launch")
    assert "matplotlib" not in loaded  # plotting is imported lazily, by the commands that draw


def test_report_and_jobs_need_no_runtime_search_or_torch():
    loaded = _loaded_after(_modules_of("report", "jobs"))
    assert not _top(loaded, "torch", "megatron", "deepspeed")
    assert not _under(loaded, "runtime", "search")


def test_runtime_never_imports_search_cost_report_or_jobs():
    """Every runtime module (the overlap layer loads megatron-core) and the three entry points."""
    loaded = _loaded_after(_modules_of("runtime", "megatron", "deepspeed", "launch"))
    assert not _under(loaded, "search", "cost", "report", "jobs")
