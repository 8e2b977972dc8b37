"""Model predictions for the published evaluation's configurations, every method.

The ten configurations of the Kareus evaluation (2 nodes × 8 A100-SXM4-40GB, PP=2 with 15 + 13 layers,
8 microbatches, DP=1, bf16, full recompute, no sequence parallelism) and the larger Llama 3.3 70B case
(TP=8, 2 stages of 40 layers, 8 microbatches). For each: every method's fastest plan (iteration time s,
GPU energy of all 16 GPUs per iteration kJ) and the four reductions of plan/frontier.py (Perseus's
frontier as the reference). These are PREDICTIONS of the uncalibrated model (presets only), not
measurements; the published measured figures are "up to 28.3% less energy at the same time, up to
27.5% less time at the same energy" (against the better baseline; docs/sources.md#kareus-evaluation).

Variants (``--variants``): ``published`` (as evaluated: no sequence parallelism, CP where the paper has
it), ``sp`` (sequence parallelism on every TP layout: its all-gather/reduce-scatter partitions, 2
nanobatches), ``cross`` (cross-layer overlap inside each stage's layer stack, ``kareus plan
--cross-layer``; the runtime runs it with and without SP, not with CP) and ``sp+cross``. With more than one
variant a last table gives each variant's reductions next to the published layout's.

Run: .venv/bin/python benchmarks/paper_configs.py [--markdown] [--only 1,5,70b] [--calibration F]
     [--variants published,sp,cross,sp+cross | all]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

from kareus_megatron.cli.workload_args import add_workload_arguments, workload_from_args
from kareus_megatron.cost import KernelModel, load_calibration
from kareus_megatron.plan.frontier import reductions
from kareus_megatron.search.planner import plan_methods
from kareus_megatron.vocab import KAREUS, METHODS, NANOBATCH_PERSEUS, POWERCAP

GPU = "a100-sxm4-40gb"


@dataclass(frozen=True)
class PaperConfig:
    """One evaluation configuration (docs/sources.md#kareus-evaluation); `tag` is its number in the table."""

    tag: str
    model: str
    tp: int
    cp: int
    mbs: int
    seq: int
    first_last: tuple[int, int] = (15, 13)
    sp: bool = False  # sequence parallelism (variants only: the published runs have none)
    cross_layer: bool = False  # plan with cross-layer overlap (variants only)

    @property
    def layout(self) -> str:
        """Parallelism as the paper writes it."""
        return (f"TP={self.tp}" if self.cp == 1 else f"CP={self.cp}, TP={self.tp}") + ("+SP" if self.sp else "")

    @property
    def variant(self) -> str:
        """Name of this variant (VARIANTS)."""
        return next(k for k, v in VARIANTS.items() if v == (self.sp, self.cross_layer))

    def argv(self) -> list[str]:
        """`kareus plan` workload flags of this configuration."""
        first, last = self.first_last
        return [
            "--gpu",
            GPU,
            "--model",
            self.model,
            "--tp",
            str(self.tp),
            "--cp",
            str(self.cp),
            "--pp",
            "2",
            "--mbs",
            str(self.mbs),
            "--seq",
            str(self.seq),
            "--microbatches",
            "8",
            "--recompute",
            "full",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--first-stage-layers",
            str(first),
            "--last-stage-layers",
            str(last),
            *(["--sp"] if self.sp else []),
        ]


CONFIGS: tuple[PaperConfig, ...] = (
    PaperConfig("1", "llama3.2-3b", 8, 1, 8, 4096),
    PaperConfig("2", "llama3.2-3b", 4, 2, 8, 4096),
    PaperConfig("3", "llama3.2-3b", 4, 2, 8, 8192),
    PaperConfig("4", "llama3.2-3b", 4, 2, 16, 4096),
    PaperConfig("5", "qwen3-1.7b", 8, 1, 8, 4096),
    PaperConfig("6", "qwen3-1.7b", 8, 1, 8, 8192),
    PaperConfig("7", "qwen3-1.7b", 8, 1, 16, 4096),
    PaperConfig("8", "qwen3-1.7b", 4, 2, 8, 4096),
    PaperConfig("9", "qwen3-1.7b", 4, 2, 8, 8192),
    PaperConfig("10", "qwen3-1.7b", 4, 2, 16, 4096),
    PaperConfig("70b", "llama3.3-70b", 8, 1, 8, 4096, first_last=(40, 40)),
)
VARIANTS: dict[str, tuple[bool, bool]] = {  # name -> (sequence parallelism, cross-layer overlap)
    "published": (False, False),
    "sp": (True, False),
    "cross": (False, True),
    "sp+cross": (True, True),
}
LABEL = {
    "megatron": "Megatron",
    "perseus": "Perseus",
    "nanobatch_perseus": "NB+Perseus",
    "kareus": "Kareus",
    "powercap": "Power cap",
}


def workload(cfg: PaperConfig, calibration: str | None = None):
    """(gpu, model, parallel config, kernel model) of a configuration."""
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    args = parser.parse_args(cfg.argv() + (["--calibration", calibration] if calibration else []))
    gpu, model, par = workload_from_args(args)
    cal = load_calibration(calibration) if calibration else None
    return gpu, model, par, KernelModel(gpu, cal)


def evaluate(cfg: PaperConfig, calibration: str | None = None) -> dict:
    """Each method's fastest (time s, energy J) and its reductions, from the methods' whole frontiers."""
    gpu, model, par, kernel = workload(cfg, calibration)
    t0 = time.perf_counter()
    result = plan_methods(gpu, model, par, kernel, methods=METHODS, points=2, cross_layer=cfg.cross_layer)
    frontiers = {m: list(zip(mf.time_s.tolist(), mf.energy_j.tolist())) for m, mf in result.methods.items()}
    red = reductions(frontiers)
    kareus = result.methods["kareus"]
    dominated = all(
        ((kareus.time_s <= t * (1 + 1e-9)) & (kareus.energy_j <= e * (1 + 1e-9))).any()
        for base in ("perseus", "nanobatch_perseus")
        for t, e in frontiers[base]
    )
    return {
        "fastest": {m: f[0] for m, f in frontiers.items()},
        "reductions": red,
        "kareus_dominates": dominated,
        "seconds": time.perf_counter() - t0,
    }


def pct(x: float | None) -> str:
    """A reduction fraction as a percentage, 'n/a' where the method has no point within the reference."""
    return "n/a" if x is None else f"{100 * x + 0.0:.1f}".replace("-0.0", "0.0")


def tables(rows: list[tuple[PaperConfig, dict]], markdown: bool, dominance: bool = True) -> str:
    """The fastest-plan table and the reductions table (markdown or aligned text).

    With `dominance`, a last column says whether Kareus's frontier dominates both Perseus baselines.
    """
    head_a = ["#", "model", "parallelism", "MBS", "seq"] + [f"{LABEL[m]} s / kJ" for m in METHODS]
    body_a = [
        [_tag(c), c.model, c.layout, str(c.mbs), str(c.seq)]
        + [f"{r['fastest'][m][0]:.3f} / {r['fastest'][m][1] / 1e3:.1f}" for m in METHODS]
        for c, r in rows
    ]
    iso = (POWERCAP, NANOBATCH_PERSEUS, KAREUS)  # the power cap's fastest point is Megatron's: iso columns only
    fast = tuple(m for m in METHODS[1:] if m != POWERCAP)
    head_b = [
        "#",
        "iso-time energy % (PC · NB+P · Kareus)",
        "iso-energy time % (PC · NB+P · Kareus)",
        "time vs Megatron % (P · NB+P · K)",
        "energy vs Megatron % (P · NB+P · K)",
    ]
    head_b += ["K dominates"] if dominance else []
    body_b = []
    for c, r in rows:
        red = r["reductions"]
        body_b.append(
            [
                _tag(c),
                " · ".join(pct(red[m]["iso_time_energy"]) for m in iso),
                " · ".join(pct(red[m]["iso_energy_time"]) for m in iso),
                " · ".join(pct(red[m]["max_throughput_time_vs_megatron"]) for m in fast),
                " · ".join(pct(red[m]["max_throughput_energy_vs_megatron"]) for m in fast),
            ]
            + (["yes" if r["kareus_dominates"] else "NO"] if dominance else [])
        )
    return _render(head_a, body_a, markdown) + "\n\n" + _render(head_b, body_b, markdown)


def _tag(c: PaperConfig) -> str:
    return c.tag if c.variant == "published" else f"{c.tag} {c.variant}"


def variant_table(rows: list[tuple[PaperConfig, dict]], markdown: bool) -> str:
    """Each variant's NB+Perseus and Kareus reductions, with the change from the published layout (points)."""
    base = {c.tag: r["reductions"] for c, r in rows if c.variant == "published"}
    keys = (
        ("iso_time_energy", "iso-time energy"),
        ("iso_energy_time", "iso-energy time"),
        ("max_throughput_time_vs_megatron", "time vs Megatron"),
    )
    head = ["#", "variant", "parallelism", "K fastest s / kJ"] + [f"{label} % (NB+P · K)" for _, label in keys]
    head += [f"K {label} Δ pt" for _, label in keys]
    body = []
    for c, r in rows:
        red, ref = r["reductions"], base.get(c.tag)
        t, e = r["fastest"][KAREUS]
        row = [c.tag, c.variant, c.layout, f"{t:.3f} / {e / 1e3:.1f}"]
        row += [" · ".join(pct(red[m][k]) for m in (NANOBATCH_PERSEUS, KAREUS)) for k, _ in keys]
        for k, _ in keys:
            now, was = red[KAREUS][k], None if ref is None else ref[KAREUS][k]
            row.append("—" if c.variant == "published" or now is None or was is None else f"{100 * (now - was):+.1f}")
        body.append(row)
    return _render(head, body, markdown)


def _render(head: list[str], body: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in body])


def main() -> None:
    """Plan every configuration and print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print markdown tables (for docs/benchmarks.md)")
    ap.add_argument("--only", default=None, help="comma-separated configuration tags (1..10, 70b)")
    ap.add_argument("--calibration", default=None, help="calibration JSON (default: GPU preset only)")
    ap.add_argument(
        "--variants",
        default="published",
        help=f"comma-separated variants ({', '.join(VARIANTS)}) or 'all' (default: published)",
    )
    args = ap.parse_args()
    want = set(args.only.split(",")) if args.only else None
    variants = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    if bad := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variant(s) {', '.join(bad)}; known: {', '.join(VARIANTS)}, all")
    rows = []
    t0 = time.perf_counter()
    for base in CONFIGS:
        if want is not None and base.tag not in want:
            continue
        for v in variants:
            cfg = replace(base, sp=VARIANTS[v][0], cross_layer=VARIANTS[v][1])
            r = evaluate(cfg, args.calibration)
            print(
                f"  planned #{cfg.tag} {v} {cfg.model} {cfg.layout} MBS {cfg.mbs} seq {cfg.seq}: {r['seconds']:.1f} s",
                flush=True,
            )
            rows.append((cfg, r))
    cal = f"calibration {args.calibration}" if args.calibration else "GPU preset, uncalibrated"
    print(
        f"\nMODEL PREDICTIONS ({GPU}, 2 nodes × 8 GPUs, {cal}); energy = all 16 GPUs per iteration; "
        f"reductions use Perseus's frontier as the reference (+ = better).\n"
    )
    print(tables(rows, args.markdown))
    if len(variants) > 1:
        print(
            "\nVariants: reductions (%) of NB+Perseus and Kareus, and Kareus's change from the published layout "
            "(percentage points; + = better).\n"
        )
        print(variant_table(rows, args.markdown))
    print(f"\n{len(rows)} configurations planned in {time.perf_counter() - t0:.1f} s (shared CPU; timings are noisy)")


if __name__ == "__main__":
    main()
