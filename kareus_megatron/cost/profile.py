"""Measured pipeline-stage profiles in the Perseus CSV format: stage,instruction,frequency,time,energy.

One row = one GPU of pipeline stage ``stage`` running one ``instruction`` ("forward"/"backward", one
microbatch) with its SM clock locked at ``frequency`` (MHz): ``time`` (s) and ``energy`` (J). This is
the format of Zeus's pipeline frequency optimizer and of the Perseus artifact; ``kareus predict
--format csv`` writes it too.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kareus_megatron.errors import ProfileError
from kareus_megatron.files import read_input_text

COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
INSTRUCTIONS = ("forward", "backward")
MAX_STAGE = 100_000  # pipeline stages (a bound that keeps integers in numpy's int64)
MAX_FREQUENCY_MHZ = 100_000  # SM clock (MHz); real ones are below 3000


@dataclass(frozen=True, slots=True)
class StageProfile:
    """Validated profile rows as parallel arrays (one entry per row, file order)."""

    stage: np.ndarray  # int
    instruction: np.ndarray  # str: "forward" | "backward"
    frequency_mhz: np.ndarray  # int
    time_s: np.ndarray
    energy_j: np.ndarray
    source: str = ""

    def __len__(self) -> int:
        return len(self.stage)

    @property
    def power_w(self) -> np.ndarray:
        """Average power (W) of each row: energy / time."""
        return self.energy_j / self.time_s

    def series(self) -> list[tuple[int, str]]:
        """Distinct (stage, instruction) pairs, sorted."""
        return sorted({(int(s), str(i)) for s, i in zip(self.stage, self.instruction)})

    def select(self, stage: int, instruction: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(frequency_mhz descending, time_s, energy_j) of one series."""
        m = (self.stage == stage) & (self.instruction == instruction)
        order = np.argsort(-self.frequency_mhz[m], kind="stable")
        return self.frequency_mhz[m][order], self.time_s[m][order], self.energy_j[m][order]


def _number(value: str, column: str, line: int, where: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ProfileError(
            f"{where} line {line}: {column} = {value!r} is not a number; fix or remove the row."
        ) from None
    if math.isnan(x) or math.isinf(x):
        raise ProfileError(f"{where} line {line}: {column} is {value!r}; every {column} must be a finite number.")
    if x <= 0:
        raise ProfileError(f"{where} line {line}: {column} = {value!r} must be positive; fix or remove the row.")
    return x


def parse_perseus_profile(text: str, where: str = "profile") -> StageProfile:
    """Parse Perseus CSV text; ProfileError names the first bad column, row or value."""
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise ProfileError(
            f"{where} lacks column(s) {', '.join(missing)}; a Perseus profile has the header {','.join(COLUMNS)}."
        )
    reader.fieldnames = header
    rows: list[tuple[int, str, int, float, float]] = []
    seen: dict[tuple[int, str, int], int] = {}
    for line, row in enumerate(reader, start=2):
        if row.get(COLUMNS[0]) is None or any(row.get(c) in (None, "") for c in COLUMNS):
            empty = next(c for c in COLUMNS if row.get(c) in (None, ""))
            raise ProfileError(f"{where} line {line}: {empty} is empty; every row needs all of {','.join(COLUMNS)}.")
        try:
            stage_f = float(row["stage"].strip())
        except ValueError:
            stage_f = -1.0
        if not math.isfinite(stage_f) or not 0 <= stage_f <= MAX_STAGE or stage_f != int(stage_f):
            raise ProfileError(f"{where} line {line}: stage = {row['stage']!r} must be an integer in 0..{MAX_STAGE}.")
        instr = row["instruction"].strip()
        if instr not in INSTRUCTIONS:
            raise ProfileError(f"{where} line {line}: instruction = {instr!r}; allowed: forward, backward.")
        freq = _number(row["frequency"].strip(), "frequency", line, where)
        if freq != int(freq) or freq > MAX_FREQUENCY_MHZ:
            raise ProfileError(
                f"{where} line {line}: frequency = {row['frequency']!r} must be a whole number of "
                f"MHz up to {MAX_FREQUENCY_MHZ}."
            )
        t = _number(row["time"].strip(), "time", line, where)
        e = _number(row["energy"].strip(), "energy", line, where)
        key = (int(stage_f), instr, int(freq))
        if key in seen:
            raise ProfileError(
                f"{where} line {line}: duplicate of line {seen[key]} (stage {key[0]}, {instr}, {key[2]} MHz); "
                "keep one row per stage, instruction and frequency."
            )
        seen[key] = line
        rows.append((key[0], instr, key[2], t, e))
    if not rows:
        raise ProfileError(f"{where} has a header but no rows; profile at least one stage at one frequency.")
    st, ins, fr, ti, en = zip(*rows)
    return StageProfile(
        stage=np.array(st, dtype=int),
        instruction=np.array(ins),
        frequency_mhz=np.array(fr, dtype=int),
        time_s=np.array(ti, dtype=float),
        energy_j=np.array(en, dtype=float),
        source=where,
    )


def read_perseus_profile(path: str | Path) -> StageProfile:
    """Read and validate a Perseus-format CSV file; ProfileError on a missing or malformed file."""
    text = read_input_text(path, ProfileError, "profile", not_text_fix="give a CSV file")
    return parse_perseus_profile(text, where=str(Path(path)))


def format_perseus_csv(rows: list[tuple[int, str, int, float, float]]) -> str:
    """CSV text with exactly the Perseus columns from (stage, instruction, frequency, time, energy) rows."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for s, i, f, t, e in rows:
        w.writerow((int(s), i, int(f), repr(float(t)), repr(float(e))))
    return buf.getvalue()
