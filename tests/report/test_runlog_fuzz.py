"""Any bytes in a run log's rank files give a RunLog or one KareusError, never another exception (hypothesis).

The rank files are written by a training job that may be killed mid-line, edited by hand or mixed up with
other files; `kareus report` and `kareus compare` must still answer with one line.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kareus_megatron.errors import KareusError
from kareus_megatron.report.per_gpu import per_gpu
from kareus_megatron.report.runlog import read_run_log
from kareus_megatron.report.summary import summarize

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**12), st.floats(allow_nan=True), st.text(max_size=8))
_values = st.recursive(
    _scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6
)
_keys = st.sampled_from(
    [
        "kind",
        "iteration",
        "time_s",
        "energy_j",
        "t_start",
        "t_end",
        "rank",
        "world",
        "pp",
        "pp_rank",
        "format",
        "backend",
        "stages",
        "ranks",
        "gpu_index",
        "gpu_uuid",
        "local_rank",
    ]
)
_records = st.one_of(
    st.fixed_dictionaries(
        {"kind": st.sampled_from(["header", "iteration", "other"])},
        optional={
            k: _values
            for k in (
                "iteration",
                "time_s",
                "energy_j",
                "rank",
                "world",
                "pp",
                "pp_rank",
                "backend",
                "gpu_index",
                "gpu_uuid",
                "gpu_name",
                "local_rank",
            )
        },
    ),
    st.dictionaries(_keys, _values, max_size=5),
)
_lines = st.one_of(
    _records.map(lambda r: json.dumps(r).encode()), st.binary(max_size=40), st.text(max_size=40).map(str.encode)
)
_files = st.lists(st.lists(_lines, max_size=6), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=_files, cut=st.booleans())
def test_any_rank_files_read_or_fail_with_one_kareus_error(tmp_path: Path, files: list[list[bytes]], cut: bool) -> None:
    d = tmp_path / "run"
    d.mkdir(exist_ok=True)
    for old in d.iterdir():
        old.unlink()
    for rank, lines in enumerate(files):
        data = b"\n".join(lines) + (b"" if cut else b"\n")
        (d / f"rank-{rank:05d}.jsonl").write_bytes(data)
    try:
        log = read_run_log(d)
        per_gpu(summarize(log, 0), {0: 1.0}, 2)
    except KareusError as e:
        assert str(e) and "\n" not in str(e).strip()
