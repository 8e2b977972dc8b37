"""The suite's own process setup: every process it starts exits without the final collections over torch's objects
(tests/_site/sitecustomize.py, put on PYTHONPATH by tests/conftest.py) and writes the bytecode of what it imports,
and MASTER_PORTs come from below the
kernel's ephemeral range (tests/_dist.py free_port)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from _dist import free_port

HERE = Path(__file__).resolve().parent


def test_a_started_process_imports_the_suites_sitecustomize_and_writes_bytecode():
    """Both as tests/conftest.py sets them; the second because the Makefile compiles nothing ahead, where the machine
    sets PYTHONDONTWRITEBYTECODE (this one and CI)."""
    probe = "import sitecustomize, sys; print(sitecustomize.__file__, sys.dont_write_bytecode)"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    path, no_bytecode = r.stdout.split()
    assert Path(path) == HERE / "_site" / "sitecustomize.py"
    assert no_bytecode == "False"


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1 and all(1024 <= p < low for p in ports), ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", min(ports)))
