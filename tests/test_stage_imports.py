"""DVC stage commands import this checkout's code, wherever the stage runs and whichever checkout is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tasks import data, settings


def test_a_variant_stage_command_imports_this_checkout(tmp_path: Path, monkeypatch) -> None:
    # a variant stage runs in variants/<id>/<profile>-<hash>/: stand in for it with a directory outside the project,
    # and for another checkout with a PYTHONPATH entry holding a `tasks` package of its own, which would win
    other = tmp_path / "elsewhere" / "tasks"
    other.mkdir(parents=True)
    (other / "__init__.py").touch()
    (other / "prepare_stage.py").touch()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "elsewhere"))
    probe = [sys.executable, "-c", "import tasks.prepare_stage as m; print(m.__file__)"]
    with data.project_on_pythonpath():
        imported = subprocess.run(probe, cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(imported).resolve() == (settings.root() / "tasks" / "prepare_stage.py").resolve()
    assert os.environ["PYTHONPATH"] == str(tmp_path / "elsewhere")  # restored after


def test_pythonpath_left_unset_when_it_was_unset(monkeypatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with data.project_on_pythonpath():
        assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(settings.root())
    assert "PYTHONPATH" not in os.environ
