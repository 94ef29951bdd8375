"""The ``pagedkv`` command. Every verb is registered here, in ``VERBS``; its arguments and its handler live with
the code it drives: module ``m`` of verb ``v`` defines ``add_v_arguments(parser)`` and ``run_v(args)``, which
returns the exit status. A new verb (the runtime's generate, serve, bench, demo, inspect...) is those two
functions in its module plus one line in ``VERBS``.

Verb modules import heavy optional dependencies (torch for export, TensorRT for build) only inside
``run_v``, so ``pagedkv --help`` never loads them; a verb whose module cannot be imported at all (a broken
install) stays listed and says why when it is run.

Every verb runs through ``pagedkv.userio.run_verb``: a ``UsageError`` (bad argument or input file) is one
line and exit status 2, any other error one line and exit status 1, a traceback only with ``--debug``.
Argument errors argparse finds itself are one line and exit status 2 too.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

from pagedkv import __version__
from pagedkv.userio import EXIT_USAGE, run_verb


@dataclass(frozen=True)
class Verb:
    name: str
    module: str  # defines add_<name>_arguments(parser) and run_<name>(args) -> int
    help: str


VERBS = (
    Verb("doctor", "pagedkv.doctor", "report what this machine has (CUDA, plugin library, TensorRT, headers)"),
    Verb("demo", "pagedkv.runtime.demo", "the main job: a small model rewritten, run with continuous batching on "
                                         "the best backend here, checked against the original graph"),
    Verb("selfcheck", "pagedkv.selfcheck", "write + attention on a small random case, references vs kernels"),
    Verb("pagemap", "pagedkv.kvcache.pagemap", "draw the KV pool page map of a demo manager as a PNG"),
    # the builder: export -> rewrite -> compare -> build
    Verb("export", "pagedkv.onnx_export.hf", "export a Hugging Face decoder (family tiny config or local "
                                             "directory) to ONNX with past key/values"),
    Verb("rewrite", "pagedkv.builder.rewrite", "replace each attention block with the pagedkv plugin nodes"),
    Verb("compare", "pagedkv.builder.compare", "run original and rewritten graphs on the same prompts and "
                                               "compare logits and greedy tokens"),
    Verb("build", "pagedkv.builder.build", "build a TensorRT or TensorRT-RTX engine from a rewritten graph"),
    Verb("inspect", "pagedkv.builder.inspect_engine", "what an engine holds (I/O, profile, plugins, flavour, "
                                                      "targets), checked against the engine-I/O contract"),
    # the runtime
    Verb("generate", "pagedkv.runtime.generate", "generate text or token ids from a rewritten graph or an engine"),
    Verb("serve", "pagedkv.runtime.serve", "serve a model over an OpenAI-compatible HTTP API (the serve extra)"),
    Verb("bench", "pagedkv.runtime.bench", "offline throughput and online latency (TTFT, ITL, end to end) of a model"),
)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``pagedkv rewrite: argument --page-size: ... (see --help)``, exit 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see '{self.prog} --help')\n")


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    common.add_argument("--quiet", action="store_true", help="no progress output")
    return common


def _register(subparsers, verb: Verb) -> None:
    parser = subparsers.add_parser(verb.name, help=verb.help, description=verb.help, parents=[_common_options()])
    try:
        module = importlib.import_module(verb.module)
    except ImportError as exc:  # the rest of the command stays usable; this verb says why when run
        parser.set_defaults(func=lambda args, exc=exc: _unavailable(verb.name, exc), takes_any_arguments=True)
        return
    getattr(module, f"add_{verb.name}_arguments")(parser)
    parser.set_defaults(func=getattr(module, f"run_{verb.name}"))


def _unavailable(name: str, exc: Exception) -> int:
    print(f"pagedkv {name}: unavailable: {exc}", file=sys.stderr)
    return EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagedkv", description="TensorRT plugins, builder and runtime for LLM inference with a "
                                                 "paged KV cache")
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for verb in VERBS:
        _register(subparsers, verb)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return run_verb(args.command, args.func, args)


if __name__ == "__main__":
    sys.exit(main())
