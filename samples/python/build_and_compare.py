"""Export -> rewrite -> compare (-> build), end to end, in one script.

    python samples/python/build_and_compare.py --family llama --exporter dynamo --chunk-size 8
    python samples/python/build_and_compare.py --synthetic            # no torch needed
    python samples/python/build_and_compare.py --family qwen2 --backend cuda --cache-dtype bf16   # GPU
    python samples/python/build_and_compare.py --family llama --dtype fp16 --cache-dtype int8     # calibrated
    python samples/python/build_and_compare.py --family llama --dtype fp16 --engine llama.engine  # TensorRT(-RTX)

Writes the original and rewritten graphs (each a .onnx and its .onnx.data) into --out-dir, prints the rewrite
report and the per-step comparison, and exits non-zero when the comparison fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--family", default="llama", help="Hugging Face family (tiny config, random weights)")
    src.add_argument("--synthetic", action="store_true", help="use the dependency-free synthetic decoder")
    p.add_argument("--exporter", default="dynamo", choices=["legacy", "dynamo"])
    p.add_argument("--out-dir", default="out/sample")
    p.add_argument("--cache-dtype", default="fp16", help="fp8 / int8: per-layer scales calibrated on the original")
    p.add_argument("--dtype", default=None, choices=["fp16", "bf16"], help="convert the rewritten graph (engines "
                                                                         "need fp16 or bf16)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--backend", default="reference", choices=["reference", "cuda", "trt"])
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--engine", default=None, help="also build an engine to this path (TensorRT, or TensorRT-RTX) and inspect it")
    args = p.parse_args(argv)

    from pagedkv import onnx_io
    from pagedkv.builder.calibrate import CalibrationPlan
    from pagedkv.builder.compare import compare, default_tolerance
    from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
    from pagedkv.layout import CacheDType

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    original = out / "original.onnx"
    if args.synthetic:
        from pagedkv.onnx_export.synthetic import SyntheticConfig, export_synthetic

        export_synthetic(SyntheticConfig(), original)
        print(f"synthetic decoder -> {original}")
    else:
        from pagedkv.onnx_export.hf import export_hf

        print(export_hf(args.family, original, exporter=args.exporter))

    calibration = CalibrationPlan() if CacheDType.parse(args.cache_dtype).quantized else None
    result = rewrite_model(str(original), RewriteOptions(page_size=args.page_size, cache_dtype=args.cache_dtype,
                                                         calibration=calibration, dtype=args.dtype))
    rewritten = out / "rewritten.onnx"
    onnx_io.save(result.model, rewritten)  # rewritten.onnx + rewritten.onnx.data
    print(result.report)

    atol, rtol = default_tolerance(rewritten, original)
    report = compare(str(original), str(rewritten), backend=args.backend, prompt_lens=[5, 17, 33],
                     decode_steps=args.decode_steps, chunk_size=args.chunk_size, atol=atol, rtol=rtol)
    print(report)

    if args.engine:  # TensorRT, or TensorRT-RTX (which builds without a GPU)
        from pagedkv.builder.build import build_engine
        from pagedkv.builder.inspect_engine import inspect_engine
        from pagedkv.userio import UsageError

        try:
            built = build_engine(rewritten, args.engine)
        except UsageError as exc:  # no TensorRT flavour here, a float32 graph (--dtype), ...
            print(f"not building {args.engine}: {exc}")
        else:
            print(f"engine -> {built.engine} ({built.flavour} {built.version}, targets {', '.join(built.targets)}); "
                  f"inspect: {'ok' if inspect_engine(built.engine).ok else 'problems'}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
