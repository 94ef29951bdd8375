// Host: THE validation of a pool group's layout (kv_layout.h), shared by the two launchers, the plugins' pool
// attributes and the C API. Each check returns the first bad field, named as the plugin attribute is
// (snake_case: "page_size", "ring_sink_tokens"; a KVLayout's derived members as "layout.stride_block"), with
// its value and what was expected; the caller words the error its own way (launchers: "field=value: expected
// ...", plugins: "field 'field'=value: ...").
#pragma once

#include <cstdint>
#include <string>

#include "pagedkv/kv_layout.h"

namespace pagedkv {

struct FieldIssue {
    std::string field;     // empty: no issue
    int64_t value = 0;
    std::string expected;  // "> 0", "0 or a multiple of page_size=16"

    explicit operator bool() const { return !field.empty(); }
    std::string message() const { return field + "=" + std::to_string(value) + ": expected " + expected; }
};

// The geometry makeKVLayout accepts, field by field (makeKVLayout itself only says yes or no).
FieldIssue checkKVLayoutGeometry(int32_t numLayers, int32_t numKVHeads, int32_t pageSize, int32_t headDim,
                                 PageLayout pageLayout, int32_t ringSinkTokens, int32_t cyclicLen);

// A KVLayout handed to a launcher: a valid geometry whose derived members (page shift, bubble, strides) are
// exactly what makeKVLayout builds from it (kernels trust the strides: a stale or hand-filled layout would
// send reads and writes to the wrong slots); its KV heads and head dim those of the launch, and `layer` one
// of its layers.
FieldIssue checkKVLayoutFor(KVLayout const& layout, int32_t numKVHeads, int32_t headDim, int32_t layer);

}  // namespace pagedkv
