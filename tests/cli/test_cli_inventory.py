"""Every `kareus` subcommand and flag, listed so that adding or removing one is a deliberate change.

If this test fails because you added a flag on purpose, add it here too (docs/reference/cli.md is generated).
"""

from __future__ import annotations

import subprocess
import sys

from kareus_megatron.cli.main import build_parser, main

EXPECTED = {
    "env": ["--check-permission", "--debug", "--device", "--gpu-index", "--json", "--try-lock"],
    "predict": [
        "--calibration",
        "--cp",
        "--debug",
        "--distributed-optimizer",
        "--dp",
        "--first-stage-layers",
        "--format",
        "--freqs",
        "--gpu",
        "--gpus-per-node",
        "--last-stage-layers",
        "--mbs",
        "--microbatches",
        "--model",
        "--nodes",
        "--pp",
        "--precision",
        "--recompute",
        "--seq",
        "--sequence-parallel",
        "--sp",
        "--tp",
        "--vp",
    ],
    "calibrate": [
        "--calibration",
        "--cp",
        "--debug",
        "--device",
        "--dp",
        "--dry-run",
        "--first-stage-layers",
        "--force",
        "--from-log",
        "--gpu",
        "--gpu-index",
        "--gpus-per-node",
        "--iterations",
        "--last-stage-layers",
        "--mbs",
        "--microbatches",
        "--model",
        "--nodes",
        "--out",
        "--output",
        "--plan",
        "--pp",
        "--precision",
        "--profile",
        "--ratios-only",
        "--recompute",
        "--run",
        "--seconds",
        "--seq",
        "--sequence-parallel",
        "--sp",
        "--tp",
        "--vp",
        "-o",
    ],
    "partitions": [
        "--calibration",
        "--cp",
        "--debug",
        "--dp",
        "--first-stage-layers",
        "--format",
        "--freq",
        "--gpu",
        "--gpus-per-node",
        "--last-stage-layers",
        "--mbs",
        "--microbatches",
        "--model",
        "--nanobatches",
        "--nodes",
        "--overlap",
        "--pp",
        "--precision",
        "--recompute",
        "--seq",
        "--sequence-parallel",
        "--sp",
        "--tp",
        "--vp",
    ],
    "plan": [
        "--band-samples",
        "--calibration",
        "--clock-latency-ms",
        "--cp",
        "--cross-layer",
        "--debug",
        "--distributed-optimizer",
        "--dp",
        "--first-stage-layers",
        "--framework",
        "--freqs",
        "--gpu",
        "--gpus-per-node",
        "--last-stage-layers",
        "--max-ramp",
        "--max-swing",
        "--max-time",
        "--mbs",
        "--methods",
        "--microbatches",
        "--model",
        "--no-figures",
        "--no-memory-check",
        "--nodes",
        "--objective",
        "--out",
        "--points",
        "--pp",
        "--precision",
        "--recompute",
        "--robust",
        "--seq",
        "--sequence-parallel",
        "--sp",
        "--timeline",
        "--tp",
        "--vp",
    ],
    "solve": [
        "--clock-latency-ms",
        "--cp",
        "--debug",
        "--dp",
        "--gpu",
        "--gpus-per-node",
        "--layers-per-stage",
        "--max-time",
        "--mbs",
        "--micro-batch-size",
        "--microbatches",
        "--nodes",
        "--out",
        "--p-blocked",
        "--p2p-time",
        "--points",
        "--pp",
        "--profile",
        "--schedule",
        "--seq",
        "--seq-length",
        "--tp",
        "--zeus-format",
    ],
    "report": ["--debug", "--format", "--no-plot", "--per-gpu", "--plan", "--plot", "--skip", "--skip-iterations"],
    "compare": ["--debug", "--no-plot", "--out", "--skip", "--skip-iterations"],
    "validate": [
        "--debug",
        "--device",
        "--dry-run",
        "--gpu",
        "--gpu-index",
        "--no-clock-control",
        "--out",
        "--seconds",
    ],
    "launch run": [
        "--container-image",
        "--container-mounts",
        "--debug",
        "--dry-run",
        "--gpus-per-node",
        "--launcher",
        "--log-dir",
        "--master-addr",
        "--master-port",
        "--method",
        "--node-rank",
        "--nodes",
        "--overwrite",
        "--plan-dir",
        "--point",
        "--rdzv-id",
        "--robust",
        "--script",
        "--train-iters",
    ],
    "launch comparison": [
        "--container-image",
        "--container-mounts",
        "--debug",
        "--dry-run",
        "--gpus-per-node",
        "--launcher",
        "--log-dir",
        "--master-addr",
        "--master-port",
        "--methods",
        "--node-rank",
        "--nodes",
        "--overwrite",
        "--plan-arg",
        "--plan-dir",
        "--point",
        "--rdzv-id",
        "--robust",
        "--script",
        "--skip-iterations",
        "--train-iters",
    ],
    "torchrun": ["--debug"],
}


def _subparsers(parser=None, prefix=""):
    """'name' -> parser of every subcommand; nested ones (kareus launch run) as 'launch run', leaves only."""
    parser = parser or build_parser()
    action = next((a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"), None)
    out = {}
    for name, sp in action.choices.items() if action else ():
        nested = _subparsers(sp, f"{prefix}{name} ")
        out.update(nested or {f"{prefix}{name}": sp})
    return out


def test_subcommands_and_flags_are_the_documented_ones():
    got = {
        name: sorted(o for a in sp._actions for o in a.option_strings if o not in ("-h", "--help"))
        for name, sp in _subparsers().items()
    }
    assert got == EXPECTED


def test_every_subcommand_answers_help_with_exit_0(capsys):
    for name in [*EXPECTED, "launch"]:
        try:
            main([*name.split(), "--help"])
        except SystemExit as e:
            assert e.code == 0, name
        assert "usage: kareus " + name in capsys.readouterr().out, name


def test_unknown_flag_is_one_line_exit_2(capsys):
    try:
        main(["predict", "--no-such-flag"])
    except SystemExit as e:
        assert e.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--no-such-flag" in err[0]


def test_unknown_preset_through_the_console_script_has_no_traceback():
    r = subprocess.run(
        [sys.executable, "-m", "kareus_megatron.cli.main", "predict", "--gpu", "b200-nope"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "b200-nope" in r.stderr


def test_version_is_the_installed_metadata(capsys):
    from importlib.metadata import version

    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out.strip() == f"kareus {version('kareus-megatron')}"


def test_method_flags_name_every_method_from_the_vocabulary():
    """Every --methods/--method flag names each planned method (vocab.METHODS), and no stale count: its help once said
    'default all four' with five planned (issue 25)."""
    import re

    from kareus_megatron.vocab import METHODS

    flags = [
        (name, a)
        for name, sp in _subparsers().items()
        for a in sp._actions
        if {"--methods", "--method"} & set(a.option_strings)
    ]
    assert {name for name, _ in flags} >= {"plan", "launch comparison", "launch run"}, flags
    for name, a in flags:
        text = f"{a.help} {' '.join(a.choices or ())}"
        assert all(re.search(rf"\b{m}\b", text) for m in METHODS), (name, text)
        assert not re.search(r"\b(two|three|four|five|six)\b", a.help or ""), (name, a.help)
        assert all(int(n) == len(METHODS) for n in re.findall(r"\ball (\d+)", a.help or "")), (name, a.help)


def test_a_flag_is_taken_only_in_full_and_a_typo_names_the_flag_meant(capsys):
    """argparse's prefix matching read `--gpus h100` as --gpus-per-node (its error named the wrong flag) and `--method`
    as --methods; flags are now taken as spelled, and the subcommand's one line names the closest one (issue 25's
    newcomer check)."""
    for argv, meant in (
        (["plan", "--gpus", "h100"], "--gpu"),
        (["plan", "--method", "kareus"], "--methods"),
        (["predict", "--microbatch", "8"], "--microbatches"),
        (["launch", "run", "--plan-dir", "x", "--nodess", "2"], "--nodes"),
    ):
        try:
            main(argv)
        except SystemExit as e:
            assert e.code == 2, argv
        else:
            raise AssertionError(f"{argv} was accepted")
        err = capsys.readouterr().err.strip().splitlines()
        prog = "kareus " + " ".join(a for a in argv if a in ("plan", "predict", "launch", "run"))
        assert err == [
            f"{prog}: error: unrecognized arguments: {' '.join(argv[-2:])} ({argv[-2]}: did you mean {meant}?)"
        ]
