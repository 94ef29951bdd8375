"""Every shell and Python example in README.md and docs/*.md runs, so the docs cannot drift from the code.

Blocks fenced as ```bash / ```sh / ```python are code; other fences (```text, ```cpp, diagrams) are not run here
(docs/runtime-cpp.md's C++ example is compiled by tests/test_runtime_cpp.py). A block that cannot run on a CPU
machine is marked in the Markdown, on the line right before its fence::

    <!-- docs-test: skip: needs TensorRT and a GPU -->

and the marker must give its reason; the test counts the skipped blocks. The blocks of one document run in
order in one fresh folder, as a reader following along would (a later block uses what an earlier one made),
with ``pagedkv`` and ``python`` of this interpreter on PATH. The folder starts with the files the docs assume
the reader has: ``model.onnx`` (a small decoder-with-past export), ``qwen2.paged.onnx`` (its rewrite),
``qwen2-dir`` (a tokenizer directory for it) and ``prompts.jsonl`` (token-id prompts).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from runtime_support import SMALL, synthetic_rewritten, tokenizer_dir

from pagedkv.onnx_export.synthetic import export_synthetic

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\n(?P<body>.*?)^```\s*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<what>[\w-]+)(?::\s*(?P<reason>.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    lang: str  # "bash" or "python"
    code: str
    skip: str | None  # the marker's reason, None: runs

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def code_blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    blocks = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        line = text.count("\n", 0, m.start()) + 1
        if marker:
            assert marker["what"] == "skip" and marker["reason"], \
                f"{doc.name}:{line}: a docs-test marker is 'skip: REASON', got {before.strip()!r}"
        lang = CODE.get(m["lang"])
        if lang is None:
            assert not marker, f"{doc.name}:{line}: marker on a block that is not run (```{m['lang']})"
            continue
        blocks.append(Block(doc, line, lang, m["body"], marker["reason"] if marker else None))
    return blocks


def _folder(path: Path) -> Path:
    path.mkdir()
    export_synthetic(SMALL, path / "model.onnx")
    (path / "qwen2.paged.onnx").write_bytes(synthetic_rewritten(SMALL))
    tokenizer_dir(path / "qwen2-dir", vocab=SMALL.vocab)
    (path / "prompts.jsonl").write_text('{"id": "a", "input_ids": [5, 17, 33]}\n{"id": "b", "input_ids": [9, 2]}\n')
    return path


def _run(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}
    argv = ["bash", "-euo", "pipefail", "-c", block.code] if block.lang == "bash" else \
        [sys.executable, "-c", block.code]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_code_blocks_run(doc, tmp_path):
    blocks = code_blocks(doc)
    if not blocks:
        pytest.skip(f"{doc.name} has no shell or Python blocks")
    cwd = _folder(tmp_path / "reader")
    for block in blocks:
        if block.skip:
            continue
        run = _run(block, cwd)
        assert run.returncode == 0, f"{block.where} ({block.lang}) exit {run.returncode}:\n{block.code}\n" \
                                    f"--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-3000:]}"


def test_skipped_blocks_are_counted_and_give_reasons(capsys):
    blocks = [b for doc in DOCS for b in code_blocks(doc)]
    skipped = [b for b in blocks if b.skip]
    with capsys.disabled():
        print(f"\ndocs: {len(blocks)} shell/Python blocks, {len(blocks) - len(skipped)} run, {len(skipped)} "
              "skipped: " + "; ".join(f"{b.where} ({b.skip})" for b in skipped))
    assert len(blocks) - len(skipped) > len(skipped), "most examples must run"
    assert all(len(b.skip) > 10 for b in skipped)
