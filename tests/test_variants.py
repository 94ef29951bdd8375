"""The kernel variants queued in benchmarks/variants/ (patches waiting for their A/B on a GPU) must stay applicable:
each applies to the tree exactly (``git apply --check``: no fuzz, no offsets guessed), and the README's tables name
every one of them and nothing else. A commit that changes what a variant patches has to rebase or drop it."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = ROOT / "benchmarks" / "variants"
PATCHES = sorted(VARIANTS.glob("*.diff"))


def _in_git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-inside-work-tree"], capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip() == "true"


@pytest.mark.skipif(not _in_git_checkout(), reason="needs git and the repository's checkout to check the patches")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_variant_applies_to_the_tree(patch):
    r = subprocess.run(["git", "-C", str(ROOT), "apply", "--check", str(patch)], capture_output=True, text=True)
    assert r.returncode == 0, f"{patch.name} no longer applies: {r.stderr.strip()}"


def test_readme_names_every_variant():
    readme = (VARIANTS / "README.md").read_text()
    named = set(re.findall(r"`(?:benchmarks/variants/)?([A-Za-z0-9_.-]+\.diff)`", readme))
    named |= set(re.findall(r"benchmarks/variants/([A-Za-z0-9_.-]+\.diff)", readme))
    on_disk = {p.name for p in PATCHES}
    assert on_disk <= named, f"not in the README: {sorted(on_disk - named)}"
    assert named <= on_disk, f"in the README but not in benchmarks/variants/: {sorted(named - on_disk)}"
