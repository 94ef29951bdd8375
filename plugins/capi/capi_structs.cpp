// pagedkv_struct_layouts(): every struct the C API takes or fills, described field by field for bindings that
// build their mirrors from the library (src/pagedkv/kernels/_structs.py) instead of copying them by hand.
//
// Each struct's field list below is checked against the struct at compile time (listsEveryField): the fields
// must follow one another as the C++ layout rules place them and end at sizeof, so a member added to a
// struct (or reordered, or retyped) without its entry here fails the build instead of shifting a binding.
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "capi_attention.h"
#include "capi_write.h"
#include "pagedkv/attention.h"
#include "pagedkv/kv_layout.h"
#include "pagedkv/qkv_write.h"
#include "pagedkv/step_metadata.h"
#include "pagedkv_capi.h"

namespace {

using namespace pagedkv;

struct FieldDesc {
    char const* name;
    size_t offset;
    size_t size;   // of the whole member (all elements of an array)
    size_t align;
    char const* type;  // i32, i64, u64, f32, bool, ptr, or a described struct's name
    size_t count;      // array elements; 0 for a scalar
};

template <typename T>
struct TypeName;
template <> struct TypeName<int32_t> { static constexpr char const* value = "i32"; };
template <> struct TypeName<int64_t> { static constexpr char const* value = "i64"; };
template <> struct TypeName<uint64_t> { static constexpr char const* value = "u64"; };
template <> struct TypeName<float> { static constexpr char const* value = "f32"; };
template <> struct TypeName<bool> { static constexpr char const* value = "bool"; };
template <> struct TypeName<KVLayout> { static constexpr char const* value = "KVLayout"; };
template <> struct TypeName<StepMetadata> { static constexpr char const* value = "StepMetadata"; };
template <> struct TypeName<RopeParams> { static constexpr char const* value = "RopeParams"; };
static_assert(std::is_same_v<size_t, uint64_t>, "size_t fields are described as u64");

template <typename T>
constexpr char const* typeName() {
    using E = std::remove_all_extents_t<T>;
    if constexpr (std::is_pointer_v<E>) {
        return "ptr";
    } else if constexpr (std::is_enum_v<E>) {
        return TypeName<std::underlying_type_t<E>>::value;
    } else {
        return TypeName<E>::value;
    }
}

#define PKV_FIELD(S, f)                                                                                  \
    FieldDesc {                                                                                          \
        #f, offsetof(S, f), sizeof(S::f), alignof(std::remove_all_extents_t<decltype(S::f)>),            \
            typeName<decltype(S::f)>(), std::extent_v<decltype(S::f)>                                    \
    }

template <typename S, size_t N>
constexpr bool listsEveryField(FieldDesc const (&fields)[N]) {
    static_assert(std::is_standard_layout_v<S> && std::is_trivially_copyable_v<S>, "C API structs are PODs");
    size_t end = 0;
    for (size_t i = 0; i < N; ++i) {
        size_t const start = (end + fields[i].align - 1) / fields[i].align * fields[i].align;
        if (fields[i].offset != start) return false;
        end = start + fields[i].size;
    }
    return (end + alignof(S) - 1) / alignof(S) * alignof(S) == sizeof(S);
}

constexpr FieldDesc kKVLayout[] = {
    PKV_FIELD(KVLayout, numLayers),   PKV_FIELD(KVLayout, numKVHeads),     PKV_FIELD(KVLayout, pageSize),
    PKV_FIELD(KVLayout, headDim),     PKV_FIELD(KVLayout, pageShift),      PKV_FIELD(KVLayout, pageLayout),
    PKV_FIELD(KVLayout, ringSinkTokens), PKV_FIELD(KVLayout, cyclicLen),   PKV_FIELD(KVLayout, bubbleLen),
    PKV_FIELD(KVLayout, strideBlock), PKV_FIELD(KVLayout, strideLayer),    PKV_FIELD(KVLayout, strideKV),
    PKV_FIELD(KVLayout, strideHead),  PKV_FIELD(KVLayout, strideToken),
};
constexpr FieldDesc kStepMetadata[] = {
    PKV_FIELD(StepMetadata, poolDescs), PKV_FIELD(StepMetadata, poolIndex), PKV_FIELD(StepMetadata, blockTable),
    PKV_FIELD(StepMetadata, maxBlocks), PKV_FIELD(StepMetadata, cuQLens),   PKV_FIELD(StepMetadata, pastLens),
    PKV_FIELD(StepMetadata, numSeqs),   PKV_FIELD(StepMetadata, numTokens),
};
constexpr FieldDesc kRopeConfig[] = {
    PKV_FIELD(RopeConfig, style),         PKV_FIELD(RopeConfig, rotaryDim),      PKV_FIELD(RopeConfig, theta),
    PKV_FIELD(RopeConfig, scaling),       PKV_FIELD(RopeConfig, factor),         PKV_FIELD(RopeConfig, lowFreqFactor),
    PKV_FIELD(RopeConfig, highFreqFactor), PKV_FIELD(RopeConfig, originalMaxPositions),
};
constexpr FieldDesc kRopeParams[] = {
    PKV_FIELD(RopeParams, style), PKV_FIELD(RopeParams, rotaryDim), PKV_FIELD(RopeParams, mscale),
    PKV_FIELD(RopeParams, invFreq),
};
constexpr FieldDesc kQKVWriteParams[] = {
    PKV_FIELD(QKVWriteParams, numQHeads), PKV_FIELD(QKVWriteParams, numKVHeads), PKV_FIELD(QKVWriteParams, headDim),
    PKV_FIELD(QKVWriteParams, ioDType),   PKV_FIELD(QKVWriteParams, qkv),        PKV_FIELD(QKVWriteParams, bias),
    PKV_FIELD(QKVWriteParams, positionIds), PKV_FIELD(QKVWriteParams, meta),     PKV_FIELD(QKVWriteParams, layout),
    PKV_FIELD(QKVWriteParams, cacheDType), PKV_FIELD(QKVWriteParams, layer),     PKV_FIELD(QKVWriteParams, kScale),
    PKV_FIELD(QKVWriteParams, vScale),    PKV_FIELD(QKVWriteParams, rope),       PKV_FIELD(QKVWriteParams, qOut),
    PKV_FIELD(QKVWriteParams, qOutFP8),   PKV_FIELD(QKVWriteParams, qScale),     PKV_FIELD(QKVWriteParams, zeroVTail),
    PKV_FIELD(QKVWriteParams, status),
};
constexpr FieldDesc kAttentionParams[] = {
    PKV_FIELD(AttentionParams, numQHeads),    PKV_FIELD(AttentionParams, numKVHeads),
    PKV_FIELD(AttentionParams, headDim),      PKV_FIELD(AttentionParams, ioDType),
    PKV_FIELD(AttentionParams, qFP8),         PKV_FIELD(AttentionParams, qScale),
    PKV_FIELD(AttentionParams, q),            PKV_FIELD(AttentionParams, meta),
    PKV_FIELD(AttentionParams, maxQLen),      PKV_FIELD(AttentionParams, maxKVLen),
    PKV_FIELD(AttentionParams, layout),       PKV_FIELD(AttentionParams, cacheDType),
    PKV_FIELD(AttentionParams, layer),        PKV_FIELD(AttentionParams, kScale),
    PKV_FIELD(AttentionParams, vScale),       PKV_FIELD(AttentionParams, window),
    PKV_FIELD(AttentionParams, attentionSinks), PKV_FIELD(AttentionParams, softmaxScale),
    PKV_FIELD(AttentionParams, logitSoftcap), PKV_FIELD(AttentionParams, out),
    PKV_FIELD(AttentionParams, workspace),    PKV_FIELD(AttentionParams, workspaceBytes),
};
constexpr FieldDesc kPlanInfo[] = {
    PKV_FIELD(PagedKVAttentionPlanInfo, run_decode),       PKV_FIELD(PagedKVAttentionPlanInfo, run_multi),
    PKV_FIELD(PagedKVAttentionPlanInfo, run_merge),        PKV_FIELD(PagedKVAttentionPlanInfo, decode_grid),
    PKV_FIELD(PagedKVAttentionPlanInfo, multi_grid),       PKV_FIELD(PagedKVAttentionPlanInfo, merge_grid),
    PKV_FIELD(PagedKVAttentionPlanInfo, decode_chunk_len), PKV_FIELD(PagedKVAttentionPlanInfo, multi_chunk_len),
    PKV_FIELD(PagedKVAttentionPlanInfo, partial_chunks),   PKV_FIELD(PagedKVAttentionPlanInfo, max_span),
    PKV_FIELD(PagedKVAttentionPlanInfo, workspace_bytes),
};
constexpr FieldDesc kKernelShapes[] = {
    PKV_FIELD(PagedKVAttentionKernelShapes, decode_threads), PKV_FIELD(PagedKVAttentionKernelShapes, decode_smem_bytes),
    PKV_FIELD(PagedKVAttentionKernelShapes, multi_threads),  PKV_FIELD(PagedKVAttentionKernelShapes, multi_smem_bytes),
};
#undef PKV_FIELD

static_assert(listsEveryField<KVLayout>(kKVLayout), "kKVLayout does not list KVLayout's members in order");
static_assert(listsEveryField<StepMetadata>(kStepMetadata), "kStepMetadata does not list StepMetadata's members");
static_assert(listsEveryField<RopeConfig>(kRopeConfig), "kRopeConfig does not list RopeConfig's members");
static_assert(listsEveryField<RopeParams>(kRopeParams), "kRopeParams does not list RopeParams' members");
static_assert(listsEveryField<QKVWriteParams>(kQKVWriteParams), "kQKVWriteParams does not list its members");
static_assert(listsEveryField<AttentionParams>(kAttentionParams), "kAttentionParams does not list its members");
static_assert(listsEveryField<PagedKVAttentionPlanInfo>(kPlanInfo), "kPlanInfo does not list its members");
static_assert(listsEveryField<PagedKVAttentionKernelShapes>(kKernelShapes), "kKernelShapes does not list its members");

template <typename S, size_t N>
std::string describe(char const* name, FieldDesc const (&fields)[N]) {
    std::string out = std::string("\"") + name + "\":{\"size\":" + std::to_string(sizeof(S)) +
                      ",\"align\":" + std::to_string(alignof(S)) + ",\"fields\":[";
    for (size_t i = 0; i < N; ++i) {
        FieldDesc const& f = fields[i];
        out += std::string(i ? "," : "") + "{\"name\":\"" + f.name + "\",\"type\":\"" + f.type +
               "\",\"offset\":" + std::to_string(f.offset) + ",\"size\":" + std::to_string(f.size) +
               (f.count ? ",\"count\":" + std::to_string(f.count) : "") + "}";
    }
    return out + "]}";
}

}  // namespace

extern "C" const char* pagedkv_struct_layouts(void) {
    static std::string const json = "{" + describe<KVLayout>("KVLayout", kKVLayout) + "," +
                                    describe<StepMetadata>("StepMetadata", kStepMetadata) + "," +
                                    describe<RopeConfig>("RopeConfig", kRopeConfig) + "," +
                                    describe<RopeParams>("RopeParams", kRopeParams) + "," +
                                    describe<QKVWriteParams>("QKVWriteParams", kQKVWriteParams) + "," +
                                    describe<AttentionParams>("AttentionParams", kAttentionParams) + "," +
                                    describe<PagedKVAttentionPlanInfo>("PagedKVAttentionPlanInfo", kPlanInfo) + "," +
                                    describe<PagedKVAttentionKernelShapes>("PagedKVAttentionKernelShapes",
                                                                           kKernelShapes) +
                                    "}";
    return json.c_str();
}
