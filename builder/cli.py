"""The builder's subcommands of ``pagedkv``: export -> rewrite -> compare -> build.

    pagedkv export --family llama -o llama.onnx [--exporter legacy|dynamo]
    pagedkv rewrite llama.onnx -o llama.paged.onnx [--page-size 16 ...]
    pagedkv compare llama.onnx llama.paged.onnx [--backend reference|cuda|trt]
    pagedkv build llama.paged.onnx -o llama.engine

Each subcommand imports its module only when it runs, so a missing optional dependency (torch for
export, TensorRT for build) is reported by that subcommand, never at ``pagedkv --help``.
"""

from __future__ import annotations

import argparse
import sys


def _cmd_export(args) -> int:
    from pagedkv.onnx_export import hf

    try:
        result = hf.run_export(args)
    except hf.MissingExportDependencies as exc:
        print(f"pagedkv export: {exc}", file=sys.stderr)
        return 2
    print(result)
    return 0


def _cmd_rewrite(args) -> int:
    from pagedkv.builder import rewrite

    import onnx

    try:
        result = rewrite.rewrite_model(args.input, rewrite.options_from_args(args))
    except rewrite.RewriteError as exc:
        print(f"pagedkv rewrite: {exc}", file=sys.stderr)
        return 1
    onnx.save(result.model, args.output)
    print(result.report)
    print(f"wrote {args.output}")
    return 0


def _cmd_compare(args) -> int:
    from pagedkv.builder import compare

    return compare.run_compare(args)


def _cmd_build(args) -> int:
    from pagedkv.builder import build

    return build.run_build(args)


def _add_rewrite(sub) -> None:
    p = sub.add_parser("rewrite", help="replace each attention block with the pagedkv plugin nodes")
    try:
        from pagedkv.builder import rewrite
    except ImportError as exc:  # keeps the rest of the CLI usable; the subcommand says why
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda args, exc=exc: _unavailable("rewrite", exc))
        return
    rewrite.add_rewrite_arguments(p)  # positional input and -o/--output included
    p.set_defaults(func=_cmd_rewrite)


def _unavailable(name: str, exc: Exception) -> int:
    print(f"pagedkv {name}: unavailable: {exc}", file=sys.stderr)
    return 2


def register(subparsers) -> None:
    """Add ``export``, ``rewrite``, ``compare`` and ``build`` to the ``pagedkv`` command."""
    from pagedkv.builder.build import add_build_arguments
    from pagedkv.builder.compare import add_compare_arguments
    from pagedkv.onnx_export.hf import add_export_arguments

    p = subparsers.add_parser("export", help="export a Hugging Face decoder (family tiny config or local "
                                             "directory) to ONNX with past key/values")
    add_export_arguments(p)
    p.set_defaults(func=_cmd_export)

    _add_rewrite(subparsers)

    p = subparsers.add_parser("compare", help="run original and rewritten graphs on the same prompts and "
                                              "compare logits and greedy tokens")
    add_compare_arguments(p)
    p.set_defaults(func=_cmd_compare)

    p = subparsers.add_parser("build", help="build a TensorRT engine from a rewritten graph")
    add_build_arguments(p)
    p.set_defaults(func=_cmd_build)
