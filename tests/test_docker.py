"""docker/: the versions the Dockerfile pins equal pyproject.toml's; torch is never reinstalled; the image
runs unprivileged; the build-time version guard and the privilege-dropping entrypoint work."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
CAP_SYS_ADMIN = 1 << 21


def setup_constants() -> dict[str, str]:
    """The test extra's pins in pyproject.toml, by role: TORCH, MEGATRON_CORE, DEEPSPEED, NVML."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["optional-dependencies"]["test"]
    names = {"TORCH": "torch", "MEGATRON_CORE": "megatron-core", "DEEPSPEED": "deepspeed", "NVML": "nvidia-ml-py"}
    out = {}
    for key, name in names.items():
        found = [r for r in reqs if re.match(rf"{re.escape(name)}\s*[=<>!~]", r)]
        assert len(found) == 1, f"pyproject.toml's test extra pins {name} {len(found)} times"
        out[key] = found[0]
    for extra, members in (
        ("megatron", ("TORCH", "MEGATRON_CORE")),
        ("deepspeed", ("TORCH", "DEEPSPEED")),
        ("nvml", ("NVML",)),
    ):
        for key in members:  # every extra pins what the tests run against
            assert out[key] in project["optional-dependencies"][extra], f"extra {extra} does not pin {out[key]}"
    return out


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    lines, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        if not buf and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        lines.append(buf + raw)
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    out = []
    for line in lines:
        word, _, rest = line.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_args() -> dict[str, str]:
    """ARG name -> default value (quotes removed)."""
    args = {}
    for ins, rest in dockerfile_instructions():
        if ins == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = shlex.split(value)[0] if value else ""
    return args


def pin(requirement: str, name: str) -> str:
    """The specifier part of `requirement` for package `name` (e.g. '==2.13.0')."""
    m = re.fullmatch(rf"{re.escape(name)}\s*([=<>!~].*)", requirement)
    assert m, f"{requirement!r} is not a pinned {name} requirement"
    return m.group(1)


def test_dockerfile_pins_match_pyproject():
    const, args = setup_constants(), dockerfile_args()
    assert pin(const["TORCH"], "torch") == f"=={args['TORCH_VERSION']}"
    assert pin(const["MEGATRON_CORE"], "megatron-core") == f"=={args['MEGATRON_CORE_VERSION']}"
    assert pin(const["DEEPSPEED"], "deepspeed") == f"=={args['DEEPSPEED_VERSION']}"
    assert pin(const["NVML"], "nvidia-ml-py") == args["NVML_SPEC"]
    # Megatron-LM source of the same release as the megatron-core wheel.
    assert args["MEGATRON_LM_TAG"] == "core_v" + args["MEGATRON_CORE_VERSION"]


def test_base_image_is_a_pinned_ngc_pytorch_tag():
    args = dockerfile_args()
    froms = [rest for ins, rest in dockerfile_instructions() if ins == "FROM"]
    assert froms == ["nvcr.io/nvidia/pytorch:${NGC_PYTORCH_TAG}"]
    assert re.fullmatch(r"\d{2}\.\d{2}-py3", args["NGC_PYTORCH_TAG"]), args["NGC_PYTORCH_TAG"]


def test_pip_never_installs_torch_and_always_uses_the_torch_constraint():
    runs = [rest for ins, rest in dockerfile_instructions() if ins == "RUN"]
    installs = [cmd for r in runs for cmd in r.split("&&") if "pip install" in cmd]
    assert len(installs) >= 2
    args = dockerfile_args()
    for cmd in installs:
        words = shlex.split(cmd)
        assert words[words.index("-c") + 1] == "/opt/kareus/torch-constraint.txt", cmd
        reqs = [w for w in words if not w.startswith("-") and w not in ("python", "-m", "pip", "install")]
        for r in reqs:
            assert not re.match(r"torch\b", r), f"torch is (re)installed by: {cmd}"
            assert "[" not in r, f"extras would pull pyproject.toml's torch pin: {cmd}"
    joined = " ".join(installs)
    for name in ("MEGATRON_CORE_VERSION", "DEEPSPEED_VERSION", "NVML_SPEC"):
        assert f"${{{name}}}" in joined, f"{name} is declared but not installed"
    assert args["TORCH_VERSION"] and 'check_versions.py pre "${TORCH_VERSION}"' in " ".join(runs)


def test_image_runs_unprivileged():
    ins = dockerfile_instructions()
    users = [rest for i, rest in ins if i == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    assert [rest for i, rest in ins if i == "ENTRYPOINT"] == ['["/usr/local/bin/kareus-entrypoint"]']
    assert subprocess.run(["bash", "-n", str(ENTRYPOINT)]).returncode == 0


def _check_versions():
    spec = importlib.util.spec_from_file_location("check_versions", ROOT / "docker" / "check_versions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_version_guard(tmp_path):
    """The guard the build runs: accepts this venv's torch 2.13.0 build, rejects another release."""
    cv, args = _check_versions(), dockerfile_args()
    out = tmp_path / "torch-constraint.txt"
    assert cv.pre(args["TORCH_VERSION"], str(out)) is None
    from importlib.metadata import version

    assert out.read_text() == f"torch=={version('torch')}\n"
    assert "not a build of torch 2.12.0" in cv.pre("2.12.0", str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    assert cv.post(str(out), args["MEGATRON_CORE_VERSION"], args["DEEPSPEED_VERSION"]) is None
    assert "deepspeed 0.19.8 installed, 0.18.0 pinned" in cv.post(str(out), args["MEGATRON_CORE_VERSION"], "0.18.0")
    (tmp_path / "other.txt").write_text("torch==2.13.0a0+abc.nv26.07\n")
    assert "torch was replaced" in cv.post(str(tmp_path / "other.txt"), "0.16.1", "0.19.8")


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("getent") is None,
    reason="dropping privileges needs root and setpriv",
)
def test_entrypoint_drops_root_but_keeps_only_cap_sys_admin():
    if subprocess.run(["getent", "group", "daemon"], capture_output=True).returncode:
        pytest.skip("no 'daemon' user/group to switch to")
    env = {**os.environ, "KAREUS_USER": "daemon"}
    out = subprocess.run(
        [str(ENTRYPOINT), "bash", "-c", "id -u; grep -E '^Cap(Eff|Amb):' /proc/self/status"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    uid, eff, amb = int(out[0]), int(out[2], 16), int(out[4], 16)
    assert uid != 0
    with open("/proc/self/status") as f:
        have_sys_admin = any(line.startswith("CapEff:") and int(line.split()[1], 16) & CAP_SYS_ADMIN for line in f)
    expected = CAP_SYS_ADMIN if have_sys_admin else 0
    assert eff == expected and amb == expected


def test_launch_dir_in_the_image_is_where_the_slurm_launcher_looks():
    from kareus_megatron.jobs.commands import JobSpec

    env = " ".join(rest for ins, rest in dockerfile_instructions() if ins == "ENV")
    assert f"KAREUS_LAUNCH_DIR={JobSpec().container_launch_dir} " in env + " "
    assert "MEGATRON_LM_DIR=/opt/Megatron-LM" in env  # what launch/pretrain_gpt.py reads
