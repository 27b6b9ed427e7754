"""The Quick start of docs/plugins.md, run verbatim: each line of its bash block in a
folder that holds a clone's `.venv`, with no venv activated and no `pip` or `pyagent`
on PATH that belongs to it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.distributions import REPO, installed, pip_uninstall

DIST = "pyagent-fifo"


def quick_start_lines() -> list[str]:
    text = (REPO / "docs" / "plugins.md").read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


@pytest.fixture
def clean():
    if installed(DIST):
        pip_uninstall(DIST)
    yield
    if installed(DIST):
        pip_uninstall(DIST)


def test_the_quick_start_works_verbatim_without_an_activated_venv(tmp_path, clean):
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    venv_bin = str((REPO / ".venv" / "bin").resolve())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYAGENT_") and k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if Path(p).resolve() != Path(venv_bin))
    lines = quick_start_lines()
    assert [shlex.split(line)[0] for line in lines] == [".venv/bin/pyagent"] * 4 + [".venv/bin/python"]
    outputs = []
    for line in lines:
        result = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"$ {line}\n{result.stdout}\n{result.stderr}"
        outputs.append(result.stdout)
    new, install, check, listing, tests = outputs
    assert f"created {tmp_path.resolve() / DIST}" in new
    assert "fifo  [loaded]  pyagent-fifo 0.1.0" in install and "eviction_policy: fifo" in install
    assert "all is well" in check.splitlines()[-1]
    assert "fifo  from pyagent-fifo 0.1.0" in listing
    assert re.search(r"\b\d+ passed\b", tests.splitlines()[-1]) and "failed" not in tests.splitlines()[-1]
    assert installed(DIST) == [DIST]  # in .venv, the environment of .venv/bin/pyagent
