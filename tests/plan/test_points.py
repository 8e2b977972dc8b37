"""plan/points.py: the one frontier.json reader and the one point syntax, and every point resolving the same
plan through the runtime entry (--kareus-point), DeepSpeed (install(point=...)) and `kareus launch`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kareus_megatron.deepspeed as kds
from kareus_megatron.cli import main as cli_main
from kareus_megatron.errors import ConfigError, PlanError
from kareus_megatron.plan.frontier import frontier_document
from kareus_megatron.plan.io import save_plan, write_json_atomic
from kareus_megatron.plan.points import (
    ALL,
    FASTEST,
    MIN_ENERGY,
    PointSpec,
    parse_point,
    read_frontier,
    resolve_point,
    select_frontier_points,
)
from kareus_megatron.plan.schema import Plan
from kareus_megatron.runtime.frameworks.entry import resolve_plan
from kareus_megatron.search.schedules import instruction_order

# method -> [(time_s, energy_j)], fastest first: NN, fastest and min-energy all differ.
POINTS = {
    "megatron": [(0.9, 40.0)],
    "perseus": [(1.1, 25.0), (1.3, 15.0)],
    "kareus": [(1.0, 30.0), (1.2, 20.0), (1.5, 10.0)],
}


def tiny_plan(method: str, time_s: float, energy_j: float) -> Plan:
    """A 2-stage plan for 1 node x 2 GPUs of a tiny model (megatron_args can express it)."""
    order = instruction_order("1f1b", 2, 2)
    return Plan.model_validate(
        {
            "format": "kareus-plan/1",
            "method": method,
            "gpu": "a100-sxm4-40gb",
            "model": dict(
                name="tiny",
                num_layers=2,
                hidden_size=8,
                num_attention_heads=1,
                num_query_groups=1,
                ffn_hidden_size=8,
                vocab_size=16,
                activation="gelu",
                normalization="layernorm",
                position_embedding="learned",
                kv_channels=8,
                bias_linear=True,
                qkv_bias=True,
                tied_embeddings=True,
                qk_norm=False,
                precision="fp32",
            ),
            "parallel": dict(
                tp=1,
                cp=1,
                pp=2,
                vp=1,
                dp=1,
                micro_batch_size=1,
                seq_length=8,
                num_microbatches=2,
                layers_per_stage=(1, 1),
                nodes=1,
                gpus_per_node=2,
            ),
            "predicted": {"iteration_time_s": time_s, "iteration_energy_j": energy_j},
            "stages": [
                {
                    "pp_rank": r,
                    "instructions": [
                        {"kind": k, "microbatch": mb, "chunk": c, "sm_clock_mhz": 1410} for k, mb, c in order[r]
                    ],
                }
                for r in range(2)
            ],
        }
    )


def make_dir(d: Path, points: dict[str, list[tuple[float, float]]] = POINTS) -> Path:
    methods = {}
    for name, pts in points.items():
        methods[name] = []
        for i, (t, e) in enumerate(pts):
            save_plan(tiny_plan(name, t, e), d / f"plans/{name}-{i:02d}.json")
            methods[name].append({"time_s": t, "energy_j": e, "plan": f"plans/{name}-{i:02d}.json"})
    write_json_atomic(d / "frontier.json", frontier_document({"model": "tiny"}, methods))
    return d


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    return make_dir(tmp_path_factory.mktemp("plans"))


# point -> the plan it names (no method in the point: the default method, kareus)
SYNTAX = {
    None: "kareus-00",
    "00": "kareus-00",
    "02": "kareus-02",
    "kareus-01": "kareus-01",
    "perseus-01": "perseus-01",
    "fastest": "kareus-00",
    "min-energy": "kareus-02",
    "kareus-fastest": "kareus-00",
    "kareus-min-energy": "kareus-02",
    "perseus-fastest": "perseus-00",
    "perseus-min-energy": "perseus-01",
    "megatron-00": "megatron-00",
}


def _launcher_plan(capsys, plan_dir: Path, point: str | None) -> str:
    args = ["launch", "run", "--plan-dir", str(plan_dir), "--nodes", "1", "--gpus-per-node", "2", "--dry-run"]
    assert cli_main.main(args + (["--point", point] if point else [])) == 0
    (line,) = capsys.readouterr().out.splitlines()
    return re.search(r"--kareus-plan (\S+)", line).group(1)


@pytest.mark.parametrize("point", list(SYNTAX))
def test_every_point_names_the_same_plan_everywhere(plan_dir, capsys, monkeypatch, point):
    monkeypatch.setattr(cli_main, "COMMANDS", {"launch": "launch"})
    want = str(plan_dir / "plans" / f"{SYNTAX[point]}.json")
    plan, entry = resolve_plan(str(plan_dir), point)  # --kareus-plan DIR --kareus-point POINT
    ds_plan, ds = kds._resolve_plan(plan_dir, point)  # kareus_megatron.deepspeed.install(DIR, point=POINT)
    assert entry == ds == _launcher_plan(capsys, plan_dir, point) == want
    assert plan == ds_plan and plan.method == SYNTAX[point].split("-")[0]


@pytest.mark.parametrize(
    "text, spec",
    [
        ("03", PointSpec(None, 3)),
        ("fastest", PointSpec(None, FASTEST)),
        ("min-energy", PointSpec(None, MIN_ENERGY)),
        ("perseus-03", PointSpec("perseus", 3)),
        ("nanobatch_perseus-min-energy", PointSpec("nanobatch_perseus", MIN_ENERGY)),
        ("kareus-fastest", PointSpec("kareus", FASTEST)),
        ("solve-00", PointSpec("solve", 0)),
        (7, PointSpec(None, 7)),
    ],
)
def test_point_syntax(text, spec):
    assert parse_point(text) == spec


@pytest.mark.parametrize(
    "text, needle",
    [
        ("fast", "--point 'fast' is not valid; use NN (e.g. 03), METHOD-NN"),
        ("0²", "is not valid"),
        ("zeus-00", "names unknown method 'zeus'"),
        ("all", "'all' is not allowed here"),
        ("kareus-all", "'all' is not allowed here"),
        ("kareus-", "is not valid"),
        (True, "is not valid"),
    ],
)
def test_bad_points_are_one_line_naming_the_flag(text, needle):
    with pytest.raises(ConfigError) as e:
        parse_point(text, flag="--point")
    assert needle in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("--point")


def test_all_only_where_allowed(plan_dir):
    assert [p.run_name for p in select_frontier_points(plan_dir, "all", method="perseus", allow_all=True)] == [
        "perseus-00",
        "perseus-01",
    ]
    assert [p.run_name for p in select_frontier_points(plan_dir, "kareus-all", allow_all=True)] == [
        "kareus-00",
        "kareus-01",
        "kareus-02",
    ]
    assert parse_point("all", allow_all=True) == PointSpec(None, ALL)
    with pytest.raises(ConfigError, match="'all' is not allowed"):
        resolve_point(plan_dir, "all")


def test_selection_errors(plan_dir):
    with pytest.raises(ConfigError, match=r"--point 05: point 05 does not exist; kareus has points 00..02"):
        resolve_point(plan_dir, "05", flag="--point")
    with pytest.raises(
        PlanError, match=r"has no points for method 'nanobatch_perseus' \(has: megatron, perseus, kareus\)"
    ):
        resolve_point(plan_dir, "nanobatch_perseus-00")
    with pytest.raises(ConfigError, match="names method perseus but method kareus was asked for"):
        resolve_point(plan_dir, "perseus-00", method="kareus")
    p = resolve_point(plan_dir, "min-energy", method="perseus")
    assert (p.method, p.index, p.time_s, p.energy_j, p.run_name) == ("perseus", 1, 1.3, 15.0, "perseus-01")


def test_a_solve_directory_defaults_to_its_only_method(tmp_path):
    d = tmp_path / "s"  # what kareus solve writes: one method, solve
    save_plan(tiny_plan("solve", 1.0, 2.0), d / "plans/solve-00.json")
    save_plan(tiny_plan("solve", 1.5, 1.0), d / "plans/solve-01.json")
    write_json_atomic(
        d / "frontier.json",
        {
            "format": "kareus-frontier/1",
            "config": {},
            "reductions": {},
            "methods": {
                "solve": {
                    "points": [
                        {"time_s": 1.0, "energy_j": 2.0, "plan": "plans/solve-00.json"},
                        {"time_s": 1.5, "energy_j": 1.0, "plan": "plans/solve-01.json"},
                    ]
                }
            },
        },
    )
    assert resolve_point(d).run_name == "solve-00" and resolve_point(d, "min-energy").run_name == "solve-01"
    assert resolve_plan(str(d), "01")[1] == str(d / "plans/solve-01.json")


@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "does not exist; give a `kareus plan --out DIR` directory"),
        ("{oops", "is not valid JSON"),
        (
            '{"format": "kareus-frontier/0", "methods": {}}',
            "format is 'kareus-frontier/0', expected 'kareus-frontier/1'",
        ),
        ('{"format": "kareus-frontier/1", "methods": []}', "'methods' must be an object"),
        ('{"format": "kareus-frontier/1", "methods": {"kareus": {}}}', "method 'kareus' needs a 'points' list"),
        (
            '{"format": "kareus-frontier/1", "methods": {"kareus": {"points": [{"time_s": 1}]}}}',
            "point 00 of kareus needs finite time_s and energy_j",
        ),
    ],
)
def test_frontier_reader_names_the_problem(tmp_path, content, needle):
    if content is not None:
        (tmp_path / "frontier.json").write_text(content)
    with pytest.raises(PlanError) as e:
        read_frontier(tmp_path)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_plan_files_and_directories(plan_dir, tmp_path):
    f = plan_dir / "plans" / "perseus-00.json"
    assert resolve_plan(str(f))[1] == str(f) and kds._resolve_plan(f)[1] == str(f)
    with pytest.raises(ConfigError, match="--kareus-point 01 needs --kareus-plan to be a `kareus plan` directory"):
        resolve_plan(str(f), "01")
    with pytest.raises(ConfigError, match="method perseus needs plan to be a `kareus plan` directory"):
        kds._resolve_plan(f, method="perseus")
    with pytest.raises(PlanError, match="no such file or directory"):
        resolve_plan(str(tmp_path / "nope"))
