"""scripts/setup.sh on a machine without what it needs: one line saying what is missing, before pip runs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).parents[1] / "scripts" / "setup.sh"


def _run(tmp_path: Path, python: str) -> subprocess.CompletedProcess:
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(SETUP, tmp_path / "scripts" / "setup.sh")
    return subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": python}, timeout=60)


def _fake_python(tmp_path: Path, version: str, venv_works: bool = True) -> str:
    """An interpreter stand-in answering the two questions setup.sh asks before making the venv."""
    major, minor = (int(x) for x in version.split("."))
    exe = tmp_path / "python-fake"
    exe.write_text(f"""#!/bin/sh
case "$*" in
  *"version_info < (3, 10)"*) [ {int((major, minor) < (3, 10))} = 0 ] ;;
  *print*) echo {version} ;;
  "-m venv"*) [ {int(venv_works)} = 1 ] && mkdir -p "$3/bin" ;;
esac
""")
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.parametrize("case", ["missing", "too_old", "no_venv"])
def test_python_problems_are_one_line(tmp_path: Path, case: str) -> None:
    if case == "missing":
        python = str(tmp_path / "no-such-python")
    else:
        python = _fake_python(tmp_path, "3.9" if case == "too_old" else "3.12", venv_works=case != "no_venv")
    r = _run(tmp_path, python)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("setup: ")
    assert {"missing": "not found: tkopt needs Python 3.10 or newer", "too_old": "is Python 3.9: tkopt needs 3.10",
            "no_venv": "cannot make a virtual environment: install its venv module"}[case] in r.stderr
    assert not (tmp_path / ".venv").exists()
