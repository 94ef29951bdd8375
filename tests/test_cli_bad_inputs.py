"""Every verb, driven with a table of bad inputs as a new user hands them over (issue 14).

Each case runs ``python -m pagedkv ...`` as a subprocess in a fresh folder holding the fixture files (a small
synthetic decoder, its rewrite, a rewrite of another model, a non-LLM graph, an empty file, a text file, a
truncated model, prompt files, model folders). Each must end with the stated exit status (2: usage), exactly one
line on stderr naming the argument or file, no traceback, no file left behind and every input byte-unchanged.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from pagedkv import onnx_io
from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.onnx_export.synthetic import SyntheticConfig, export_synthetic

BASE = SyntheticConfig(num_layers=2, hidden=64, vocab=128, intermediate=128)
OTHER = BASE.replace(num_layers=1, vocab=96)  # another model: layers and vocabulary differ


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # relative to the case's folder (the fixture files)
    names: str  # what the one line must name: the argument or the file (and what is wrong)
    code: int = 2

    def __post_init__(self):
        assert self.argv and self.names and self.code in (1, 2), self


def C(id: str, argv: str, names: str, code: int = 2) -> Case:  # noqa: N802 - reads as a table row
    return Case(id, tuple(argv.split()), names, code)


CASES = [
    # ---- rewrite: the files handed over
    C("rewrite-missing-file", "rewrite missing.onnx -o out.onnx", "'missing.onnx' does not exist"),
    C("rewrite-empty-file", "rewrite empty.onnx -o out.onnx", "'empty.onnx' is empty"),
    C("rewrite-text-file", "rewrite notes.onnx -o out.onnx", "'notes.onnx' is not an ONNX model"),
    C("rewrite-truncated-file", "rewrite truncated.onnx -o out.onnx", "'truncated.onnx' is not an ONNX model"),
    C("rewrite-non-llm-graph", "rewrite relu.onnx -o out.onnx", "'relu.onnx' is not a decoder-with-past LLM graph"),
    C("rewrite-already-rewritten", "rewrite rew.onnx -o out.onnx", "'rew.onnx' is already rewritten"),
    C("rewrite-output-is-input", "rewrite orig.onnx -o orig.onnx", "output: 'orig.onnx' is also an input"),
    C("rewrite-output-is-a-folder", "rewrite orig.onnx -o folder", "output: 'folder' is a directory"),
    C("rewrite-no-output", "rewrite orig.onnx", "-o/--output"),
    # ---- rewrite: option ranges (the capability table)
    C("rewrite-page-size-0", "rewrite orig.onnx -o out.onnx --page-size 0", "--page-size: expected a value in [1,"),
    C("rewrite-page-size-5000", "rewrite orig.onnx -o out.onnx --page-size 5000", "--page-size"),
    C("rewrite-page-size-text", "rewrite orig.onnx -o out.onnx --page-size many", "--page-size: invalid int"),
    C("rewrite-cache-dtype", "rewrite orig.onnx -o out.onnx --cache-dtype int9", "--cache-dtype: unknown value"),
    C("rewrite-k-scale-nan", "rewrite orig.onnx -o out.onnx --cache-dtype fp8 --k-scale nan --v-scale 1",
      "--k-scale: expected a finite value > 0"),
    C("rewrite-v-scale-negative", "rewrite orig.onnx -o out.onnx --cache-dtype int8 --k-scale 1 --v-scale -2",
      "--v-scale"),
    C("rewrite-int8-without-scales", "rewrite orig.onnx -o out.onnx --cache-dtype int8", "needs K and V scales"),
    C("rewrite-window-negative", "rewrite orig.onnx -o out.onnx --window -1", "--window"),
    C("rewrite-max-blocks-0", "rewrite orig.onnx -o out.onnx --max-blocks 0", "--max-blocks"),
    C("rewrite-sampling-candidates-0", "rewrite orig.onnx -o out.onnx --sampling-candidates 0",
      "--sampling-candidates"),
    C("rewrite-top-logprobs-negative", "rewrite orig.onnx -o out.onnx --top-logprobs -1", "--top-logprobs"),
    C("rewrite-calib-data-missing", "rewrite orig.onnx -o out.onnx --cache-dtype int8 --calib-data gone.jsonl",
      "calib-data: 'gone.jsonl' does not exist"),
    # ---- compare: the files handed over
    C("compare-missing-original", "compare missing.onnx rew.onnx", "original: 'missing.onnx' does not exist"),
    C("compare-empty-rewritten", "compare orig.onnx empty.onnx", "rewritten: 'empty.onnx' is empty"),
    C("compare-text-original", "compare notes.onnx rew.onnx", "original: 'notes.onnx' is not an ONNX model"),
    C("compare-swapped", "compare rew.onnx orig.onnx", "the arguments are swapped"),
    C("compare-two-originals", "compare orig.onnx orig.onnx", "run `pagedkv rewrite` on it first"),
    C("compare-two-rewritten", "compare rew.onnx rew.onnx", "original graph: it has the pagedkv plugin nodes"),
    C("compare-different-models", "compare orig.onnx other_rew.onnx", "graphs of different models: layers 2 vs 1"),
    C("compare-non-llm-original", "compare relu.onnx rew.onnx", "original graph: no input_ids input"),
    # ---- compare: options
    C("compare-prompts-0", "compare orig.onnx rew.onnx --prompts 0", "--prompts: expected >= 1, got 0"),
    C("compare-prompts-negative", "compare orig.onnx rew.onnx --prompts -2", "--prompts: expected >= 1, got -2"),
    C("compare-prompt-lens-negative", "compare orig.onnx rew.onnx --prompt-lens 5,-3", "--prompt-lens[1]"),
    C("compare-prompt-lens-text", "compare orig.onnx rew.onnx --prompt-lens 5,x", "--prompt-lens[1]"),
    C("compare-chunk-size-negative", "compare orig.onnx rew.onnx --chunk-size -4", "--chunk-size: expected >= 0"),
    C("compare-decode-steps-negative", "compare orig.onnx rew.onnx --decode-steps -1", "--decode-steps"),
    C("compare-atol-negative", "compare orig.onnx rew.onnx --atol -1", "--atol: expected >= 0"),
    C("compare-rtol-nan", "compare orig.onnx rew.onnx --rtol nan", "--rtol: expected a finite number"),
    C("compare-plot-is-input", "compare orig.onnx rew.onnx --plot rew.onnx", "--plot: 'rew.onnx' is also an input"),
    C("compare-unknown-backend", "compare orig.onnx rew.onnx --backend gpu", "--backend: invalid choice"),
    # ---- export (all before torch is imported)
    C("export-model-dir-missing", "export --model-dir nowhere -o out.onnx", "--model-dir: 'nowhere' does not exist"),
    C("export-model-dir-empty", "export --model-dir emptydir -o out.onnx", "has no config.json"),
    C("export-model-dir-bad-config", "export --model-dir badconfig -o out.onnx", "is not a Hugging Face config"),
    C("export-opset-0", "export --family llama -o out.onnx --opset 0", "--opset: expected a value in [14,"),
    C("export-unknown-family", "export --family llama9 -o out.onnx", "--family: invalid choice"),
    C("export-no-source", "export -o out.onnx", "one of the arguments --family --model-dir is required"),
    C("export-output-is-a-folder", "export --family llama -o folder", "output: 'folder' is a directory"),
    # ---- build (its checks run before TensorRT is imported), inspect
    C("build-no-output", "build rew.onnx", "-o/--output"),
    C("build-workspace-text", "build rew.onnx -o x.engine --workspace-mib lots", "--workspace-mib: invalid int"),
    C("build-missing-file", "build missing.onnx -o x.engine", "'missing.onnx' does not exist"),
    C("build-empty-file", "build empty.onnx -o x.engine", "'empty.onnx' is empty"),
    C("build-output-is-input", "build rew.onnx -o rew.onnx", "'rew.onnx' is also an input"),
    C("build-float32-graph", "build rew.onnx -o x.engine", "the plugin activations are float32"),
    C("inspect-missing-engine", "inspect missing.engine", "'missing.engine' does not exist"),
    C("inspect-empty-engine", "inspect empty.onnx", "'empty.onnx' is empty"),
    # ---- pagemap
    C("pagemap-blocks-0", "pagemap --blocks 0 -o map.png", "--blocks: expected >= 1, got 0"),
    C("pagemap-page-size-0", "pagemap --page-size 0 -o map.png", "--page-size"),
    C("pagemap-seqs-negative", "pagemap --seqs -1 -o map.png", "--seqs"),
    C("pagemap-host-blocks-negative", "pagemap --host-blocks -1 -o map.png", "--host-blocks"),
    C("pagemap-output-is-a-folder", "pagemap -o folder", "--out: 'folder' is a directory"),
    # ---- generate
    C("generate-missing-model", "generate missing.onnx --input-ids-file ids.jsonl", "model: 'missing.onnx'"),
    C("generate-text-model", "generate notes.onnx --input-ids-file ids.jsonl", "'notes.onnx' is not an ONNX model"),
    C("generate-original-graph", "generate orig.onnx --input-ids-file ids.jsonl", "run `pagedkv rewrite` on it"),
    C("generate-not-a-model", "generate ids.jsonl --input-ids-file ids.jsonl", "is neither a rewritten .onnx"),
    C("generate-no-prompts", "generate rew.onnx", "give --prompt TEXT"),
    C("generate-prompts-not-json", "generate rew.onnx --input-ids-file notes.onnx", "not JSON"),
    C("generate-chunk-size-negative", "generate rew.onnx --input-ids-file ids.jsonl --chunk-size -4",
      "--chunk-size"),
    C("generate-max-new-tokens-0", "generate rew.onnx --input-ids-file ids.jsonl --max-new-tokens 0",
      "--max-new-tokens"),
    C("generate-temperature-nan", "generate rew.onnx --input-ids-file ids.jsonl --temperature nan",
      "--temperature"),
    C("generate-top-p-2", "generate rew.onnx --input-ids-file ids.jsonl --top-p 2", "--top-p"),
    C("generate-max-model-len-0", "generate rew.onnx --input-ids-file ids.jsonl --max-model-len 0",
      "--max-model-len"),
    C("generate-host-blocks-negative", "generate rew.onnx --input-ids-file ids.jsonl --host-blocks -1",
      "--host-blocks"),
    C("generate-page-size-mismatch", "generate rew.onnx --input-ids-file ids.jsonl --page-size 32", "--page-size"),
    C("generate-output-is-input", "generate rew.onnx --input-ids-file ids.jsonl --jsonl -o ids.jsonl",
      "output: 'ids.jsonl' is also an input"),
    C("generate-stop-token-negative", "generate rew.onnx --input-ids-file ids.jsonl --stop-token-ids 1,-2",
      "--stop-token-ids[1]"),
    # ---- serve (every check before the server starts)
    C("serve-port-negative", "serve rew.onnx --port -1", "--port: expected a value in [0, 65535]"),
    C("serve-port-too-high", "serve rew.onnx --port 70000", "--port"),
    C("serve-max-pending-0", "serve rew.onnx --max-pending 0", "--max-pending"),
    C("serve-missing-model", "serve missing.onnx", "model: 'missing.onnx' does not exist"),
    # ---- bench
    C("bench-num-prompts-0", "bench rew.onnx --num-prompts 0", "--num-prompts"),
    C("bench-request-rate-negative", "bench rew.onnx --request-rate -1", "--request-rate"),
    C("bench-input-len-0", "bench rew.onnx --input-len 0", "--input-len"),
    C("bench-len-spread-nan", "bench rew.onnx --len-spread nan", "--len-spread"),
    C("bench-warmup-negative", "bench rew.onnx --warmup -1", "--warmup"),
    C("bench-output-is-input", "bench rew.onnx --json -o rew.onnx", "--output: 'rew.onnx' is also an input"),
    C("bench-plot-is-input", "bench rew.onnx --plot ids.jsonl --prompts-file ids.jsonl", "--plot: 'ids.jsonl'"),
    C("bench-prompts-file-missing", "bench rew.onnx --prompts-file gone.jsonl", "--prompts-file: 'gone.jsonl'"),
    C("bench-original-graph", "bench orig.onnx", "run `pagedkv rewrite` on it first"),
    # ---- selfcheck, doctor, demo
    C("selfcheck-unknown-backend", "selfcheck --backend fast", "--backend: invalid choice"),
    C("doctor-unknown-option", "doctor --bogus", "unrecognized arguments: --bogus"),
    C("demo-output-dir-is-a-file", "demo -o ids.jsonl", "--output-dir: 'ids.jsonl' is a file"),
    C("demo-unknown-family", "demo --family llama9", "--family: invalid choice"),
]


def _tree(root: Path) -> dict[str, str]:
    """Every file and folder under ``root`` with the sha256 of each file's bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inputs")
    export_synthetic(BASE, root / "orig.onnx")
    onnx_io.save(rewrite_model(str(root / "orig.onnx"), RewriteOptions()).model, root / "rew.onnx")
    export_synthetic(OTHER, root / "other.onnx")
    onnx_io.save(rewrite_model(str(root / "other.onnx"), RewriteOptions()).model, root / "other_rew.onnx")
    (root / "other.onnx").unlink()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])),
              str(root / "relu.onnx"))
    (root / "empty.onnx").write_bytes(b"")
    (root / "notes.onnx").write_text("meeting notes, saved with the wrong name\n")
    (root / "truncated.onnx").write_bytes((root / "orig.onnx").read_bytes()[:4000])
    (root / "ids.jsonl").write_text('{"id": "a", "input_ids": [5, 17, 33]}\n')
    (root / "folder").mkdir()
    (root / "emptydir").mkdir()
    (root / "badconfig").mkdir()
    (root / "badconfig" / "config.json").write_text("[1, 2, 3]\n")
    return root


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_is_one_line_and_leaves_everything_as_it_was(case, fixtures, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(fixtures, work)
    before = _tree(work)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}  # a library's warning is not the verb's message
    run = subprocess.run([sys.executable, "-m", "pagedkv", *case.argv], cwd=work, env=env, capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)
    err = run.stderr
    assert run.returncode == case.code, f"exit {run.returncode}, expected {case.code}\n{err}{run.stdout}"
    assert "Traceback" not in err + run.stdout, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedkv"), f"expected one line on stderr, got:\n{err}"
    assert case.names in lines[0], f"the line should name {case.names!r}: {lines[0]}"
    assert _tree(work) == before, "an output was left behind or an input changed"


def test_the_table_covers_every_verb():
    from pagedkv import cli

    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)
    assert {v.name for v in cli.VERBS} <= {c.argv[0] for c in CASES}


def test_selfcheck_cuda_without_a_gpu_is_one_line(tmp_path):
    """``selfcheck --backend cuda`` on a machine without a GPU: refused before any check runs, the reason in one
    line on stderr (not a FAIL line on stdout after the reference checks)."""
    from pagedkv import cuda

    if not cuda.why_no_gpu():
        pytest.skip("a GPU is present: selfcheck --backend cuda runs the kernels here")
    run = subprocess.run([sys.executable, "-m", "pagedkv", "selfcheck", "--backend", "cuda"], cwd=tmp_path,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert run.stdout == ""
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("pagedkv selfcheck: --backend cuda: "), run.stderr
