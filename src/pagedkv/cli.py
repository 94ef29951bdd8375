"""The ``pagedkv`` command. Every verb is registered here, in ``VERBS``; its arguments and its handler live with
the code it drives: module ``m`` of verb ``v`` defines ``add_v_arguments(parser)`` and ``run_v(args)``, which
returns the exit status. A new verb (the runtime's generate, serve, bench, demo, inspect...) is those two
functions in its module plus one line in ``VERBS``.

Verb modules import heavy optional dependencies (torch for export, TensorRT for build) only inside
``run_v``, so ``pagedkv --help`` never loads them; a verb whose module cannot be imported at all (a broken
install) stays listed and says why when it is run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Verb:
    name: str
    module: str  # defines add_<name>_arguments(parser) and run_<name>(args) -> int
    help: str


VERBS = (
    Verb("doctor", "pagedkv.doctor", "report what this machine has (CUDA, plugin library, TensorRT, headers)"),
    Verb("selfcheck", "pagedkv.selfcheck", "write + attention on a small random case, references vs kernels"),
    Verb("pagemap", "pagedkv.kvcache.pagemap", "draw the KV pool page map of a demo manager as a PNG"),
    # the builder: export -> rewrite -> compare -> build
    Verb("export", "pagedkv.onnx_export.hf", "export a Hugging Face decoder (family tiny config or local "
                                             "directory) to ONNX with past key/values"),
    Verb("rewrite", "pagedkv.builder.rewrite", "replace each attention block with the pagedkv plugin nodes"),
    Verb("compare", "pagedkv.builder.compare", "run original and rewritten graphs on the same prompts and "
                                               "compare logits and greedy tokens"),
    Verb("build", "pagedkv.builder.build", "build a TensorRT engine from a rewritten graph"),
)


def _register(subparsers, verb: Verb) -> None:
    parser = subparsers.add_parser(verb.name, help=verb.help, description=verb.help)
    try:
        module = importlib.import_module(verb.module)
    except ImportError as exc:  # the rest of the command stays usable; this verb says why when run
        parser.set_defaults(func=lambda args, exc=exc: _unavailable(verb.name, exc), takes_any_arguments=True)
        return
    getattr(module, f"add_{verb.name}_arguments")(parser)
    parser.set_defaults(func=getattr(module, f"run_{verb.name}"))


def _unavailable(name: str, exc: Exception) -> int:
    print(f"pagedkv {name}: unavailable: {exc}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv", description="TensorRT plugins, builder and runtime for LLM "
                                                                 "inference with a paged KV cache")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for verb in VERBS:
        _register(subparsers, verb)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
