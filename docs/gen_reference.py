"""The generated reference pages of the docs site: the CLI from argparse, the plan format, the GPU presets.

mkdocs-gen-files runs this file at every `make docs` (mkdocs.yml `plugins`), so the pages cannot drift from
the code; tests/docs/test_docs_site.py imports it to check what it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the checkout's package, also when another copy is installed
    sys.path.insert(0, str(ROOT))

from kareus_megatron.cli.main import build_parser  # noqa: E402
from kareus_megatron.plan.io import SCHEMA_PATH  # noqa: E402
from kareus_megatron.plan.schema import PLAN_FORMAT  # noqa: E402

GPUS_TOML = ROOT / "kareus_megatron" / "hardware" / "gpus.toml"
DIES_TOML = ROOT / "kareus_megatron" / "hardware" / "dies.toml"
HELP_WIDTH = "100"  # columns argparse wraps help text at, so the pages do not depend on the terminal


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Subcommand name -> its parser (argparse keeps them on the subparsers action; cli/main.py reads them so)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], str]]:
    """(command words, --help text) of `parser` and of every subcommand below it, depth first."""
    yield path, parser.format_help()
    for name, sub in _subcommands(parser).items():
        yield from _walk(sub, (*path, name))


def cli_page() -> str:
    """Markdown: every `kareus` subcommand with its --help text, as argparse prints it."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        entries = list(_walk(build_parser(), ("kareus",)))
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    lines = [
        "# kareus command line",
        "",
        "Generated from the argument parsers (`kareus_megatron/cli/`) at every `make docs`: each section is",
        "what `--help` prints. Bad input to any command is one line naming the problem and exit status 2.",
        "",
    ]
    lines += ["| command | what it does |", "|---|---|"]
    for name, sub in _subcommands(build_parser()).items():
        first = (sub.description or "").splitlines()[0] if sub.description else ""
        lines.append(f"| [`kareus {name}`](#kareus-{name}) | {first} |")
    lines.append("")
    for path, text in entries:
        title = " ".join(path)
        anchor = "-".join(path)
        lines += [f"## `{title}` {{#{anchor}}}", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(lines)


def _schema_type(prop: dict) -> str:
    """A JSON Schema property's type in words: `integer`, `number or null`, `list of Instruction`."""
    if "$ref" in prop:
        return f"[{prop['$ref'].rsplit('/', 1)[-1]}](#{prop['$ref'].rsplit('/', 1)[-1].lower()})"
    if "anyOf" in prop:
        return " or ".join(_schema_type(p) for p in prop["anyOf"])
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{prop['const']}`"
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list of {_schema_type(prop.get('items', {}))}"
    if kind == "object" and isinstance(prop.get("additionalProperties"), dict):
        return f"map of {_schema_type(prop['additionalProperties'])}"
    return str(kind)


def _bounds(prop: dict) -> str:
    """The numeric bounds of a property, e.g. `> 0`, `>= 0`."""
    parts = []
    for key, sign in (("exclusiveMinimum", ">"), ("minimum", ">="), ("exclusiveMaximum", "<"), ("maximum", "<=")):
        if key in prop:
            parts.append(f"{sign} {prop[key]}")
    for sub in prop.get("anyOf", []):
        parts += [b for b in [_bounds(sub)] if b]
    return ", ".join(parts)


def _object_table(name: str, obj: dict) -> list[str]:
    """Markdown section for one schema object: field, type, required, default, bounds, description."""
    required = set(obj.get("required", []))
    lines = [f"### {name}", ""]
    if obj.get("description"):
        lines += [" ".join(obj["description"].split()), ""]
    lines += ["| field | type | required | default | bounds | description |", "|---|---|---|---|---|---|"]
    for field, prop in obj.get("properties", {}).items():
        default = json.dumps(prop["default"]) if "default" in prop else ""
        desc = " ".join(prop.get("description", "").split()).replace("|", "\\|")
        lines.append(
            f"| `{field}` | {_schema_type(prop)} | {'yes' if field in required else ''} | {default} | "
            f"{_bounds(prop)} | {desc} |"
        )
    lines.append("")
    return lines


def plan_format_page() -> str:
    """Markdown: the plan file's fields, from its JSON Schema (`kareus_megatron/plan/plan.schema.json`)."""
    schema = json.loads(SCHEMA_PATH.read_text())
    lines = [
        "# Plan format",
        "",
        f"A plan file (`{PLAN_FORMAT}`) is what `kareus plan` and `kareus solve` write and the runtime runs:",
        "data, never code, checked by pydantic when it is read. Generated from its JSON Schema",
        "(`kareus_megatron/plan/plan.schema.json`; `tests/search/test_planner.py` keeps it equal to the model)",
        "at every `make docs`. Units are in the field names: s, J, W, MHz.",
        "",
        "## Plan",
        "",
    ]
    lines += _object_table("Plan", schema)[2:]
    for name, obj in sorted(schema.get("$defs", {}).items()):
        lines += _object_table(name, obj)
    return "\n".join(lines)


def presets_page() -> str:
    """Markdown: every GPU preset of `hardware/gpus.toml`, each number with the source its comment gives."""
    text = GPUS_TOML.read_text()
    presets = tomllib.loads(text)
    header, sources, current = [], {}, None
    for line in text.splitlines():
        table = re.match(r"^\[([^\]]+)\]\s*$", line)
        if table:
            current = table.group(1)
            sources[current] = {}
        elif current is None and line.startswith("#"):
            header.append(line[2:].rstrip())
        elif current is not None and "=" in line and not line.lstrip().startswith("#"):
            key, _, rest = line.partition("=")
            comment = rest.split("#", 1)[1].strip() if "#" in rest else ""
            sources[current][key.strip()] = comment
    from kareus_megatron.hardware.gpus import resolve_die

    names = list(presets)
    for n in names:  # the fields each preset takes from its die (hardware/dies.toml), with the die's sources
        presets[n], sources[n] = resolve_die(n, presets[n], sources[n])
    header += ["", *(line[2:].rstrip() for line in DIES_TOML.read_text().splitlines() if line.startswith("#"))]
    lines = [
        "# GPU presets",
        "",
        "Generated from `kareus_megatron/hardware/gpus.toml` and `dies.toml` (the power curves every board of a",
        "die shares) at every `make docs`; every number with the source its line gives (abbreviations below, full",
        "citations in [Sources](../sources.md)). `--gpu NAME` picks a preset on every command.",
        "",
        "| preset | SMs | max SM clock (MHz) | bf16 dense (TFLOP/s) | HBM (GB/s) | memory (GB) | power limit (W) |"
        " blocked power (W) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        p = presets[n]
        lines.append(
            f"| [`{n}`](#{n}) | {p['sm_count']} | {p['sm_clock_max_mhz']} | {p['peak_tflops']['bf16']} | "
            f"{p['hbm_gb_per_s']} | {p['memory_gb']} | {p['power_limit_w']} | {p['p_blocked_w']} |"
        )
    lines += ["", "## Abbreviations and the power model", "", "```text", *header, "```", ""]
    for n in names:
        lines += [f"## `{n}` {{#{n}}}", "", "| key | value | source |", "|---|---|---|"]
        for key, value in presets[n].items():
            shown = json.dumps(value).replace("|", "\\|")
            lines.append(f"| `{key}` | `{shown}` | {sources[n].get(key, '').replace('|', chr(92) + '|')} |")
        lines.append("")
    return "\n".join(lines)


def predict_figure() -> bytes:
    """PNG: `kareus predict`'s time (s), energy (J) and power (W) against the SM clock (MHz), default job."""
    import contextlib
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kareus_megatron.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["predict", "--format", "json"])
    if status != 0:
        raise RuntimeError(f"kareus predict --format json exited with status {status}")
    rows = json.loads(out.getvalue())["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2), layout="constrained")
    for key, ax, label in zip(
        ("time_s", "energy_j", "avg_power_w"),
        axes,
        ("time per microbatch (s)", "energy per microbatch, one GPU (J)", "average power (W)"),
    ):
        for stage in sorted({r["stage"] for r in rows}):
            for kind, style in (("forward", "-"), ("backward", "--")):
                pts = sorted(
                    (r["frequency_mhz"], r[key]) for r in rows if r["stage"] == stage and r["instruction"] == kind
                )
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=".", label=f"stage {stage} {kind}")
        ax.set_xlabel("SM clock (MHz)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        "kareus predict, default job (llama3.2-3b, 2 x 8 A100-SXM4-40GB, TP=8, PP=2): model predictions", fontsize=9
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


PAGES = {
    "reference/cli.md": cli_page,
    "reference/plan-format.md": plan_format_page,
    "reference/presets.md": presets_page,
    "reference/environment.md": lambda: environment_page(),
}


def environment_page() -> str:
    """Every KAREUS_* variable (kareus_megatron/environment.py)."""
    from kareus_megatron.environment import environment_table

    return (
        "# Environment variables\n\nEvery `KAREUS_*` variable kareus reads (generated from "
        "`kareus_megatron/environment.py`; a test keeps it equal to the package's spellings). Flags win over "
        "variables where both exist, except `KAREUS_GPU_READ_ONLY`, which wins over every flag.\n\n"
        + environment_table()
    )


def _write_pages() -> None:
    """Write every generated page into the site being built (mkdocs-gen-files' virtual docs folder)."""
    import mkdocs_gen_files

    for name, make in PAGES.items():
        with mkdocs_gen_files.open(name, "w") as f:
            f.write(make())
    with mkdocs_gen_files.open("img/predict-default.png", "wb") as f:
        f.write(predict_figure())


if __name__ == "<run_path>":  # run by mkdocs-gen-files
    _write_pages()
