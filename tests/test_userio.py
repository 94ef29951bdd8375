"""pagedkv.userio: usage errors, input checks, atomic outputs, the verb runner."""

from __future__ import annotations

import argparse

import pytest

from pagedkv.userio import (EXIT_FAILED, EXIT_USAGE, UsageError, atomic_output, check_float, check_input_file,
                            check_int, parse_int_list, run_verb)


@pytest.mark.parametrize("value, kwargs, message", [
    ("0", dict(low=1), "page_size: expected >= 1, got 0"),
    ("x", dict(low=1), "page_size: expected an integer, got 'x'"),
    (5000, dict(low=1, high=256), "page_size: expected a value in [1, 256], got 5000"),
    (2.5, dict(), "page_size: expected an integer, got 2.5"),
])
def test_check_int_names_field_and_value(value, kwargs, message):
    with pytest.raises(UsageError) as err:
        check_int("page_size", value, **kwargs)
    assert str(err.value) == message


def test_check_int_accepts_in_range():
    assert check_int("n", "7", low=1, high=7) == 7


@pytest.mark.parametrize("value, message", [
    ("nan", "k_scale: expected a finite number, got 'nan'"),
    ("inf", "k_scale: expected a finite number, got 'inf'"),
    ("0", "k_scale: expected > 0, got 0"),
    ("-1", "k_scale: expected > 0, got -1"),
])
def test_check_float_rejects_non_finite_and_out_of_range(value, message):
    with pytest.raises(UsageError) as err:
        check_float("k_scale", value, low=0.0, low_open=True)
    assert str(err.value) == message


def test_parse_int_list_names_the_element():
    assert parse_int_list("prompt_lens", "5, 17,33", low=1) == [5, 17, 33]
    with pytest.raises(UsageError, match=r"prompt_lens\[1\]: expected >= 1, got -3"):
        parse_int_list("prompt_lens", "5,-3", low=1)
    with pytest.raises(UsageError, match="expected comma-separated integers"):
        parse_int_list("prompt_lens", "5,,3")


def test_check_input_file(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        check_input_file(tmp_path / "missing.onnx")
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(UsageError, match="is empty"):
        check_input_file(tmp_path / "empty.onnx")
    with pytest.raises(UsageError, match="is a directory"):
        check_input_file(tmp_path)


def test_atomic_output_renames_only_when_complete(tmp_path):
    out = tmp_path / "new" / "dir" / "model.onnx"
    with atomic_output(out) as tmp:
        tmp.write_bytes(b"model")
        (tmp.parent / "model.onnx.data").write_bytes(b"weights")
        assert not out.exists()
    assert out.read_bytes() == b"model"
    assert not (out.parent / "model.onnx.data").exists()  # not declared as a companion: dropped
    with atomic_output(out, companions=["model.onnx.data"]) as tmp:
        tmp.write_bytes(b"model2")
        (tmp.parent / "model.onnx.data").write_bytes(b"weights")
    assert (out.parent / "model.onnx.data").read_bytes() == b"weights"
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx", "model.onnx.data"]


def test_atomic_output_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "model.onnx"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_output(out) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_keeps_the_old_file_on_failure(tmp_path):
    out = tmp_path / "model.onnx"
    out.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_output(out) as tmp:
            tmp.write_bytes(b"new")
            raise RuntimeError("boom")
    assert out.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]


def test_atomic_output_refuses_an_input(tmp_path):
    src = tmp_path / "model.onnx"
    src.write_bytes(b"original")
    with pytest.raises(UsageError, match="is also an input"):
        with atomic_output(tmp_path / "." / "model.onnx", inputs=[src]):
            pass
    assert src.read_bytes() == b"original"


def test_run_verb_exit_codes_and_one_line(capsys):
    def usage(args):
        raise UsageError("page_size: expected >= 1, got 0")

    def broken(args):
        raise RuntimeError("engine build failed:\n  details")

    assert run_verb("rewrite", usage, argparse.Namespace()) == EXIT_USAGE
    assert capsys.readouterr().err == "pagedkv rewrite: page_size: expected >= 1, got 0\n"
    assert run_verb("build", broken, argparse.Namespace()) == EXIT_FAILED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "engine build failed: details" in err and "Traceback" not in err
    with pytest.raises(RuntimeError):
        run_verb("build", broken, argparse.Namespace(debug=True))


def test_onnx_io_load_says_what_the_file_is(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from pagedkv.onnx_io import load as load_onnx

    text = tmp_path / "notes.onnx"
    text.write_text("not a model\n")
    with pytest.raises(UsageError, match=r"^model: '.*notes.onnx' is not an ONNX model \(it does not parse"):
        load_onnx(text, "model")
    hollow = tmp_path / "hollow.onnx"
    onnx.save(onnx.ModelProto(), str(hollow))
    with pytest.raises(UsageError, match="is empty|no graph nodes"):
        load_onnx(hollow, "model")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])
    good = tmp_path / "relu.onnx"
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph), str(good))
    assert [n.op_type for n in load_onnx(good).graph.node] == ["Relu"]


@pytest.mark.parametrize("message, expected", [
    ("page_size: expected a value in [1, 4096], got 0", "--page-size: expected a value in [1, 4096], got 0"),
    ("host_blocks[0]: must be >= 0, got -1", "--host-blocks: must be >= 0, got -1"),
    ("cache_dtype=int8: needs K and V scales", "cache_dtype=int8: needs K and V scales"),  # not a bare field
    ("rewritten graph: no logits output", "rewritten graph: no logits output"),
])
def test_option_error_names_the_option(message, expected):
    from pagedkv.userio import option_error

    assert str(option_error(ValueError(message))) == expected


def test_print_json_names_enums_and_unpacks_dataclasses(capsys):
    import json

    import numpy as np

    from pagedkv.layout import KVLayout, PageLayout
    from pagedkv.userio import print_json

    print_json({"layout": KVLayout(2, 2, 16, 64), "mode": PageLayout.NHD, "n": np.int32(3), "a": np.arange(2)})
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["page_layout"] == "hnd" and out["layout"]["page_size"] == 16
    assert out["mode"] == "nhd" and out["n"] == 3 and out["a"] == [0, 1]
