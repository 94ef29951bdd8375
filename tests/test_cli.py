"""The ``pagedkv`` command: one table registers every verb, each verb's module supplies its arguments and
handler, and ``pagedkv --help`` loads no heavy optional dependency."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from pagedkv import cli

HEAVY = ("torch", "transformers", "tensorrt", "tensorrt_rtx")


def test_help_lists_every_verb_and_imports_nothing_heavy():
    code = ("import sys, contextlib, io\n"
            "from pagedkv import cli\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
            "    cli.main(['--help'])\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
            "print(out.getvalue())\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    loaded, _, text = run.stdout.partition("\n")
    assert loaded == "[]", f"pagedkv --help imported {loaded}"
    for verb in cli.VERBS:
        assert verb.name in text


@pytest.mark.parametrize("verb", cli.VERBS, ids=lambda v: v.name)
def test_each_verb_lives_in_its_module(verb):
    module = importlib.import_module(verb.module)
    assert callable(getattr(module, f"add_{verb.name}_arguments"))
    assert callable(getattr(module, f"run_{verb.name}"))
    args = cli.build_parser().parse_args([verb.name] + {"export": ["--family", "llama", "-o", "x.onnx"],
                                                        "rewrite": ["in.onnx", "-o", "out.onnx"],
                                                        "compare": ["a.onnx", "b.onnx"],
                                                        "build": ["in.onnx", "-o", "x.engine"],
                                                        "inspect": ["x.engine"],
                                                        "generate": ["m.onnx"], "serve": ["m.onnx"],
                                                        "bench": ["m.onnx"]}.get(verb.name, []))
    assert args.func is getattr(module, f"run_{verb.name}")


def test_a_verb_whose_module_cannot_load_says_why(monkeypatch, capsys):
    monkeypatch.setattr(cli, "VERBS", cli.VERBS + (cli.Verb("missing", "pagedkv.no_such_module", "not here"),))
    assert cli.main(["missing", "--anything"]) == 2
    err = capsys.readouterr().err
    assert "pagedkv missing: unavailable:" in err and "pagedkv.no_such_module" in err
