"""The C API's structs are the launchers' own (plugins/include/pagedkv/*.h); Python's ctypes mirrors are built
from the library's description of them (pagedkv_struct_layouts, pagedkv.kernels._structs), never by hand.

The C++ side checks at compile time that each description lists every member in order (capi_structs.cpp);
here: every described struct builds with the library's offsets, size and alignment, and a description that
ctypes would lay out differently is refused instead of shifting fields.
"""

from __future__ import annotations

import copy
import ctypes
import json

import pytest

from pagedkv import _lib
from pagedkv.kernels import _structs

EXPECTED = {"KVLayout", "StepMetadata", "RopeConfig", "RopeParams", "QKVWriteParams", "AttentionParams",
            "PagedKVAttentionPlanInfo", "PagedKVAttentionKernelShapes"}


def _descriptions() -> dict:
    return json.loads(_lib.capi().pagedkv_struct_layouts().decode())


def test_every_struct_the_capi_takes_is_described_and_builds():
    desc = _descriptions()
    assert set(desc) == EXPECTED
    for name, d in desc.items():
        struct = _structs.struct(name)
        assert ctypes.sizeof(struct) == d["size"] and ctypes.alignment(struct) == d["align"]
        assert [f for f, _ in struct._fields_] == [f["name"] for f in d["fields"]]
        assert [getattr(struct, f["name"]).offset for f in d["fields"]] == [f["offset"] for f in d["fields"]]
        assert _structs.struct(name) is struct  # built once: nested mirrors are the same types


def test_nested_structs_are_shared_and_arrays_keep_their_length():
    write_params, attention_params = _structs.struct("QKVWriteParams"), _structs.struct("AttentionParams")
    fields = dict(write_params._fields_)
    assert fields["layout"] is dict(attention_params._fields_)["layout"] is _structs.struct("KVLayout")
    assert fields["meta"] is _structs.struct("StepMetadata")
    inv_freq = dict(_structs.struct("RopeParams")._fields_)["invFreq"]
    assert issubclass(inv_freq, ctypes.Array) and inv_freq._length_ == 128 and inv_freq._type_ is ctypes.c_float


@pytest.mark.parametrize("doctor", ["offset", "size", "type"])
def test_a_layout_ctypes_would_not_reproduce_is_refused(doctor):
    desc = copy.deepcopy(_descriptions())
    fields = desc["KVLayout"]["fields"]
    if doctor == "offset":
        fields[3]["offset"] += 4  # as if the library had a member ctypes does not know of
    elif doctor == "size":
        desc["KVLayout"]["size"] += 8
    else:
        fields[-1]["type"] = "i32"  # strideToken is int64 in the library
    with pytest.raises(RuntimeError, match="KVLayout: ctypes lays it out as"):
        _structs.build_struct("KVLayout", desc)


def test_set_fields_reaches_nested_members_and_refuses_unknown_ones():
    params = _structs.struct("AttentionParams")()
    _structs.set_fields(params, {"headDim": 96, "layout.pageSize": 24, "meta.numTokens": 7})
    assert (params.headDim, params.layout.pageSize, params.meta.numTokens) == (96, 24, 7)
    # ctypes would quietly add a Python attribute for a misspelt member; a launch test would then test nothing
    with pytest.raises(AttributeError, match="KVLayout has no member 'page_size'"):
        _structs.set_fields(params, {"layout.page_size": 0})
