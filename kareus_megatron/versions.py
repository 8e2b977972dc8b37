"""The framework releases the runtime supports: the one version gate, as data.

A *series* is ``MAJOR.MINOR`` (``0.16``); every release of a supported series is accepted, and CI runs
the release named in ``tested``. Where a series ships a native Megatron-LM patch, ``megatron_lm_tag`` is
the Megatron-LM tag its patch file (``patches/megatron-lm/<tag>/``) applies to with strict ``git apply``.
`kareus env`, the runtime patches and the docs read this table; nothing else spells a version.

Sources of the tested releases: PyPI (megatron-core 0.15.3 and 0.16.1, deepspeed 0.18.9 and 0.19.8) and
unmodified ``git archive`` snapshots of NVIDIA/Megatron-LM at ``core_v0.16.1`` and ``core_v0.19.0``
(whose ``megatron/core/package_info.py`` says 0.19.1), listed in ``../shared/vendor/README.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

Package = Literal["megatron-core", "deepspeed"]


@dataclass(frozen=True)
class SupportedSeries:
    """One supported release series of a framework and how CI exercises it."""

    package: Package
    series: str  # MAJOR.MINOR
    tested: str  # the exact release the tests run
    source: str  # where the tests get it
    megatron_lm_tag: str | None = None  # Megatron-LM tag of the shipped native patch, if any


SUPPORTED: Final[tuple[SupportedSeries, ...]] = (
    SupportedSeries("megatron-core", "0.15", "0.15.3", "PyPI (megatron-core==0.15.3)"),
    SupportedSeries(
        "megatron-core",
        "0.16",
        "0.16.1",
        "PyPI (megatron-core==0.16.1); Megatron-LM core_v0.16.1",
        megatron_lm_tag="core_v0.16.1",
    ),
    SupportedSeries(
        "megatron-core",
        "0.19",
        "0.19.1",
        "Megatron-LM core_v0.19.0 snapshot (no PyPI release here)",
        megatron_lm_tag="core_v0.19.0",
    ),
    SupportedSeries("deepspeed", "0.18", "0.18.9", "PyPI (deepspeed==0.18.9)"),
    SupportedSeries("deepspeed", "0.19", "0.19.8", "PyPI (deepspeed==0.19.8)"),
)


def series_of(version: str) -> str:
    """``MAJOR.MINOR`` of a version string (``0.16.1rc0`` -> ``0.16``)."""
    parts = version.strip().split(".")
    return ".".join(parts[:2])


def supported_series(package: Package) -> tuple[SupportedSeries, ...]:
    """The supported series of `package`, oldest first."""
    return tuple(s for s in SUPPORTED if s.package == package)


def find_series(package: Package, version: str) -> SupportedSeries | None:
    """The supported series `version` of `package` belongs to, or None."""
    want = series_of(version)
    return next((s for s in supported_series(package) if s.series == want), None)


def is_supported(package: Package, version: str) -> bool:
    """Whether `version` of `package` is in a supported series."""
    return find_series(package, version) is not None


def supported_text(package: Package) -> str:
    """The supported series of `package` for a message: ``0.15.x, 0.16.x, 0.19.x``."""
    return ", ".join(f"{s.series}.x" for s in supported_series(package))


def unsupported_message(package: Package, version: str, what: str) -> str:
    """One line: `version` of `package` is not supported by `what`, and which are."""
    newest = supported_series(package)[-1]
    return (
        f"{package} {version} is not supported by {what}; supported: {supported_text(package)} "
        f"(tested: {', '.join(s.tested for s in supported_series(package))}). "
        f"Install {package}=={newest.tested} or a release of a supported series"
    )
