"""pagedkv doctor reports the optional extras: what each enables, what it needs (read from the package's metadata,
which comes from pyproject.toml) and whether it is installed here."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_doctor_json_reports_every_extra():
    run = subprocess.run([sys.executable, "-m", "pagedkv", "doctor", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    extras = json.loads(run.stdout)["extras"]
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert {"export", "serve", "text"} <= set(extras) and set(extras) == set(declared)
    for name, entry in extras.items():
        needs = [Requirement(r).name for r in declared[name]]
        assert entry["needs"] == needs, name
        missing = [d for d in needs if not _installed(d)]
        assert entry["installed"] == (not missing) and (entry["missing"] or []) == missing, (name, entry)
        assert entry["enables"] and (entry["install"] is None) == entry["installed"]
        if not entry["installed"]:
            assert entry["install"] == f"pip install 'pagedkv[{name}]'"
