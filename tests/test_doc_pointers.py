"""Pointers stay true: every repository path the Python side and the docs name exists, and the README's
Layout section names only what the tree has."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON_SIDE = ("src/", "builder/", "onnx_export/", "tests/", "samples/", "benchmarks/", "docs/", ".ci/",
               "README.md")
PATH = re.compile(r"(?<![\w/.-])((?:src|builder|onnx_export|plugins|tests|docs|samples|benchmarks|cmake|\.ci)"
                  r"/[\w/.-]*\w)")
PLACEHOLDER = re.compile(r"(^|/)(X|bench_X\.py)$")  # "builder/X is pagedkv.builder.X"


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc}): the tracked files cannot be listed")
    return [f for f in out.split() if f.startswith(PYTHON_SIDE) and f.endswith((".py", ".md", ".sh", "run"))]


def test_every_named_path_exists():
    missing = []
    for name in _tracked():
        text = (ROOT / name).read_text(errors="replace")
        for m in PATH.finditer(text):
            ref = m.group(1)
            if PLACEHOLDER.search(ref) or re.match(r"-?[*{<$]", text[m.end():m.end() + 2]):  # a name pattern
                continue
            if not ((ROOT / ref).exists() or (ROOT / name).parent.joinpath(ref).exists()):
                missing.append(f"{name}:{text[:m.start()].count(chr(10)) + 1}: {ref}")
    assert not missing, "paths named but not in the tree:\n" + "\n".join(missing)


def test_readme_layout_matches_the_tree():
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("## Layout"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    parent, missing, seen = "", [], 0
    for line in block.splitlines():
        if not line.strip() or line.startswith(" " * 20):  # blank, or a description's continuation
            continue
        indent = len(line) - len(line.lstrip())
        names = [n for n in re.split(r"[,\s()]+", re.split(r"\s{2,}", line.strip())[0]) if n]
        if indent == 0:
            parent = names[0] if names[0].endswith("/") else ""
        for name in names:
            path = name if indent == 0 else parent + name
            seen += 1
            if not (ROOT / path).exists():
                missing.append(path)
    assert seen > 20, f"the Layout block was not read ({seen} names)"
    assert not missing, f"README Layout names what the tree lacks: {missing}"
