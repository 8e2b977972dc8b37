"""Points of a plan directory: the one reader of ``frontier.json`` and the one point syntax.

Terms: a *plan directory* is what ``kareus plan --out DIR`` (or ``kareus solve --out DIR``) writes:
DIR/frontier.json (format ``kareus-frontier/1``) and DIR/plans/NAME-NN.json. Each method's points are
sorted fastest first, so point 00 is the fastest. A *point* names plans of one method's frontier:

- ``NN`` (e.g. ``03``): the NN-th point; ``fastest``, ``min-energy``: the fastest / lowest-energy point;
- ``iso-time`` (DEFAULT_POINT): the lowest-energy point no slower than Megatron's max-clock plan (the
  ``megatron`` point of the same frontier; a frontier without one, e.g. ``kareus solve``'s: the method's
  fastest point) -- Megatron's speed at the least energy, the ``--kareus-plan auto`` default objective
  (plan/objective.py) and the plan ``kareus plan`` suggests;
- ``METHOD-NN``, ``METHOD-fastest``, ``METHOD-min-energy``, ``METHOD-iso-time`` (e.g. ``perseus-03``): the
  same, of METHOD;
- ``all``, ``METHOD-all``: every point, fastest first (only where a caller runs several plans: the launcher).

*Robust* (``--kareus-robust``, ``kareus launch --robust``, ``install(..., robust=True)``): ``iso-time`` and
``min-energy`` are met across the prediction bands (95th percentiles), not at the point estimate, by the same
choice as ``kareus plan --robust`` (plan/objective.py ``frontier_choice``); with any other point, with a plan
file, or with a frontier without bands, it is refused in one line.

A point without a method refers to the caller's method (``--method``, ``install(method=...)``), else
``vocab.DEFAULT_METHOD``, else the only method of a frontier that has one (a ``kareus solve`` directory).
The runtime entry points (``--kareus-point``), ``kareus_megatron.deepspeed``, ``kareus launch`` and
``kareus compare`` all read plan directories through this module. Errors are KareusErrors of one line
that name the flag (``flag``) the point came from.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus_megatron.errors import ConfigError, PlanError
from kareus_megatron.files import read_input_text
from kareus_megatron.plan.io import load_plan
from kareus_megatron.plan.objective import FrontierPoint, Objective, frontier_choice
from kareus_megatron.plan.schema import FRONTIER_FORMAT, Plan
from kareus_megatron.vocab import DEFAULT_METHOD, MEGATRON, PLAN_METHODS

FRONTIER_FILE = "frontier.json"
FASTEST, MIN_ENERGY, ALL, ISO_TIME = "fastest", "min-energy", "all", "iso-time"
_WORDS = (FASTEST, MIN_ENERGY, ALL, ISO_TIME)
DEFAULT_POINT = ISO_TIME  # the one default of --kareus-point, kareus launch run, kareus plan's suggestion


def plan_relpath(method: str, index: int) -> str:
    """Path of plan NN of `method` inside a plan directory: plans/NAME-NN.json."""
    return f"plans/{method}-{index:02d}.json"


@dataclass(frozen=True, slots=True)
class PointSpec:
    """A parsed point: the method it names (None: the caller's) and which of its points."""

    method: str | None
    which: str | int  # FASTEST, MIN_ENERGY, ALL or an index


def _syntax(allow_all: bool) -> str:
    return (
        "NN (e.g. 03), METHOD-NN (e.g. perseus-03), iso-time, fastest, min-energy, METHOD-iso-time, "
        "METHOD-fastest, METHOD-min-energy" + (", all or METHOD-all" if allow_all else "")
    )


def parse_point(text: str | int, *, allow_all: bool = False, flag: str = "point") -> PointSpec:
    """Parse a point (see the module doc); ConfigError naming `flag` and the value when it is not one."""
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return PointSpec(None, text)
    if not isinstance(text, str):
        raise ConfigError(f"{flag} {text!r} is not valid; use {_syntax(allow_all)}")
    method, which = None, text
    for word in _WORDS:
        if text.endswith("-" + word):
            method, which = text[: -len(word) - 1], word
            break
    else:
        head, sep, tail = text.rpartition("-")
        if sep and tail.isascii() and tail.isdigit():
            method, which = head, tail
    if which not in _WORDS and not (which.isascii() and which.isdigit()):  # not '²', which isdigit() too
        raise ConfigError(f"{flag} {text!r} is not valid; use {_syntax(allow_all)}")
    if method is not None and method not in PLAN_METHODS:
        raise ConfigError(f"{flag} {text!r} names unknown method {method!r}; methods: {', '.join(PLAN_METHODS)}")
    if which == ALL and not allow_all:
        raise ConfigError(f"{flag} {text!r}: 'all' is not allowed here (one plan runs); use {_syntax(False)}")
    return PointSpec(method, which if which in _WORDS else int(which))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def read_frontier(plan_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check DIR/frontier.json (kareus-frontier/1); PlanError naming what is wrong."""
    path = Path(plan_dir) / FRONTIER_FILE
    if not path.exists():
        raise PlanError(f"{path} does not exist; give a `kareus plan --out DIR` directory")
    text = read_input_text(path, PlanError, "frontier file", not_text_fix="regenerate it with kareus plan")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(doc, dict) or doc.get("format") != FRONTIER_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise PlanError(f"{path}: format is {got!r}, expected {FRONTIER_FORMAT!r}; regenerate it with kareus plan")
    methods = doc.get("methods")
    if not isinstance(methods, dict):
        raise PlanError(f"{path}: 'methods' must be an object of method name -> {{points: [...]}}")
    for name, entry in methods.items():
        pts = entry.get("points") if isinstance(entry, dict) else None
        if not isinstance(pts, list):
            raise PlanError(f"{path}: method {name!r} needs a 'points' list")
        for i, p in enumerate(pts):
            if not (
                isinstance(p, dict)
                and _number(p.get("time_s"))
                and _number(p.get("energy_j"))
                and isinstance(p.get("plan", ""), str)
            ):
                raise PlanError(
                    f"{path}: point {i:02d} of {name} needs finite time_s and energy_j >= 0 "
                    "(and 'plan' a path, when given)"
                )
            for key in ("time_s_band", "energy_j_band"):
                b = p.get(key)
                if b is not None and not (
                    isinstance(b, list) and len(b) == 2 and all(_number(x) for x in b) and b[0] <= b[1]
                ):
                    raise PlanError(
                        f"{path}: point {i:02d} of {name}: {key} must be [low, high], finite, "
                        "0 <= low <= high; regenerate it with kareus plan"
                    )
    return doc


def _band(point: dict[str, Any], key: str) -> tuple[float, float] | None:
    b = point.get(key)
    return None if b is None else (float(b[0]), float(b[1]))


def frontier_point(method: str, index: int, plan_dir: str | os.PathLike[str], point: dict[str, Any]) -> FrontierPoint:
    """The FrontierPoint of `point`, entry `index` of `method` in DIR/frontier.json (bands where it has them)."""
    return FrontierPoint(
        method=method,
        index=index,
        plan_path=Path(plan_dir) / (point.get("plan") or plan_relpath(method, index)),
        time_s=float(point["time_s"]),
        energy_j=float(point["energy_j"]),
        time_s_band=_band(point, "time_s_band"),
        energy_j_band=_band(point, "energy_j_band"),
    )


def reference_points(doc: dict[str, Any], plan_dir: str | os.PathLike[str]) -> list[FrontierPoint]:
    """Iso-time's reference: the frontier's megatron (max-clock) points; none: [] (the method's own fastest)."""
    pts = (doc["methods"].get(MEGATRON) or {}).get("points") or []
    return [frontier_point(MEGATRON, i, plan_dir, p) for i, p in enumerate(pts)]


def _method_of(spec: PointSpec, method: str | None, doc: dict[str, Any], text: str, flag: str) -> str:
    if spec.method and method and spec.method != method:
        raise ConfigError(
            f"{flag} {text} names method {spec.method} but method {method} was asked for; drop one of them"
        )
    if spec.method or method:
        return spec.method or method  # type: ignore[return-value]
    have = [m for m, e in doc["methods"].items() if e["points"]]
    return have[0] if DEFAULT_METHOD not in have and len(have) == 1 else DEFAULT_METHOD


def select_frontier_points(
    plan_dir: str | os.PathLike[str],
    point: str | int | None = None,
    *,
    method: str | None = None,
    allow_all: bool = False,
    flag: str = "point",
    robust: bool = False,
    robust_flag: str = "robust",
) -> list[FrontierPoint]:
    """The points of DIR's frontier that `point` (default DEFAULT_POINT) selects; 'all' gives every one, fastest
    first. `robust` (named `robust_flag` in errors): iso-time and min-energy are met across the prediction bands
    (plan/objective.py frontier_choice); other points are refused with it, as a frontier without bands is."""
    text = DEFAULT_POINT if point is None else point
    spec = parse_point(text, allow_all=allow_all, flag=flag)
    if robust and spec.which not in (ISO_TIME, MIN_ENERGY):
        raise ConfigError(
            f"{robust_flag} picks iso-time or min-energy across the prediction bands, but {flag} {text} "
            f"names {'every point' if spec.which == ALL else 'one point'}; drop {robust_flag} or choose one of those"
        )
    if method is not None and method not in PLAN_METHODS:
        raise ConfigError(f"unknown method {method!r}; use one of {', '.join(PLAN_METHODS)}")
    doc = read_frontier(plan_dir)
    frontier = Path(plan_dir) / FRONTIER_FILE
    name = _method_of(spec, method, doc, str(text), flag)
    entry = doc["methods"].get(name)
    pts = entry["points"] if entry else []
    if not pts:
        have = ", ".join(m for m, e in doc["methods"].items() if e["points"]) or "none"
        raise PlanError(f"{flag} {text}: {frontier} has no points for method {name!r} (has: {have})")
    points = [frontier_point(name, i, plan_dir, p) for i, p in enumerate(pts)]
    if spec.which == ALL:
        return points
    if spec.which == FASTEST:
        return [min(points, key=lambda p: (p.time_s, p.energy_j))]
    if spec.which in (ISO_TIME, MIN_ENERGY):
        choice = frontier_choice(
            points,
            Objective(str(spec.which)),
            reference=reference_points(doc, plan_dir),
            robust=robust,
            fastest_if_none=True,
            flag=robust_flag,
        )
        return [choice]
    if isinstance(spec.which, int) and spec.which < len(pts):
        return [points[spec.which]]
    raise ConfigError(
        f"{flag} {text}: point {spec.which:02d} does not exist; {name} has points 00..{len(pts) - 1:02d} in {frontier}"
    )


def resolve_point(
    plan_dir: str | os.PathLike[str],
    point: str | int | None = None,
    *,
    method: str | None = None,
    flag: str = "point",
    robust: bool = False,
    robust_flag: str = "robust",
) -> FrontierPoint:
    """The one point of DIR's frontier that `point` (default DEFAULT_POINT) names; 'all' is refused."""
    return select_frontier_points(plan_dir, point, method=method, flag=flag, robust=robust, robust_flag=robust_flag)[0]


def load_point_plan(
    path: str | os.PathLike[str],
    point: str | int | None = None,
    *,
    method: str | None = None,
    flag: str = "point",
    path_flag: str = "plan",
    robust: bool = False,
    robust_flag: str = "robust",
) -> tuple[Plan, str]:
    """Load a plan file, or the plan that `point` names in a plan directory (with `robust`, met across the
    prediction bands: select_frontier_points); return it and its file path."""
    p = Path(path)
    if p.is_file():
        if robust:
            raise ConfigError(
                f"{robust_flag} chooses among a frontier's points, but {path_flag} {p} is one plan file; "
                f"pass the kareus plan directory or drop {robust_flag}"
            )
        if point is not None or method is not None:
            what = f"{flag} {point}" if point is not None else f"method {method}"
            raise ConfigError(
                f"{what} needs {path_flag} to be a `kareus plan` directory, but {p} is a file; "
                f"drop {flag} or pass the directory"
            )
        return load_plan(p), str(p)
    if not p.is_dir():
        raise PlanError(
            f"{path_flag} {p}: no such file or directory; pass a plan file or a kareus plan output directory"
        )
    if not (p / FRONTIER_FILE).is_file():
        raise PlanError(
            f"{path_flag} {p} is a directory without {FRONTIER_FILE}; pass a plan file or the "
            "--out directory of kareus plan"
        )
    chosen = resolve_point(p, point, method=method, flag=flag, robust=robust, robust_flag=robust_flag)
    return load_plan(chosen.plan_path), str(chosen.plan_path)
