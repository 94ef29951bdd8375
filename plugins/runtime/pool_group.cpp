// Pool group specs: the checks of pagedkv.kvcache.groups.PoolGroup and of the layout's geometry
// (pagedkv.layout.KVLayout), with the same messages; the geometry itself comes from makeKVLayout.
#include "format.h"
#include "pagedkv/runtime/kv_manager.h"

namespace pagedkv::runtime {

namespace {

[[noreturn]] void bad(std::string const& message) { throw KVArgumentError(message, std::nullopt); }

}  // namespace

PoolGroup makePoolGroup(PoolGroupParams const& p) {
    struct Field {
        char const* name;
        int32_t value;
    };
    for (Field f : {Field{"num_layers", p.numLayers}, Field{"num_kv_heads", p.numKVHeads},
                    Field{"page_size", p.pageSize}, Field{"head_dim", p.headDim}})
        if (f.value <= 0) bad(cat(f.name, ": must be > 0, got ", f.value));
    if (p.ringSinkTokens < 0) bad(cat("ring_sink_tokens: must be >= 0, got ", p.ringSinkTokens));
    if (p.cyclicLen < 0 || (p.cyclicLen && p.cyclicLen % p.pageSize))
        bad(cat("cyclic_len: must be 0 or a positive multiple of page_size=", p.pageSize, ", got ", p.cyclicLen));
    if (p.pageLayout != PageLayout::kHND && p.pageLayout != PageLayout::kNHD)
        bad(cat("page_layout: expected 0 (HND) or 1 (NHD), got ", int32_t(p.pageLayout)));
    int32_t dtype = int32_t(p.cacheDType);
    if (dtype < int32_t(CacheDType::kFP16) || dtype > int32_t(CacheDType::kNVFP4))
        bad(cat("cache_dtype: unknown value ", dtype, "; expected 0 (fp16), 1 (bf16), 2 (fp8_e4m3) or 3 (int8)"));

    PoolGroup s;
    s.name = p.name;
    if (!makeKVLayout(p.numLayers, p.numKVHeads, p.pageSize, p.headDim, p.pageLayout, p.ringSinkTokens, p.cyclicLen,
                      s.layout))
        bad(cat("layout: invalid geometry for group ", quoted(p.name)));  // every case is checked above
    s.cacheDType = p.cacheDType;
    s.window = p.window;
    s.attentionSinks = p.attentionSinks;
    std::string const group = cat("(group ", quoted(s.name), ")");
    if (s.name.empty()) bad("name: a pool group needs a non-empty name");
    if (s.cacheDType == CacheDType::kNVFP4)
        bad(cat("cache_dtype: NVFP4 is reserved in the layout but not implemented ", group));
    if (s.window < 0) bad(cat("window: must be >= 0 (0: full causal), got ", s.window, " ", group));
    if (s.attentionSinks < 0) bad(cat("attention_sinks: must be >= 0, got ", s.attentionSinks, " ", group));
    if (s.attentionSinks && !s.window)
        bad(cat("attention_sinks=", s.attentionSinks, ": only meaningful with a window > 0 ", group));
    KVLayout const& lay = s.layout;
    if (lay.cyclicLen) {
        if (s.window <= 0)
            bad(cat("window: a cyclic pool group (cyclic_len=", lay.cyclicLen, ") needs the attention window > 0, got ",
                    s.window, " ", group));
        if (lay.cyclicLen < s.window)
            bad(cat("cyclic_len=", lay.cyclicLen, " < window=", s.window, ": the ring must hold the window ", group));
        if (s.attentionSinks != lay.ringSinkTokens)
            bad(cat("attention_sinks=", s.attentionSinks, " must equal the layout's ring_sink_tokens=", lay.ringSinkTokens,
                    ": sink positions outside the ring's sinks would be overwritten ", group));
        s.mode = WindowMode::kCyclic;
        s.ringPages =
            int32_t((int64_t(lay.ringSinkTokens) + lay.bubbleLen + lay.cyclicLen + lay.pageSize - 1) / lay.pageSize);
    } else {
        s.mode = s.window > 0 ? WindowMode::kRelease : WindowMode::kFull;
    }
    return s;
}

}  // namespace pagedkv::runtime
