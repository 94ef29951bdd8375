// C API of the fused QKV write: flat args -> pagedkv::QKVWriteParams (RopeConfig -> computeRopeParams,
// makeKVLayout) -> pagedkv::launchQKVWrite. A thin wrapper: all kernel-parameter validation is the
// launcher's; this file only checks what it needs to build the parameters (ABI size, pool geometry, RoPE
// config), naming the field and the value.
#include "capi_write.h"

#include <cstddef>
#include <string>

#include "../kernels/launch_common.h"
#include "../kernels/qkv_write_params.cuh"
#include "pagedkv/kv_layout.h"
#include "pagedkv/qkv_write.h"

namespace {

using namespace pagedkv;

std::string str(int64_t v) { return std::to_string(v); }

// makeKVLayout reports only "invalid"; name the offending field first.
cudaError_t buildLayout(PagedKVQKVWriteArgs const& a, KVLayout& out) {
    PKV_REQUIRE(a.num_layers > 0, "num_layers", a.num_layers, "> 0");
    PKV_REQUIRE(a.num_kv_heads > 0, "num_kv_heads", a.num_kv_heads, "> 0");
    PKV_REQUIRE(a.page_size > 0, "page_size", a.page_size, "> 0");
    PKV_REQUIRE(a.head_dim > 0, "head_dim", a.head_dim, "one of 64, 128, 256");
    PKV_REQUIRE(a.page_layout == 0 || a.page_layout == 1, "page_layout", a.page_layout, "0 (HND) or 1 (NHD)");
    PKV_REQUIRE(a.ring_sink_tokens >= 0, "ring_sink_tokens", a.ring_sink_tokens, ">= 0");
    PKV_REQUIRE(a.cyclic_len >= 0 && a.cyclic_len % a.page_size == 0, "cyclic_len", a.cyclic_len,
                "0 or a positive multiple of page_size=" + str(a.page_size));
    PKV_REQUIRE(makeKVLayout(a.num_layers, a.num_kv_heads, a.page_size, a.head_dim,
                             static_cast<PageLayout>(a.page_layout), a.ring_sink_tokens, a.cyclic_len, out),
                "page_size", a.page_size, "a pool geometry makeKVLayout accepts");
    return cudaSuccess;
}

cudaError_t buildParams(PagedKVQKVWriteArgs const& a, QKVWriteParams& p) {
    p = QKVWriteParams{};
    p.numQHeads = a.num_q_heads;
    p.numKVHeads = a.num_kv_heads;
    p.headDim = a.head_dim;
    p.ioDType = static_cast<IODType>(a.io_dtype);
    p.qkv = a.qkv;
    p.bias = a.bias;
    p.positionIds = a.position_ids;
    p.meta.poolDescs = a.pool_descs;
    p.meta.poolIndex = a.pool_index;
    p.meta.blockTable = a.block_table;
    p.meta.maxBlocks = a.max_blocks;
    p.meta.cuQLens = a.cu_q_lens;
    p.meta.pastLens = a.past_lens;
    p.meta.numSeqs = a.num_seqs;
    p.meta.numTokens = a.num_tokens;
    cudaError_t err = buildLayout(a, p.layout);
    if (err != cudaSuccess) return err;
    p.cacheDType = static_cast<CacheDType>(a.cache_dtype);
    p.layer = a.layer_index;
    p.kScale = a.k_scale;
    p.vScale = a.v_scale;
    RopeConfig rope;
    rope.style = static_cast<RopeStyle>(a.rope_style);
    rope.rotaryDim = a.rope_rotary_dim;
    rope.theta = a.rope_theta;
    rope.scaling = static_cast<RopeScaling>(a.rope_scaling);
    rope.factor = a.rope_factor;
    rope.lowFreqFactor = a.rope_low_freq_factor;
    rope.highFreqFactor = a.rope_high_freq_factor;
    rope.originalMaxPositions = a.rope_original_max_positions;
    if (!computeRopeParams(rope, a.head_dim, p.rope)) return cudaErrorInvalidValue;  // reason recorded
    p.qOut = a.q_out;
    p.qOutFP8 = a.q_out_fp8 != 0;
    p.qScale = a.q_scale;
    p.zeroVTail = a.zero_v_tail != 0;
    p.status = a.status;
    return cudaSuccess;
}

}  // namespace

extern "C" {

int32_t pagedkv_qkv_write(const PagedKVQKVWriteArgs* args, cudaStream_t stream) {
    if (args == nullptr) return pagedkv::invalidArgument("args=0: expected a PagedKVQKVWriteArgs pointer");
    PKV_REQUIRE(args->struct_size == static_cast<int32_t>(sizeof(PagedKVQKVWriteArgs)), "struct_size",
                args->struct_size,
                std::to_string(sizeof(PagedKVQKVWriteArgs)) + " (caller and library disagree on the layout)");
    QKVWriteParams params;
    cudaError_t err = buildParams(*args, params);
    if (err != cudaSuccess) return err;
    return pagedkv::launchQKVWrite(params, stream);
}

int32_t pagedkv_qkv_write_args_size(void) { return static_cast<int32_t>(sizeof(PagedKVQKVWriteArgs)); }

int32_t pagedkv_qkv_write_args_offsets(int64_t* out, int32_t n) {
#define PKV_FIELD_OFFSET(name) static_cast<int64_t>(offsetof(PagedKVQKVWriteArgs, name))
    int64_t const offsets[] = {
        PKV_FIELD_OFFSET(struct_size),     PKV_FIELD_OFFSET(num_q_heads),
        PKV_FIELD_OFFSET(num_kv_heads),    PKV_FIELD_OFFSET(head_dim),
        PKV_FIELD_OFFSET(io_dtype),        PKV_FIELD_OFFSET(num_tokens),
        PKV_FIELD_OFFSET(num_seqs),        PKV_FIELD_OFFSET(max_blocks),
        PKV_FIELD_OFFSET(pool_index),      PKV_FIELD_OFFSET(num_layers),
        PKV_FIELD_OFFSET(layer_index),     PKV_FIELD_OFFSET(page_size),
        PKV_FIELD_OFFSET(page_layout),     PKV_FIELD_OFFSET(ring_sink_tokens),
        PKV_FIELD_OFFSET(cyclic_len),      PKV_FIELD_OFFSET(cache_dtype),
        PKV_FIELD_OFFSET(k_scale),         PKV_FIELD_OFFSET(v_scale),
        PKV_FIELD_OFFSET(rope_style),      PKV_FIELD_OFFSET(rope_rotary_dim),
        PKV_FIELD_OFFSET(rope_theta),      PKV_FIELD_OFFSET(rope_scaling),
        PKV_FIELD_OFFSET(rope_factor),     PKV_FIELD_OFFSET(rope_low_freq_factor),
        PKV_FIELD_OFFSET(rope_high_freq_factor), PKV_FIELD_OFFSET(rope_original_max_positions),
        PKV_FIELD_OFFSET(q_out_fp8),       PKV_FIELD_OFFSET(q_scale),
        PKV_FIELD_OFFSET(zero_v_tail),     PKV_FIELD_OFFSET(reserved0),
        PKV_FIELD_OFFSET(qkv),             PKV_FIELD_OFFSET(bias),
        PKV_FIELD_OFFSET(position_ids),    PKV_FIELD_OFFSET(pool_descs),
        PKV_FIELD_OFFSET(block_table),     PKV_FIELD_OFFSET(cu_q_lens),
        PKV_FIELD_OFFSET(past_lens),       PKV_FIELD_OFFSET(q_out),
        PKV_FIELD_OFFSET(status),
    };
#undef PKV_FIELD_OFFSET
    int32_t const count = static_cast<int32_t>(sizeof(offsets) / sizeof(offsets[0]));
    for (int32_t i = 0; out != nullptr && i < n && i < count; ++i) out[i] = offsets[i];
    return count;
}

int32_t pagedkv_rope_params(int32_t head_dim, int32_t rope_style, int32_t rope_rotary_dim, float rope_theta,
                            int32_t rope_scaling, float rope_factor, float rope_low_freq_factor,
                            float rope_high_freq_factor, int32_t rope_original_max_positions, float* inv_freq_out,
                            int32_t* rotary_dim_out, float* mscale_out) {
    using namespace pagedkv;
    PKV_REQUIRE(inv_freq_out != nullptr && rotary_dim_out != nullptr && mscale_out != nullptr, "inv_freq_out",
                reinterpret_cast<uintptr_t>(inv_freq_out), "non-null outputs");
    RopeConfig cfg;
    cfg.style = static_cast<RopeStyle>(rope_style);
    cfg.rotaryDim = rope_rotary_dim;
    cfg.theta = rope_theta;
    cfg.scaling = static_cast<RopeScaling>(rope_scaling);
    cfg.factor = rope_factor;
    cfg.lowFreqFactor = rope_low_freq_factor;
    cfg.highFreqFactor = rope_high_freq_factor;
    cfg.originalMaxPositions = rope_original_max_positions;
    RopeParams params;
    if (!computeRopeParams(cfg, head_dim, params)) return cudaErrorInvalidValue;  // reason recorded
    for (int32_t i = 0; i < kMaxRotaryPairs; ++i) inv_freq_out[i] = params.invFreq[i];
    *rotary_dim_out = params.rotaryDim;
    *mscale_out = params.mscale;
    return 0;
}

int32_t pagedkv_rope_angles(const float* inv_freq, int32_t num_freqs, const int32_t* positions, int32_t n,
                            float* out) {
    PKV_REQUIRE(num_freqs >= 0 && n >= 0, "num_freqs", num_freqs, ">= 0 (and n >= 0)");
    PKV_REQUIRE((inv_freq != nullptr || num_freqs == 0) && (positions != nullptr || n == 0) &&
                    (out != nullptr || n * num_freqs == 0),
                "out", reinterpret_cast<uintptr_t>(out), "non-null arrays");
    for (int32_t j = 0; j < num_freqs; ++j) {
        uint64_t const turns = pagedkv::ropeTurnsPerPosition(inv_freq[j]);
        for (int32_t i = 0; i < n; ++i)
            out[static_cast<int64_t>(i) * num_freqs + j] = pagedkv::ropeAngle(positions[i], turns);
    }
    return 0;
}

}  // extern "C"
