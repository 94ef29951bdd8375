#include <string>

#include "../kernels/launch_common.h"
#include "pagedkv/build_info.h"
#include "pagedkv/capabilities.h"
#include "pagedkv/kv_layout_check.h"
#include "pagedkv/last_error.h"
#include "pagedkv_capi.h"

extern "C" {

int32_t pagedkv_capi_version(void) { return PAGEDKV_CAPI_VERSION; }

const char* pagedkv_build_info(void) {
    static std::string const info = std::string("version=") + PAGEDKV_VERSION +
                                    ";trt_headers_version=" + PAGEDKV_TRT_HEADERS_VERSION +
                                    ";trt_headers_source=" + PAGEDKV_TRT_HEADERS_SOURCE +
                                    ";cuda_architectures=" + PAGEDKV_CUDA_ARCHITECTURES +
                                    ";nvcc=" + PAGEDKV_CUDA_COMPILER_VERSION;
    return info.c_str();
}

const char* pagedkv_last_error(void) { return pagedkv::lastErrorMessage(); }

const char* pagedkv_capabilities(void) { return pagedkv::capabilitiesJson(); }

int32_t pagedkv_kv_layout(int32_t num_layers, int32_t num_kv_heads, int32_t page_size, int32_t head_dim,
                          int32_t page_layout, int32_t ring_sink_tokens, int32_t cyclic_len, pagedkv::KVLayout* out) {
    using namespace pagedkv;
    clearLastError();
    if (out == nullptr) return invalidArgument("out=NULL: expected a KVLayout");
    PageLayout const layout = static_cast<PageLayout>(page_layout);
    if (FieldIssue const bad = checkKVLayoutGeometry(num_layers, num_kv_heads, page_size, head_dim, layout,
                                                     ring_sink_tokens, cyclic_len))
        return invalidField(bad);
    makeKVLayout(num_layers, num_kv_heads, page_size, head_dim, layout, ring_sink_tokens, cyclic_len, *out);
    return 0;
}

int32_t pagedkv_layout_locate(const pagedkv::KVLayout* layout, const int32_t* block_row, int32_t max_blocks,
                              int64_t num_blocks, int32_t layer, int32_t kv, int32_t head, const int32_t* positions,
                              int32_t n, int64_t* out_block, int32_t* out_offset, int64_t* out_elem) {
    using namespace pagedkv;
    clearLastError();
    if (layout == nullptr) return invalidArgument("layout=NULL: expected a KVLayout");
    if (FieldIssue const bad = checkKVLayoutFor(*layout, layout->numKVHeads, layout->headDim, layer))
        return invalidField(bad);
    BlockTableRow row{block_row, max_blocks, num_blocks};
    for (int32_t i = 0; i < n; ++i) {
        KVLocation loc = locateToken(*layout, row, positions[i]);
        out_block[i] = loc.block;
        out_offset[i] = loc.offset;
        out_elem[i] = loc.block == kInvalidBlock ? -1 : layout->elemOffset(loc.block, layer, kv, head, loc.offset);
    }
    return 0;
}

}  // extern "C"
