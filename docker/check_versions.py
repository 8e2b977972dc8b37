"""Build-time version guard of the kareus-megatron image (run by docker/Dockerfile, no GPU needed).

`pre TORCH_VERSION OUT`: fail unless the image's torch is a build of the pinned release (NGC names
its builds `2.13.0a0+<sha>.nvYY.MM`; the base version must equal TORCH_VERSION), then write OUT, a pip
constraint file pinning that exact torch so no later install can replace it.
`post CONSTRAINT MEGATRON_CORE_VERSION DEEPSPEED_VERSION`: after installing, fail unless torch is
still the constrained build and megatron-core / deepspeed / nvidia-ml-py / kareus-megatron are present
at the pinned versions.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def _torch_version() -> str:
    return version("torch")


def pre(torch_release: str, out: str) -> str | None:
    """Check the base image's torch against `torch_release`; write the constraint file."""
    from packaging.version import Version

    have = _torch_version()
    if Version(have).base_version != torch_release:
        return (
            f"base image torch {have} is not a build of torch {torch_release} (pyproject.toml's pin); "
            "choose an NGC_PYTORCH_TAG whose torch matches, or update pyproject.toml and the Dockerfile"
        )
    Path(out).write_text(f"torch=={have}\n")
    return None


def post(constraint: str, megatron_core: str, deepspeed: str) -> str | None:
    """Check that torch was not replaced and that the pinned packages are installed."""
    pinned = Path(constraint).read_text().strip().split("==", 1)[1]
    if _torch_version() != pinned:
        return f"torch was replaced: {_torch_version()} instead of the base image's {pinned}"
    want = {"megatron-core": megatron_core, "deepspeed": deepspeed}
    for name in (*want, "nvidia-ml-py", "kareus-megatron"):
        try:
            have = version(name)
        except PackageNotFoundError:
            return f"{name} is not installed"
        if name in want and have != want[name]:
            return f"{name} {have} installed, {want[name]} pinned"
    print(f"kareus-megatron image OK: torch {pinned}, megatron-core {megatron_core}, deepspeed {deepspeed}")
    return None


def main(argv: list[str]) -> int:
    """Dispatch `pre` / `post`; print one line and return 1 on failure."""
    if len(argv) == 3 and argv[0] == "pre":
        err = pre(argv[1], argv[2])
    elif len(argv) == 4 and argv[0] == "post":
        err = post(argv[1], argv[2], argv[3])
    else:
        err = "usage: check_versions.py pre TORCH_VERSION OUT | post CONSTRAINT MCORE_VERSION DS_VERSION"
    if err:
        print(f"check_versions: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
