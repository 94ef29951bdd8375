"""The C++ runtime's deployment checks that need no GPU (``pagedkv.runtime.native``): loading TensorRT at run
time (without it: one clear line), the plugin-library check, the engine-I/O check against the tensors of
rewritten graphs (and broken copies of them), and pool sizing against ``pagedkv.kvcache.sizing``."""

from __future__ import annotations

import ctypes

import numpy as np
import onnx
import pytest
from hypothesis import given, settings, strategies as st

from conftest import built_file
from pagedkv import _lib
from pagedkv import engine_io as io
from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.kvcache import PoolGroup
from pagedkv.kvcache.sizing import blocks_for_budget as py_blocks_for_budget
from pagedkv.layout import CacheDType, KVLayout, PageLayout
from pagedkv.onnx_export.synthetic import SyntheticConfig, make_synthetic_model


@pytest.fixture(autouse=True, scope="module")
def runtime_library():
    """CI builds the runtime library: its absence fails, it is not skipped."""
    built_file(_lib.RUNTIME_NAME)


from pagedkv.runtime import native  # noqa: E402  (after the fixture's import guard)


def _tensorrt_loadable() -> bool:
    try:
        ctypes.CDLL("libnvinfer.so.10")
        return True
    except OSError:
        return False


# ---- TensorRT at run time -----------------------------------------------------------------------------------
def test_tensorrt_is_loaded_at_run_time_or_refused_in_one_line():
    if _tensorrt_loadable():
        assert native.load_tensorrt().startswith("TensorRT 10.")
        return
    with pytest.raises(native.TensorRTUnavailable) as e:
        native.load_tensorrt()
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("TensorRT not found: cannot load libnvinfer.so.10")
    assert "LD_LIBRARY_PATH" in message


# ---- the plugin library -------------------------------------------------------------------------------------
def test_our_plugin_library_passes_the_check():
    native.check_plugin_library(_lib.plugin_library_path())


def test_a_wrong_plugin_library_is_named(tmp_path):
    missing = tmp_path / "libnothere.so"
    with pytest.raises(native.PluginLibraryError, match=rf"plugin library {missing}: cannot load it"):
        native.check_plugin_library(missing)
    capi = _lib.require_file(_lib.CAPI_NAME)  # a shared library, but no TensorRT plugin library
    with pytest.raises(native.PluginLibraryError, match="not a TensorRT plugin library \\(no getCreators\\)"):
        native.check_plugin_library(capi)


# ---- the engine's I/O ---------------------------------------------------------------------------------------
CFG = SyntheticConfig(num_layers=3, hidden=64, vocab=96, intermediate=128)


def _tensors(model: onnx.ModelProto) -> list:
    """(name, is_input, dtype, dims) of a graph's I/O as an engine built from it lists them."""
    out = []
    for values, is_input in ((model.graph.input, True), (model.graph.output, False)):
        for v in values:
            dims = [-1 if d.HasField("dim_param") else d.dim_value for d in v.type.tensor_type.shape.dim]
            out.append((v.name, is_input, onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type), dims))
    return out


@pytest.fixture(scope="module", params=[(RewriteOptions(), 1),
                                        (RewriteOptions(pool_grouping="per_layer", explicit_positions=True,
                                                        max_blocks=24), 3)],
                ids=["one-group", "per-layer-explicit-static-width"])
def rewritten(request):
    options, groups = request.param
    return _tensors(rewrite_model(make_synthetic_model(CFG), options).model), groups, options


def test_a_rewritten_graphs_io_passes_and_says_what_the_engine_computes(rewritten):
    tensors, groups, options = rewritten
    model, found = native.check_engine_io(tensors, groups)
    assert found == groups
    assert model == {"vocab": CFG.vocab, "num_top_logprobs": min(options.top_logprobs, CFG.vocab),
                     "explicit_positions": int(bool(options.explicit_positions)),
                     "static_max_blocks": options.max_blocks or 0, "num_layers": CFG.num_layers}
    assert native.check_engine_io(list(reversed(tensors)), -1)[1] == groups  # order does not matter


def _replace(tensors, name, **fields):
    i = [t[0] for t in tensors].index(name)
    t = dict(zip(("name", "is_input", "dtype", "dims"), tensors[i]), **fields)
    return tensors[:i] + [(t["name"], t["is_input"], t["dtype"], t["dims"])] + tensors[i + 1:]


@pytest.mark.parametrize("breakage,expected", [
    (lambda t: [x for x in t if x[0] != io.PAST_LENS], "past_lens: missing"),
    (lambda t: [x for x in t if x[0] != io.status_name(1)], "kv_write_status_1: missing"),
    (lambda t: t + [("extra", True, np.int32, [4])], "extra: not a tensor of the engine-I/O contract"),
    (lambda t: _replace(t, io.CU_Q_LENS, dtype=np.int64), "cu_q_lens: dtype INT64, expected INT32"),
    (lambda t: _replace(t, io.LOGITS, dtype=np.int32), "logits: dtype INT32, expected FLOAT, HALF or BF16"),
    (lambda t: _replace(t, io.NEXT_TOKENS, is_input=True), "next_tokens: an input, expected an output"),
    (lambda t: _replace(t, io.INPUT_IDS, dims=[-1]), "input_ids: shape [?] of rank 1, expected rank 2"),
    (lambda t: _replace(t, io.INPUT_IDS, dims=[2, -1]), "input_ids: shape [2, ?], expected dim 0 = 1"),
    (lambda t: _replace(t, io.LOGITS, dims=[1, -1, -1]), "logits: dim 2 (vocab) is dynamic, expected static"),
    (lambda t: [x for x in t if x[0] not in io.SAMPLING_INPUTS + io.SAMPLING_OUTPUTS], "no sampling head"),
], ids=["missing", "family-gap", "extra", "dtype", "model-dtype", "direction", "rank", "static-dim",
        "dynamic-vocab", "no-sampling"])
def test_an_engine_that_differs_is_refused_naming_the_difference(rewritten, breakage, expected):
    tensors, groups, _ = rewritten
    with pytest.raises(native.EngineMismatchError) as e:
        native.check_engine_io(breakage(tensors), groups)
    message = str(e.value)
    assert message.startswith("the engine does not match the engine-I/O contract (engine_io.h): ")
    assert expected in message
    assert "\n" not in message


def test_the_deploy_configs_pool_groups_must_match(rewritten):
    tensors, groups, _ = rewritten
    with pytest.raises(native.EngineMismatchError, match=rf"the engine has {groups} pool group\(s\) "
                                                          rf"\(block_table_0..{groups - 1}\), its deploy config "
                                                          rf"{groups + 1}"):
        native.check_engine_io(tensors, groups + 1)


def test_a_model_in_half_or_bf16_passes(rewritten):
    tensors, groups, _ = rewritten
    for dtype in (np.float16, "bfloat16"):
        assert native.check_engine_io(_replace(tensors, io.LOGITS, dtype=dtype), groups)[1] == groups


# ---- pool sizing --------------------------------------------------------------------------------------------
_GROUPS = [PoolGroup("a", KVLayout(2, 2, 16, 64)), PoolGroup("b", KVLayout(1, 4, 8, 128, page_layout=PageLayout.NHD),
                                                             cache_dtype=CacheDType.FP8_E4M3)]


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(0, 1 << 34), which=st.sampled_from([[0], [1], [0, 1]]),
       shares=st.one_of(st.none(), st.floats(0, 1)))
def test_blocks_for_budget_equals_python(budget, which, shares):
    groups = [_GROUPS[i] for i in which]
    split = None if shares is None or len(groups) == 1 else [shares, 1.0 - shares]
    try:
        expected = py_blocks_for_budget(groups, budget, split)
    except ValueError as e:
        with pytest.raises(ValueError) as got:
            native.blocks_for_budget(groups, budget, split)
        assert str(got.value) == str(e)
        return
    assert native.blocks_for_budget(groups, budget, split) == expected


def test_blocks_for_budget_refusals_read_like_python():
    for shares in ([0.5], [0.7, 0.7], [float("nan"), 1.0]):
        with pytest.raises(ValueError) as py:
            py_blocks_for_budget(_GROUPS, 1 << 30, shares)
        with pytest.raises(ValueError) as cpp:
            native.blocks_for_budget(_GROUPS, 1 << 30, shares)
        assert str(cpp.value) == str(py.value)
