"""The build path without a builder: limits -> optimization profile, the pre-flight's refusals, the session's fit of
a step to an engine's profile; and, on a GPU with TensorRT (``trt``), engines that run: against the original graph,
with an invalid page, from a timing cache, with the plugin library serialized into a version-compatible engine.

The ``trt`` tests need a TensorRT that runs engines on this GPU (conftest skips them naming why: no GPU, no
TensorRT, or TensorRT-RTX on a compute capability it does not run on). Builds on this CPU machine, with
TensorRT-RTX, are tests/test_engine_build.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import TOLERANCES

from pagedkv.builder import build
from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.onnx_export.synthetic import SyntheticConfig, export_synthetic
from pagedkv.runtime import RewrittenGraph
from pagedkv.runtime.trt import TrtExecutor
from pagedkv.userio import UsageError

BASE = SyntheticConfig(num_layers=2, hidden=64, vocab=128, intermediate=128)


@pytest.fixture(scope="module")
def rewritten_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("trt")
    orig = export_synthetic(BASE, d / "orig.onnx")
    path = d / "rewritten.onnx"  # fp16: the plugins take 16-bit activations only
    onnx.save(rewrite_model(str(orig), RewriteOptions(dtype="fp16")).model, str(path))
    return orig, path


# ---- limits -> profile ------------------------------------------------------------------------------------------
def test_profile_covers_every_engine_input(rewritten_path):
    graph = RewrittenGraph.load(str(rewritten_path[1]))
    shapes = build.BuildLimits(max_batch=8, max_tokens=512, max_context=500, opt_batch=2, opt_tokens=64,
                               opt_context=100).profile(graph)
    assert set(shapes) == set(graph.input_names)
    assert shapes["input_ids"] == ((1, 1), (1, 64), (1, 512))
    assert shapes["cu_q_lens"] == ((2,), (3,), (9,))
    assert shapes["past_lens"] == ((1,), (2,), (8,))
    assert shapes["block_table_0"] == ((1, 1), (2, 7), (8, 32))  # 100 / 500 tokens in pages of 16
    assert shapes["kv_pools"] == ((1, 4),) * 3
    # rt15's heads: R logits rows 1..T (tuned for one per sequence), W penalty tokens 1..min(context, vocab)
    assert graph.sampling and shapes["logits_rows"] == ((1,), (2,), (512,))
    assert shapes["sampling_params"] == tuple((r, 8) for r in (1, 2, 512))
    assert shapes["penalty_tokens"] == shapes["penalty_counts"] == ((1, 1), (2, 1), (512, 128))  # vocab 128 < 500


def test_the_profile_is_the_contracts_shapes(rewritten_path, monkeypatch):
    """Shapes come from pagedkv.engine_io's specs: a symbolic dim the contract gains without a bound here, or a
    graph input whose dims disagree with the contract, is refused naming it."""
    import dataclasses

    from pagedkv import engine_io

    graph = RewrittenGraph.load(str(rewritten_path[1]))
    limits = build.BuildLimits(max_batch=4, max_tokens=64, max_context=64)
    spec = engine_io.SPECS[engine_io.PAST_LENS]
    changed = dataclasses.replace(spec, shape=(engine_io.BATCH, "new_dim"))
    real = engine_io.engine_inputs
    monkeypatch.setattr(engine_io, "engine_inputs", lambda *a: [(n, changed if n == spec.name else s)
                                                                 for n, s in real(*a)])
    with pytest.raises(UsageError, match=r"dims \['new_dim'\] have no profile bound"):
        limits.profile(graph)
    changed = dataclasses.replace(spec, shape=(engine_io.BATCH, 3))
    with pytest.raises(UsageError, match=r"engine input 'past_lens' has dims \['batch'\]; the engine-I/O contract "
                                         r"says \['batch', 3\]"):
        limits.profile(graph)


def test_defaults_tune_for_a_decode_step_of_the_full_batch(rewritten_path):
    graph = RewrittenGraph.load(str(rewritten_path[1]))
    shapes = build.BuildLimits(max_batch=16, max_tokens=256, max_context=64).profile(graph)
    assert shapes["input_ids"][1] == (1, 16) and shapes["past_lens"][1] == (16,)
    assert shapes["block_table_0"][1] == (16, 4)


def test_a_cyclic_pool_group_needs_no_more_pages_than_its_ring(rewritten_path):
    """A ring of 64 slots (a sliding-window cache): the block tables stay 4 pages wide for any context."""
    import dataclasses

    from pagedkv.layout import KVLayout
    from pagedkv.pool_group import PoolGroup

    graph = RewrittenGraph.load(str(rewritten_path[1]))
    ring = PoolGroup("ring", KVLayout(num_layers=2, num_kv_heads=2, page_size=16, head_dim=64, cyclic_len=64),
                     window=64)
    shapes = build.BuildLimits(max_batch=2, max_tokens=32, max_context=100_000).profile(
        dataclasses.replace(graph, groups=(ring,)))
    assert shapes["block_table_0"][2] == (2, 4)


@pytest.mark.parametrize("limits,match", [
    (dict(max_tokens=0), "max-tokens: expected >= 1, got 0"),
    (dict(max_batch=8, opt_batch=9), r"opt-batch: expected a value in \[1, 8\], got 9"),
    (dict(max_batch=8, max_tokens=4), "max-batch=8 exceeds max-tokens=4"),
    (dict(opt_batch=4, opt_tokens=2), "opt-batch=4 exceeds opt-tokens=2"),
    (dict(max_context=2 ** 31), "max-context: expected at most 2147483647"),
    (dict(max_context=2 ** 31 - 1), "exceed int32 cache positions"),
])
def test_limits_errors_name_the_option(rewritten_path, limits, match):
    graph = RewrittenGraph.load(str(rewritten_path[1]))
    with pytest.raises(UsageError, match=match):
        build.BuildLimits(**limits).profile(graph)


def test_preflight_refusals_name_the_input(rewritten_path, tmp_path):
    orig, rew = rewritten_path
    with pytest.raises(UsageError, match="output: .* is also an input"):
        build.preflight(rew, rew)
    bad = tmp_path / "int32_ids.onnx"
    model = onnx.load(str(rew))
    next(i for i in model.graph.input if i.name == "input_ids").type.tensor_type.elem_type = onnx.TensorProto.INT32
    onnx.save(model, str(bad))
    with pytest.raises(UsageError, match=r"engine input 'input_ids' is int32, the engine I/O contract says int64"):
        build.preflight(bad, tmp_path / "m.engine")
    (tmp_path / "garbage.onnx").write_bytes(b"not onnx at all")
    with pytest.raises(UsageError, match="cannot be read as ONNX"):
        build.preflight(tmp_path / "garbage.onnx", tmp_path / "m.engine")


def test_runnable_targets_follow_the_library_architectures(monkeypatch):
    cases = {"80-real,89-real,90": {80, 86, 89, 120, 121}, "90": {120, 121}, "80": {80, 86, 89, 120, 121},
             "75-real": {75}, "86-real": {86, 89}, "120-virtual": {120, 121}}  # sm_86 code runs on 8.9
    for text, expected in cases.items():
        monkeypatch.setattr(build, "_architectures_text", lambda text=text: text)
        assert build._runnable_targets() == expected, text


# ---- the executor against the engine's profile ---------------------------------------------------------------
def test_a_step_outside_the_engine_profile_names_the_limit():
    """Without an engine: TrtExecutor's profile check names the input, the dim and the pagedkv build option that
    bounds it (rt15's R and W dims included); a static dim is the graph's."""
    executor = object.__new__(TrtExecutor)
    executor.profile = {"block_table_0": ((1, 1), (4, 8), (8, 16)), "input_ids": ((1, 1), (1, 8), (1, 64)),
                        "logits_rows": ((1,), (4,), (64,)), "penalty_tokens": ((1, 1), (4, 1), (64, 300)),
                        "kv_pools": ((1, 4), (1, 4), (1, 4))}
    executor._check_profile("block_table_0", (8, 16))  # the max itself fits
    executor._check_profile("penalty_tokens", (3, 1))
    with pytest.raises(ValueError, match=r"input_ids: this step's shape \[1, 65\] is outside the engine's profile "
                                         r"\[1, 1\]..\[1, 64\] \(dim num_tokens\): rebuild the engine with a larger "
                                         r"--max-tokens"):
        executor._check_profile("input_ids", (1, 65))
    with pytest.raises(ValueError, match=r"block_table_0.*\(dim max_blocks\).*--max-context"):
        executor._check_profile("block_table_0", (2, 17))
    with pytest.raises(ValueError, match=r"block_table_0.*\(dim batch\).*--max-batch"):
        executor._check_profile("block_table_0", (9, 3))
    with pytest.raises(ValueError, match=r"logits_rows.*\(dim num_logits\).*--max-tokens"):
        executor._check_profile("logits_rows", (65,))
    with pytest.raises(ValueError, match=r"penalty_tokens.*\(dim penalty_width\).*--max-context"):
        executor._check_profile("penalty_tokens", (2, 301))
    with pytest.raises(ValueError, match=r"kv_pools: .*: the graph fixes it"):
        executor._check_profile("kv_pools", (2, 4))


# ---- engines that run (TensorRT on a GPU) ------------------------------------------------------------------------
SMALL = build.BuildLimits(max_batch=8, max_tokens=256, max_context=256)


@pytest.mark.trt
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,max_blocks", [("fp16", None), ("bf16", 16)], ids=["fp16", "bf16-static-width"])
def test_engine_matches_the_original(tmp_path, dtype, max_blocks):
    """compare --backend trt builds the engine and runs it against the original: bf16 I/O (no trt.nptype) and a
    static --max-blocks width the session pads its tables to."""
    from pagedkv.builder.compare import compare

    orig = export_synthetic(BASE, tmp_path / "orig.onnx")
    rew = tmp_path / "rew.onnx"
    onnx.save(rewrite_model(str(orig), RewriteOptions(dtype=dtype, max_blocks=max_blocks)).model, str(rew))
    atol, rtol = TOLERANCES["bfloat16"]
    report = compare(str(orig), str(rew), backend="trt", prompt_lens=[5, 17, 33], decode_steps=8, chunk_size=8,
                     atol=atol, rtol=rtol)
    assert report.logits_passed and report.greedy_passed, str(report)


@pytest.mark.trt
@pytest.mark.gpu
def test_engine_reports_invalid_pages(rewritten_path, tmp_path):
    from pagedkv.step import KVWriteError

    _, rew = rewritten_path
    engine = build.build_engine(rew, tmp_path / "m.engine", limits=build.BuildLimits(4, 128, 128)).engine
    with TrtExecutor(str(rew), engine=engine, num_blocks=2) as sess:
        sess.step([("a", np.arange(20))])  # two pages of 16
        # sabotage: drop the sequence's second page from the manager's table (a -1 inside the live range)
        sess.manager._tables[0][sess.manager.state("a").row, 1] = -1
        with pytest.raises(KVWriteError):
            sess.step([("a", np.arange(5))])


@pytest.mark.trt
@pytest.mark.gpu
def test_timing_cache_and_serialized_plugins(rewritten_path, tmp_path):
    from pagedkv.builder.inspect_engine import inspect_engine

    _, rew = rewritten_path
    cache = tmp_path / "timing.cache"
    options = build.BuildOptions(builder="tensorrt", timing_cache=cache, serialize_plugins=True)
    first = build.build_engine(rew, tmp_path / "a.engine", limits=SMALL, options=options)
    assert first.timing_cache == cache and cache.stat().st_size > 0
    second = build.build_engine(rew, tmp_path / "b.engine", limits=SMALL, options=options)
    report = inspect_engine(second.engine)
    assert report.ok and report.io_source == "runtime", report.contract + report.problems + report.notes


@pytest.mark.trt
@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_trt_engine_generates_what_the_reference_does(rewritten_path, tmp_path, cuda_graphs):
    """The engine over a TensorRT executor: greedy and seeded tokens follow the reference executor (16-bit
    kernels may flip near-ties, so most, not all, requests must agree), decode steps replay captured CUDA
    graphs (one per bucket of sequences and block-table width), and nothing stays allocated."""
    import numpy as np

    from pagedkv.runtime import Engine, OrtExecutor, SamplingParams, SchedulerConfig
    from pagedkv.runtime.executor import PAD_SEQUENCE
    from pagedkv.runtime.trt import TrtExecutor

    _, rew = rewritten_path
    engine_path = build.build_engine(rew, tmp_path / "m.engine", limits=SMALL).engine
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, BASE.vocab, n) for n in (5, 17, 33, 12, 3)]
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, seed=9)]
    outs = {}
    for name in ("reference", "trt"):
        ex = (OrtExecutor(str(rew), num_blocks=64) if name == "reference" else
              TrtExecutor(str(rew), engine=engine_path, num_blocks=64, cuda_graphs=cuda_graphs))
        with ex:
            engine = Engine(ex, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=8))
            reqs = [engine.add_request((i, j), p, sp) for i, p in enumerate(prompts) for j, sp in enumerate(params)]
            engine.run()
            outs[name] = [r.output for r in reqs]
            if name == "trt":
                assert (ex.num_graphs > 0) == cuda_graphs
                assert set(ex.manager.sequences) <= {PAD_SEQUENCE}  # only the padding rows' blocks stay held
    same = sum(a == b for a, b in zip(outs["reference"], outs["trt"]))
    assert same >= len(outs["trt"]) // 2, outs


@pytest.mark.trt
@pytest.mark.gpu
def test_trt_executor_refuses_an_engine_of_another_graph(rewritten_path, tmp_path):
    from pagedkv.runtime.graph import GraphError
    from pagedkv.runtime.trt import TrtExecutor

    _, rew = rewritten_path
    engine_path = build.build_engine(rew, tmp_path / "m.engine",
                                   limits=build.BuildLimits(max_batch=4, max_tokens=64, max_context=128)).engine
    other = tmp_path / "other.onnx"
    import onnx

    onnx.save(rewrite_model(str(rewritten_path[0]), RewriteOptions(sampling=False)).model, str(other))
    with pytest.raises(GraphError, match="differ from the rewritten graph's"):
        TrtExecutor(str(other), engine=engine_path, num_blocks=4)
