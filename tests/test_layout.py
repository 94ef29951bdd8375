"""The KV-layout contract (src/pagedkv/layout.py) against independent formulations, and the C++ header
(plugins/include/pagedkv/kv_layout.h) against its Python twin through the C API entries pagedkv_kv_layout
(makeKVLayout: the derived strides, shift and bubble) and pagedkv_layout_locate (the address function)."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import _lib
from pagedkv.kernels import _structs
from pagedkv.layout import INVALID_BLOCK, CacheDType, KVLayout, PageLayout, attends, log2_if_pow2

PROPERTY = settings(max_examples=60, deadline=None)


# ---- independent models ---------------------------------------------------------------------------------
def model_slot(pos: int, page_size: int, sinks: int, cyclic_len: int) -> int:
    """Ring model: sinks keep slots [0, sinks); the ring starts at the first page boundary at or after the
    sinks and position p >= sinks lives at ring_start + (p - sinks) mod cyclic_len."""
    if cyclic_len == 0 or pos < sinks:
        return pos
    ring_start = -(-sinks // page_size) * page_size
    return ring_start + (pos - sinks) % cyclic_len


def model_locate(row, pos: int, num_blocks: int, page_size: int, sinks: int, cyclic_len: int):
    slot = model_slot(pos, page_size, sinks, cyclic_len)
    page, offset = slot // page_size, slot % page_size
    raw = int(row[page]) if page < len(row) else INVALID_BLOCK
    return (raw if 0 <= raw < num_blocks else INVALID_BLOCK), offset, raw


def model_elem(layout: KVLayout, num_blocks: int, block: int, layer: int, kv: int, head: int, offset: int) -> int:
    """numpy's own flat index of (block, layer, kv, head, offset, 0) in an array of pool_shape."""
    index = ((block, layer, kv, head, offset, 0) if layout.page_layout == PageLayout.HND
             else (block, layer, kv, offset, head, 0))
    return int(np.ravel_multi_index(index, layout.pool_shape(num_blocks)))


@st.composite
def geometries(draw):
    page_size = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16, 24, 32, 48, 64]))
    cyclic = draw(st.booleans())
    return KVLayout(
        num_layers=draw(st.integers(1, 3)),
        num_kv_heads=draw(st.integers(1, 5)),
        page_size=page_size,
        head_dim=draw(st.sampled_from([1, 3, 8, 64, 128])),
        page_layout=draw(st.sampled_from(list(PageLayout))),
        ring_sink_tokens=draw(st.integers(0, 2 * page_size + 3)) if cyclic else 0,
        cyclic_len=page_size * draw(st.integers(1, 4)) if cyclic else 0,
    )


@st.composite
def located_cases(draw):
    layout = draw(geometries())
    num_blocks = draw(st.integers(1, 12))
    # entries: valid ids, the -1 sentinel, ids past the pool, other negatives
    row = draw(st.lists(st.integers(-3, num_blocks + 2), min_size=0, max_size=8))
    span = max(1, (len(row) + 2) * layout.page_size + layout.ring_sink_tokens + layout.cyclic_len)
    positions = draw(st.lists(st.integers(0, 3 * span), min_size=1, max_size=40))
    return layout, num_blocks, np.array(row, dtype=np.int32), np.array(positions, dtype=np.int32)


# ---- mapping ------------------------------------------------------------------------------------------
@PROPERTY
@given(located_cases())
def test_token_slot_matches_ring_model(case):
    layout, _, _, positions = case
    expected = [model_slot(int(p), layout.page_size, layout.ring_sink_tokens, layout.cyclic_len) for p in positions]
    np.testing.assert_array_equal(layout.token_slot(positions), expected)


@PROPERTY
@given(located_cases())
def test_locate_matches_model(case):
    layout, num_blocks, row, positions = case
    block, offset, raw = layout.locate(row, positions, num_blocks)
    for i, pos in enumerate(positions):
        want = model_locate(row, int(pos), num_blocks, layout.page_size, layout.ring_sink_tokens, layout.cyclic_len)
        assert (int(block[i]), int(offset[i]), int(raw[i])) == want, f"position {pos}"


@PROPERTY
@given(geometries(), st.integers(0, 400))
def test_slots_used_and_pages_needed_match_ring_model(layout, length):
    slots = [model_slot(p, layout.page_size, layout.ring_sink_tokens, layout.cyclic_len) for p in range(length)]
    used = max(slots) + 1 if slots else 0
    assert int(layout.slots_used(length)) == used
    assert int(layout.pages_needed(length)) == -(-used // layout.page_size)
    # every slot a position maps to lies inside the pages the sequence is given
    assert all(s // layout.page_size < int(layout.pages_needed(length)) for s in slots)


def test_bubble_aligns_ring_to_a_page():
    layout = KVLayout(1, 1, page_size=4, head_dim=8, ring_sink_tokens=6, cyclic_len=8)
    assert layout.bubble_len == 2  # sinks fill slots 0..5, slots 6, 7 are the bubble
    np.testing.assert_array_equal(layout.token_slot(np.arange(16)),
                                  [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9])
    assert KVLayout(1, 1, page_size=4, head_dim=8, ring_sink_tokens=8, cyclic_len=8).bubble_len == 0
    # a linear cache has no sinks, whatever was asked
    assert KVLayout(1, 1, page_size=4, head_dim=8, ring_sink_tokens=3, cyclic_len=0).ring_sink_tokens == 0


@pytest.mark.parametrize("page_size", [1, 2, 4, 16, 64, 128])
def test_pow2_shift_path_matches_divmod_path(page_size):
    layout = KVLayout(2, 2, page_size, 64)
    assert layout.page_shift == log2_if_pow2(page_size) == int(np.log2(page_size))
    divmod_layout = dataclasses.replace(layout)
    object.__setattr__(divmod_layout, "page_shift", -1)  # force the general path on the same geometry
    slots = np.arange(0, 50 * page_size + 7)
    shift_page, shift_off = layout.slot_to_page(slots)
    div_page, div_off = divmod_layout.slot_to_page(slots)
    np.testing.assert_array_equal(shift_page, div_page)
    np.testing.assert_array_equal(shift_off, div_off)
    np.testing.assert_array_equal(shift_page, slots // page_size)


@pytest.mark.parametrize("page_size", [3, 24, 48, 100])
def test_non_pow2_pages_take_the_divmod_path(page_size):
    layout = KVLayout(1, 1, page_size, 64)
    assert layout.page_shift == -1
    page, off = layout.slot_to_page(np.arange(5 * page_size))
    np.testing.assert_array_equal(page * page_size + off, np.arange(5 * page_size))


# ---- addresses ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_layout", list(PageLayout))
@pytest.mark.parametrize("cache_dtype", [CacheDType.FP16, CacheDType.BF16, CacheDType.FP8_E4M3, CacheDType.INT8])
@pytest.mark.parametrize("geometry", [(1, 1, 16, 64), (3, 4, 24, 128), (2, 8, 5, 256)], ids=str)
def test_strides_are_numpys_strides_of_pool_shape(page_layout, cache_dtype, geometry):
    layout = KVLayout(*geometry, page_layout=page_layout)
    dtype = cache_dtype.numpy_dtype
    assert dtype.itemsize == cache_dtype.itemsize
    strides = np.array(np.empty(layout.pool_shape(7), dtype=dtype).strides) // dtype.itemsize
    if page_layout == PageLayout.HND:
        want = (layout.stride_block, layout.stride_layer, layout.stride_kv, layout.stride_head, layout.stride_token, 1)
    else:
        want = (layout.stride_block, layout.stride_layer, layout.stride_kv, layout.stride_token, layout.stride_head, 1)
    assert tuple(int(s) for s in strides) == want
    assert layout.pool_elements(7) == int(np.prod(layout.pool_shape(7)))


@PROPERTY
@given(geometries(), st.data())
def test_elem_offset_matches_ravel_multi_index(layout, data):
    num_blocks = data.draw(st.integers(1, 9))
    block = data.draw(st.integers(0, num_blocks - 1))
    layer = data.draw(st.integers(0, layout.num_layers - 1))
    kv = data.draw(st.integers(0, 1))
    head = data.draw(st.integers(0, layout.num_kv_heads - 1))
    offset = data.draw(st.integers(0, layout.page_size - 1))
    assert int(layout.elem_offset(block, layer, kv, head, offset)) == model_elem(
        layout, num_blocks, block, layer, kv, head, offset)


def test_attends_matches_plain_loop_definition():
    q_pos, kv_pos = np.arange(40), np.arange(40)
    for window, sinks in [(0, 0), (0, 5), (1, 0), (7, 0), (7, 3), (100, 2)]:
        got = attends(q_pos[:, None], kv_pos[None, :], window, sinks)
        for i in q_pos:
            for j in kv_pos:
                want = j <= i and (window <= 0 or i - j < window or j < sinks)
                assert bool(got[i, j]) == want, (window, sinks, i, j)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_layers=0), "num_layers"), (dict(num_kv_heads=-1), "num_kv_heads"), (dict(page_size=0), "page_size"),
    (dict(head_dim=0), "head_dim"), (dict(ring_sink_tokens=-1, cyclic_len=16), "ring_sink_tokens"),
    (dict(cyclic_len=20), "cyclic_len"), (dict(cyclic_len=-16), "cyclic_len"),
])
def test_invalid_geometry_names_the_field(kwargs, field):
    args = dict(num_layers=1, num_kv_heads=1, page_size=16, head_dim=64) | kwargs
    with pytest.raises(ValueError, match=field):
        KVLayout(**args)


# ---- C++ header vs Python twin (C API) ------------------------------------------------------------------
def _capi_locate():
    lib = _lib.capi()  # raises FileNotFoundError naming the searched directories when the library is missing
    fn = lib.pagedkv_layout_locate
    i32, i64 = ctypes.c_int32, ctypes.c_int64
    p32, p64 = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64)
    fn.argtypes = [ctypes.c_void_p, p32, i32, i64, i32, i32, i32, p32, i32, p64, p32, p64]
    fn.restype = i32
    return fn


def _ptr(a: np.ndarray, ctype):
    return a.ctypes.data_as(ctypes.POINTER(ctype))


def cpp_layout(layout: KVLayout):
    """The C++ makeKVLayout of the same geometry (pagedkv_kv_layout), as its ctypes mirror."""
    return _structs.kv_layout(layout)


def cpp_locate(layout: KVLayout, row: np.ndarray, num_blocks: int, layer: int, kv: int, head: int,
               positions: np.ndarray):
    """Returns (rc, block, offset, elem) as computed by the C++ helpers."""
    n = positions.size
    row_buf = np.zeros(max(row.size, 1), dtype=np.int32)  # never NULL, even for an empty row
    row_buf[:row.size] = row
    pos = np.ascontiguousarray(positions, dtype=np.int32)
    out_block = np.full(n, -7, dtype=np.int64)
    out_offset = np.full(n, -7, dtype=np.int32)
    out_elem = np.full(n, -7, dtype=np.int64)
    rc = _capi_locate()(ctypes.byref(cpp_layout(layout)), _ptr(row_buf, ctypes.c_int32), row.size, num_blocks, layer,
                        kv, head, _ptr(pos, ctypes.c_int32), n, _ptr(out_block, ctypes.c_int64),
                        _ptr(out_offset, ctypes.c_int32), _ptr(out_elem, ctypes.c_int64))
    return rc, out_block, out_offset, out_elem


@PROPERTY
@given(geometries())
def test_cpp_make_kv_layout_matches_python_twin(layout):
    c = cpp_layout(layout)
    assert (c.numLayers, c.numKVHeads, c.pageSize, c.headDim, c.pageLayout, c.ringSinkTokens, c.cyclicLen) == (
        layout.num_layers, layout.num_kv_heads, layout.page_size, layout.head_dim, int(layout.page_layout),
        layout.ring_sink_tokens, layout.cyclic_len)
    assert (c.pageShift, c.bubbleLen) == (layout.page_shift, layout.bubble_len)
    assert (c.strideBlock, c.strideLayer, c.strideKV, c.strideHead, c.strideToken) == (
        layout.stride_block, layout.stride_layer, layout.stride_kv, layout.stride_head, layout.stride_token)


@PROPERTY
@given(located_cases(), st.data())
def test_cpp_header_matches_python_twin(case, data):
    layout, num_blocks, row, positions = case
    layer = data.draw(st.integers(0, layout.num_layers - 1))
    kv = data.draw(st.integers(0, 1))
    head = data.draw(st.integers(0, layout.num_kv_heads - 1))
    rc, c_block, c_offset, c_elem = cpp_locate(layout, row, num_blocks, layer, kv, head, positions)
    assert rc == 0
    block, offset, _ = layout.locate(row, positions, num_blocks)
    valid = block != INVALID_BLOCK
    elem = np.where(valid, layout.elem_offset(np.where(valid, block, 0), layer, kv, head, offset), -1)
    np.testing.assert_array_equal(c_block, block)
    np.testing.assert_array_equal(c_offset, offset)
    np.testing.assert_array_equal(c_elem, elem)


def test_cpp_header_sees_every_kind_of_bad_entry():
    """A fixed case with each bad-entry kind, so the property test above cannot pass by never drawing them."""
    layout = KVLayout(2, 3, page_size=24, head_dim=64, page_layout=PageLayout.NHD)
    row = np.array([4, -1, 9, -2, 0], dtype=np.int32)  # NB = 5: entry 9 is past the pool, -2 is out of range
    positions = np.array([0, 23, 24, 47, 48, 71, 72, 95, 96, 119, 120, 500], dtype=np.int32)
    rc, c_block, c_offset, c_elem = cpp_locate(layout, row, 5, layer=1, kv=1, head=2, positions=positions)
    assert rc == 0
    np.testing.assert_array_equal(c_block, [4, 4, -1, -1, -1, -1, -1, -1, 0, 0, -1, -1])
    np.testing.assert_array_equal(c_offset, positions % 24)
    block, offset, raw = layout.locate(row, positions, 5)
    np.testing.assert_array_equal(c_block, block)
    np.testing.assert_array_equal(raw, [4, 4, -1, -1, 9, 9, -2, -2, 0, 0, -1, -1])
    assert c_elem[0] == model_elem(layout, 5, 4, 1, 1, 2, 0)
    assert np.all(c_elem[block == INVALID_BLOCK] == -1)


@pytest.mark.parametrize("geometry, field", [
    (dict(page_size=0), "page_size=0"), (dict(cyclic_len=20), "cyclic_len=20"),
    (dict(ring_sink_tokens=-1, cyclic_len=16), "ring_sink_tokens=-1"), (dict(num_kv_heads=0), "num_kv_heads=0"),
    (dict(num_layers=-2), "num_layers=-2"), (dict(head_dim=0), "head_dim=0"), (dict(page_layout=2), "page_layout=2")])
def test_cpp_rejects_what_python_rejects(geometry, field):
    args = dict(num_layers=1, num_kv_heads=1, page_size=16, head_dim=64, page_layout=0, ring_sink_tokens=0,
                cyclic_len=0) | geometry
    with pytest.raises(ValueError, match=field.split("=")[0]):
        KVLayout(**args)
    lib = _lib.capi()
    lib.pagedkv_kv_layout.argtypes = [ctypes.c_int32] * 7 + [ctypes.c_void_p]
    out = _structs.struct("KVLayout")()
    rc = lib.pagedkv_kv_layout(*args.values(), ctypes.byref(out))
    assert rc != 0
    assert lib.pagedkv_last_error().decode().startswith(field + ": expected")
