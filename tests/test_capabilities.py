"""The capability table (plugins/include/pagedkv/capabilities.h) is the one source of the supported sets.

Python reads it from the library (``pagedkv.capabilities``); these tests check that what Python believes is
exactly what the C++ checks accept: every value in the table passes the launchers' validation (on the CPU:
validation runs before any CUDA call) and ``pagedkv.config``; values next to the table are refused by both,
with a message naming the field. The plugins' side of the same check is in tests/test_plugin_library.py
(``test_plugins_accept_exactly_*``), the mirrors of the C API structs in tests/test_capi_structs.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import textwrap

import pytest

from pagedkv import _lib
from pagedkv.capabilities import Capabilities, capabilities
from pagedkv.config import AttentionConfig, PoolConfig, WriteConfig
from pagedkv.kernels import attention as A
from pagedkv.kernels import write
from pagedkv.layout import CacheDType

ALIGNED = 1 << 20  # a 16-byte aligned fake device address: validation fails before anything is dereferenced


def _outside(values):
    near = {v + d for v in values for d in (-16, -8, -1, 1, 8, 16)} | {0, max(values) * 2}
    return sorted(v for v in near if v not in values)


def _pool(head_dim=128, **kw):
    return PoolConfig(num_kv_heads=2, head_dim=head_dim, page_size=16, num_layers=1, layer_index=0, **kw)


def _write_params(pool: PoolConfig):
    meta = write.StepPointers(ALIGNED, ALIGNED, ALIGNED, ALIGNED, num_seqs=1, num_tokens=1, max_blocks=1)
    return write.write_params(WriteConfig(num_q_heads=4, pool=pool), write.IODType.FP16, qkv=ALIGNED, q_out=ALIGNED,
                              status=ALIGNED, meta=meta)


def _attention_params(pool: PoolConfig):
    return A.attention_params(AttentionConfig(num_q_heads=4, pool=pool), io_dtype=A.IODType.FP16, num_tokens=1,
                              num_seqs=1, max_blocks=1, max_q_len=1, max_kv_len=16, q=ALIGNED, out=ALIGNED,
                              pool_descs=ALIGNED, block_table=ALIGNED, cu_q_lens=ALIGNED, past_lens=ALIGNED)


def _rejection(launch, params) -> str | None:
    """The launcher's validation message, or None when validation passed (the launch then fails in CUDA:
    no GPU here, or fake pointers; a GPU machine skips the tests that need this)."""
    try:
        launch(params)
    except _lib.CapiError as e:
        return str(e) if "CUDA error 1:" in str(e) else None
    return None


@pytest.fixture(scope="module")
def no_gpu():
    from pagedkv import cuda

    if cuda.why_no_gpu() is None:
        pytest.skip("a GPU is present: launching valid parameters with fake pointers would fault")


def test_the_table_as_python_sees_it():
    caps = capabilities()
    assert isinstance(caps, Capabilities) and caps is capabilities()  # read once
    raw = json.loads(_lib.capi().pagedkv_capabilities().decode())
    assert caps.head_dims == tuple(raw["head_dims"]) and len(caps.head_dims) >= 1
    assert list(caps.head_dims) == sorted(set(caps.head_dims)) and all(d > 0 and d % 8 == 0 for d in caps.head_dims)
    assert 1 <= caps.min_page_size <= caps.max_page_size
    assert CacheDType.NVFP4 not in caps.cache_dtypes and CacheDType.FP16 in caps.cache_dtypes
    assert caps.max_rotary_dim == max(caps.head_dims)  # full rotary of the widest head


@pytest.mark.parametrize("launcher", ["write", "attention"])
def test_launchers_accept_exactly_the_head_dims_of_the_table(no_gpu, launcher):
    launch, make = ((write.launch, _write_params) if launcher == "write" else (A.launch_attention, _attention_params))
    caps = capabilities()
    for d in caps.head_dims:
        assert _rejection(launch, make(_pool(head_dim=d))) is None, d
    params = make(_pool(head_dim=caps.head_dims[0]))
    for d in _outside(caps.head_dims):
        params.headDim = d
        params.layout.headDim = d  # a consistent layout: the head dim itself is what is refused
        message = _rejection(launch, params)
        listed = ", ".join(map(str, caps.head_dims))
        assert message is not None and f"head_dim={d}: expected one of {listed}" in message, (d, message)


@pytest.mark.parametrize("launcher", ["write", "attention"])
def test_launchers_accept_exactly_the_cache_and_io_dtypes_of_the_table(no_gpu, launcher):
    launch, make = ((write.launch, _write_params) if launcher == "write" else (A.launch_attention, _attention_params))
    caps = capabilities()
    for cache in CacheDType:
        params = make(_pool())
        params.cacheDType = int(cache)
        params.ioDType = int(write.IODType.BF16 if cache == CacheDType.BF16 else write.IODType.FP16)
        message = _rejection(launch, params)
        if cache in caps.cache_dtypes:
            assert message is None, (cache, message)
        else:
            assert message is not None and f"cache_dtype={int(cache)}" in message, message
    for io in range(-1, max(caps.io_dtypes) + 2):
        params = make(_pool(cache_dtype=CacheDType.INT8))  # an 8-bit cache takes either I/O dtype
        params.ioDType = io
        message = _rejection(launch, params)
        assert (message is None) == (io in caps.io_dtypes), (io, message)
        if message is not None:
            assert f"io_dtype={io}" in message, message


def test_config_reads_the_table():
    caps = capabilities()
    for d in caps.head_dims:
        AttentionConfig(num_q_heads=4, pool=_pool(head_dim=d))
    for d in _outside(caps.head_dims):
        with pytest.raises(ValueError, match=re.escape(f"head_dim: expected one of {caps.head_dims}, got {d}")):
            AttentionConfig(num_q_heads=4, pool=_pool(head_dim=d))
    for cache in CacheDType:
        if cache in caps.cache_dtypes:
            WriteConfig(num_q_heads=4, pool=_pool(cache_dtype=cache))
        else:
            with pytest.raises(ValueError, match=f"cache_dtype: {cache.name}"):
                WriteConfig(num_q_heads=4, pool=_pool(cache_dtype=cache))


def test_a_missing_library_is_a_clear_error(tmp_path):
    """Without the library the table cannot be read, and the error says where it was looked for."""
    code = textwrap.dedent("""
        import pagedkv._lib as lib
        lib.lib_dirs = lambda: []
        from pagedkv.capabilities import capabilities
        try:
            capabilities()
        except FileNotFoundError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "capability table" in out and "libpagedkv_capi.so not found" in out, out


def test_capabilities_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        capabilities().head_dims = (1,)


def test_config_attribute_ranges_are_the_tables():
    """config.py's ATTRIBUTE_RANGES / SUPPORTED_IO_DTYPES spell out bounds the C++ table owns (their comments say
    which): they must be the table's values, so an edit of capabilities.h that forgets them fails here."""
    from pagedkv.config import ATTRIBUTE_RANGES, SUPPORTED_IO_DTYPES
    from pagedkv.kernels.write import IODType

    caps = capabilities()
    assert ATTRIBUTE_RANGES["num_q_heads"] == ATTRIBUTE_RANGES["num_kv_heads"] == (1, caps.max_heads)
    assert ATTRIBUTE_RANGES["page_size"] == (caps.min_page_size, caps.max_page_size)
    assert ATTRIBUTE_RANGES["num_layers"] == (1, caps.max_layers)
    assert ATTRIBUTE_RANGES["layer_index"] == (0, caps.max_layers - 1)
    assert ATTRIBUTE_RANGES["pool_index"] == (0, caps.max_pools - 1)
    assert ATTRIBUTE_RANGES["rope_rotary_dim"] == (0, caps.max_rotary_dim)
    assert SUPPORTED_IO_DTYPES == tuple(IODType(v).numpy_dtype.name for v in caps.io_dtypes)
    fields = {f.name for cls in (WriteConfig, AttentionConfig) for f in dataclasses.fields(cls)} | \
        {f.name for f in dataclasses.fields(PoolConfig)} | {"rope_rotary_dim", "rope_original_max_positions"}
    assert set(ATTRIBUTE_RANGES) <= fields, "a range names no attribute (a renamed field?)"
