"""What is planned is what runs: the planner's per-instruction collective list replayed against the engine's trace.

For every instruction kind the planner writes (layouts TP, TP+SP, CP, TP x CP, TP x CP + SP, cross-layer with and
without SP; recompute none / full / selective; every forward/backward nanobatch pair, 1 and 2), replay_worker.py
runs one microbatch of a real plan through the overlap engine on megatron-core (gloo, 2 or 4 processes: one spawn
per world size) and traces it. search/collective_list.py gives, for the same instructions, the collectives the
planner costs: op, bytes, group ranks, and partner (the partition whose compute runs beside it, "tail", or
"exposed"). The two lists must be equal, element by element, in issue order (the recompute pass, which megatron runs
layer by layer beside each layer's backward, compared per layer). Outputs and every gradient must also equal the
standard model's, and every overlapped collective be issued at its planned launch slot.
"""

from __future__ import annotations

import pytest
from _dist import MEGATRON_CORE, read_ranks, spawn

LAYOUTS = {  # (world, tp) -> layouts run with those process groups
    (2, 2): ("tp", "sp", "cross", "cross_sp"),
    (2, 1): ("cp",),
    (4, 2): ("tpcp", "tpcpsp"),
}
TRAINED = {(2, 2): ("sp", "cross")}  # also trained through megatron's schedule and the runtime patch


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """The ranks' results per (world, tp), from one spawn per world size (its first use starts it): the 2-rank spawn
    runs the CP=2 layout, then rebuilds megatron's groups for the TP=2 ones (replay_worker.worker)."""
    import replay_worker

    done: dict[tuple[int, int], list[dict]] = {}

    def ranks_of(world: int, tp: int) -> list[dict]:
        if (world, tp) not in done:
            out = tmp_path_factory.mktemp(f"replay_{world}")
            runs = tuple((t, lay, TRAINED.get((w, t), ())) for (w, t), lay in sorted(LAYOUTS.items()) if w == world)
            spawn(replay_worker.worker, world, str(out), runs, preload=MEGATRON_CORE)
            done.update({(world, t): read_ranks(out, f"tp{t}.rank{{rank}}.json", world) for t, *_ in runs})
        return done[(world, tp)]

    return ranks_of


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=lambda k: f"world{k[0]}-tp{k[1]}")
def ranks(request, worlds):
    return worlds(*request.param)


def planned(name: str, recompute: str, pair: tuple[int, int], rank: int) -> list[tuple]:
    """The planner's collectives of the scenario's forward then backward instruction, as comparable tuples."""
    from replay_worker import layout_of, planner_layout, planner_model

    from kareus_megatron.search.collective_list import instruction_collectives

    lay = layout_of(name)
    par = planner_layout(name, recompute)
    out = []
    for kind, nb in zip(("forward", "backward"), pair):
        out += [
            c.key()
            for c in instruction_collectives(
                planner_model(), par, kind, nb, layers=lay["layers"], cross_layer=lay["cross_layer"], rank=rank
            )
        ]
    return _per_phase(out)


def traced(records: list[dict]) -> list[tuple]:
    """The engine's traced collectives as the planner's tuples (megatron layer numbers start at 1)."""
    return _per_phase(
        [(r["phase"], r["layer"] - 1, r["collective"], r["bytes"], tuple(r["ranks"]), r["partner"]) for r in records]
    )


def _per_phase(rows: list[tuple]) -> list[tuple]:
    """Forward and backward in issue order; the recompute pass grouped by layer (stable), where megatron's
    per-layer checkpoints interleave it with the backward."""
    order = {"forward": 0, "recompute": 1, "backward": 2}
    keyed = sorted(enumerate(rows), key=lambda ir: (order[ir[1][0]], ir[1][1] if ir[1][0] == "recompute" else 0, ir[0]))
    return [row for _, row in keyed]


def _scenarios(rk: dict) -> list[str]:
    return sorted(k for k in rk if k != "rank" and not k.startswith("train:"))


def test_engine_runs_the_planned_collectives_for_every_instruction_kind(ranks):
    from replay_worker import PAIRS, RECOMPUTES

    layouts = {k.split(".")[0] for k in _scenarios(ranks[0])}
    assert len(_scenarios(ranks[0])) == len(layouts) * len(RECOMPUTES) * len(PAIRS)
    for rk in ranks:
        for key in _scenarios(rk):
            name, recompute, pair_s = key.split(".")
            pair = (int(pair_s[1]), int(pair_s[3]))
            want, got = planned(name, recompute, pair, rk["rank"]), traced(rk[key]["collectives"])
            assert want, key  # every layout has collectives
            assert got == want, (key, rk["rank"], _first_difference(want, got))


def test_every_kind_runs_right(ranks):
    for rk in ranks:
        for key in _scenarios(rk):
            r = rk[key]
            assert r["out"] <= 1.0 and r["grads"] <= 1.0, (key, r["worst_grad"], r["out"], r["grads"])
            assert r["n_grads"] >= 8 and r["grad_norm"] > 0
            assert r["violations"] == [], (key, r["violations"])
            assert not r["carry_left"], key


def test_mixed_pairs_run_whole_collectives_where_planned(ranks):
    """The issue's case: a 1-nanobatch backward after a 2-nanobatch forward runs each collective once, whole (4 per
    SP layer, not 8 halves), exposed; a 1-nanobatch forward before a 2-nanobatch backward likewise."""
    for rk in ranks:
        for key in _scenarios(rk):
            name, recompute, pair_s = key.split(".")
            rows = rk[key]["collectives"]
            if pair_s == "f2b1" and recompute != "full":
                bwd = [r for r in rows if r["phase"] == "backward"]
                assert bwd and all(r["partner"] == "exposed" for r in bwd), key
                per_layer = len(bwd) // (3 if name.startswith("cross") else 2)
                assert (
                    per_layer == {"tp": 2, "cross": 2, "sp": 4, "cross_sp": 4, "cp": 1, "tpcp": 3, "tpcpsp": 5}[name]
                ), (key, per_layer)
            if pair_s == "f1b2":
                fwd = [r for r in rows if r["phase"] == "forward"]
                assert fwd and all(r["partner"] == "exposed" for r in fwd), key


def test_mixed_pairs_train_through_the_schedule_and_patch_as_planned(ranks):
    """A plan pairing (2, 1) and (1, 2) nanobatches, 2 iterations through megatron-core's schedule and the runtime
    patch: losses and gradients equal the standard model's, and each instruction ran the planner's collectives."""
    from replay_worker import RECOMPUTES

    trained = [k for k in ranks[0] if k.startswith("train:")]
    if not trained:
        pytest.skip("this spawn trains no layout")
    assert len(trained) == len(TRAINED[(2, 2)]) * len(RECOMPUTES)
    for rk in ranks:
        for key in trained:
            r = rk[key]
            name, recompute = key.removeprefix("train:").split(".")
            for a, b in zip(sum(r["losses_ref"], []), sum(r["losses_part"], [])):
                assert abs(a - b) <= 1e-5 * abs(a) + 1e-6, (key, r["losses_ref"], r["losses_part"])
            assert r["grads"] <= 1.0 and r["violations"] == [] and r["instructions_seen"] == 2 * len(r["order"])
            for index, (kind, _mb, nb) in enumerate(r["order"]):
                rows = [c for c in r["collectives"] if c["instr"] == index]
                want = _per_phase([c.key() for c in _planned_instruction(name, recompute, kind, nb, rk["rank"])])
                assert len(rows) == 2 * len(want)  # 2 iterations
                assert traced(rows[: len(want)]) == want and traced(rows[len(want) :]) == want, (key, index)


def _planned_instruction(name: str, recompute: str, kind: str, nb: int, rank: int) -> list:
    from replay_worker import layout_of, planner_layout, planner_model

    from kareus_megatron.search.collective_list import instruction_collectives

    lay = layout_of(name)
    return instruction_collectives(
        planner_model(),
        planner_layout(name, recompute),
        kind,
        nb,
        layers=lay["layers"],
        cross_layer=lay["cross_layer"],
        rank=rank,
    )


def _first_difference(want: list[tuple], got: list[tuple]) -> str:
    for k, (a, b) in enumerate(zip(want, got)):
        if a != b:
            return f"#{k}: planned {a}, ran {b}"
    return f"planned {len(want)} collectives, ran {len(got)}"
