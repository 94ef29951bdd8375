"""Long verbs name their steps on a progress bar (stderr, on a terminal, not with --quiet): rewrite's here, export's
in test_export_hf.test_cli_export, compare's, calibration's and the engine build's with their tests."""

from __future__ import annotations

import pytest

import pagedkv.userio
from pagedkv.cli import main
from pagedkv.onnx_export.synthetic import SyntheticConfig, export_synthetic


@pytest.fixture()
def terminal(monkeypatch):
    """stderr treated as a terminal: progress bars are drawn (into pytest's captured stderr); returns the bars
    made, to read their totals and final counts."""
    monkeypatch.setattr(pagedkv.userio, "progress_enabled", lambda quiet=False: not quiet)
    bars, original = [], pagedkv.userio.progress

    def recording(*args, **kwargs):
        bars.append(original(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(pagedkv.userio, "progress", recording)
    return bars


def _steps_bar(bars, desc):
    (bar,) = [b for b in bars if b.desc.startswith(desc)]
    return bar


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("progress") / "m.onnx"
    export_synthetic(SyntheticConfig(num_layers=3, hidden=64, vocab=128, intermediate=128), path)
    return path


def test_rewrite_names_every_step(decoder, tmp_path, capsys, terminal):
    assert main(["rewrite", str(decoder), "-o", str(tmp_path / "out.onnx"), "--dtype", "fp16"]) == 0
    err = capsys.readouterr().err
    for step in ("pagedkv rewrite", "read m.onnx", "match the attention blocks", "analyze 3 attention layers",
                 "emit the plugin nodes", "finish the graph in float16", "write out.onnx"):
        assert step in err, (step, err)
    bar = _steps_bar(terminal, "pagedkv rewrite")
    assert bar.total == 6 and bar.n == 6  # every step counted, the bar closed at its total


def test_rewrite_with_calibration_counts_the_extra_step(decoder, tmp_path, capsys, terminal):
    assert main(["rewrite", str(decoder), "-o", str(tmp_path / "out.onnx"), "--cache-dtype", "int8", "--calibrate",
                 "--calib-prompts", "2", "--calib-len", "8"]) == 0
    err = capsys.readouterr().err
    assert "calibrate the K/V scales" in err, err
    bar = _steps_bar(terminal, "pagedkv rewrite")
    assert bar.total == 7 and bar.n == 7


def test_quiet_and_non_terminal_draw_nothing(decoder, tmp_path, capsys, monkeypatch):
    assert main(["rewrite", str(decoder), "-o", str(tmp_path / "a.onnx"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(pagedkv.userio.sys.stderr, "isatty", lambda: False, raising=False)
    assert main(["rewrite", str(decoder), "-o", str(tmp_path / "b.onnx")]) == 0
    assert capsys.readouterr().err == ""


def test_phases_closes_on_an_error(capsys, terminal):
    with pytest.raises(RuntimeError):
        with pagedkv.userio.phases(3, desc="verb") as step:
            step("first")
            raise RuntimeError("boom")
    err = capsys.readouterr().err
    assert "first" in err
