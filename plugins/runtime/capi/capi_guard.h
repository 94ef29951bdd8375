// What the runtime's C entries share (kv_capi.cpp, runtime_capi.cpp): the KV manager handle (owning, or borrowed
// from an engine), guarded(), which runs an entry's body and turns each exception type into a status code
// plus the thread-local error record of pagedkv_kv_last_error(), and the reading of pool group descriptions.
#pragma once

#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "pagedkv/runtime/engine.h"
#include "pagedkv/runtime/kv_capi.h"
#include "pagedkv/runtime/kv_manager.h"
#include "pagedkv/runtime/trt_engine.h"

struct pagedkv_kv_manager {
    std::unique_ptr<pagedkv::runtime::KVManager> owned;  // null: borrowed from an engine (pagedkv_rt_engine_kv)
    pagedkv::runtime::KVManager* manager = nullptr;
    pagedkv::runtime::StepPlan plan;
};

namespace pagedkv::runtime::capi {

struct ErrorState {
    pagedkv_kv_error record{};
    std::string message, group, what, check, detail, expected, found;

    void reset(int32_t code, std::string msg) {
        record = pagedkv_kv_error{};
        record.code = code;
        message = std::move(msg);
        group.clear();
        what.clear();
        check.clear();
        detail.clear();
        expected.clear();
        found.clear();
    }
    void point() {
        record.message = message.c_str();
        record.group = group.c_str();
        record.what = what.c_str();
        record.check = check.c_str();
        record.detail = detail.c_str();
        record.expected = expected.c_str();
        record.found = found.c_str();
    }
};

inline thread_local ErrorState tlsError;

inline void noteSeq(KVCacheError const& e) {
    if (e.seq) {
        tlsError.record.has_seq = 1;
        tlsError.record.seq = *e.seq;
    }
}

// Run `body`, mapping each exception type to its status (the most derived first).
template <typename F>
int32_t guarded(F&& body) {
    try {
        body();
        return PAGEDKV_KV_OK;
    } catch (KVCacheExhaustedError const& e) {
        tlsError.reset(PAGEDKV_KV_EXHAUSTED, e.what());
        noteSeq(e);
        tlsError.record.needed = e.needed;
        tlsError.record.free = e.free;
        tlsError.record.tier = int32_t(e.tier);
        tlsError.group = e.group;
        tlsError.what = e.operation;
    } catch (BlockRefcountError const& e) {
        tlsError.reset(PAGEDKV_KV_REFCOUNT, e.what());
        tlsError.record.has_block = 1;
        tlsError.record.block = e.block;
        tlsError.record.refcount = e.refcount;
    } catch (KVInvariantError const& e) {
        tlsError.reset(PAGEDKV_KV_INVARIANT, e.what());
        noteSeq(e);
        tlsError.group = e.group;
        tlsError.check = e.check;
        tlsError.detail = e.detail;
        tlsError.expected = e.expected;
        tlsError.found = e.found;
        if (e.block) {
            tlsError.record.has_block = 1;
            tlsError.record.block = *e.block;
        }
        if (e.page) {
            tlsError.record.has_page = 1;
            tlsError.record.page = *e.page;
        }
    } catch (UnknownSequenceError const& e) {
        tlsError.reset(PAGEDKV_KV_UNKNOWN_SEQUENCE, e.what());
        noteSeq(e);
    } catch (KVArgumentError const& e) {
        tlsError.reset(PAGEDKV_KV_INVALID_ARGUMENT, e.what());
        noteSeq(e);
    } catch (ContextLengthError const& e) {
        tlsError.reset(PAGEDKV_KV_CONTEXT_LENGTH, e.what());
    } catch (KVWriteError const& e) {
        tlsError.reset(PAGEDKV_KV_WRITE_STATUS, e.what());
        tlsError.record.has_seq = 1;
        tlsError.record.seq = e.seq;
        tlsError.record.has_page = 1;
        tlsError.record.page = e.page;
        tlsError.record.has_block = 1;
        tlsError.record.block = e.entry;
    } catch (TensorRTUnavailable const& e) {
        tlsError.reset(PAGEDKV_KV_TENSORRT_UNAVAILABLE, e.what());
    } catch (PluginLibraryError const& e) {
        tlsError.reset(PAGEDKV_KV_PLUGIN_LIBRARY, e.what());
    } catch (EngineMismatchError const& e) {
        tlsError.reset(PAGEDKV_KV_ENGINE_MISMATCH, e.what());
    } catch (std::invalid_argument const& e) {
        tlsError.reset(PAGEDKV_KV_INVALID_ARGUMENT, e.what());
    } catch (std::length_error const& e) {
        tlsError.reset(PAGEDKV_KV_INVALID_ARGUMENT, e.what());
    } catch (std::bad_alloc const&) {
        tlsError.reset(PAGEDKV_KV_INTERNAL, "out of host memory");
    } catch (std::exception const& e) {
        tlsError.reset(PAGEDKV_KV_INTERNAL, e.what());
    } catch (...) {
        tlsError.reset(PAGEDKV_KV_INTERNAL, "unknown C++ exception");
    }
    tlsError.point();
    return tlsError.record.code;
}

inline void need(void const* p, char const* what) {
    if (!p) throw KVArgumentError(std::string(what) + ": null pointer", std::nullopt);
}

// The pool groups of `num_groups` descriptions (checked by makePoolGroup) with their block counts.
struct GroupDescs {
    std::vector<PoolGroup> groups;
    std::vector<int64_t> numBlocks, hostBlocks;
};

inline GroupDescs readGroupDescs(pagedkv_kv_group_desc const* descs, int32_t num_groups) {
    if (num_groups > 0) need(descs, "groups");
    GroupDescs out;
    for (int32_t g = 0; g < num_groups; ++g) {
        pagedkv_kv_group_desc const& d = descs[g];
        PoolGroupParams p;
        p.name = d.name ? d.name : "";
        p.numLayers = d.num_layers;
        p.numKVHeads = d.num_kv_heads;
        p.pageSize = d.page_size;
        p.headDim = d.head_dim;
        p.pageLayout = PageLayout(d.page_layout);
        p.ringSinkTokens = d.ring_sink_tokens;
        p.cyclicLen = d.cyclic_len;
        p.cacheDType = CacheDType(d.cache_dtype);
        p.window = d.window;
        p.attentionSinks = d.attention_sinks;
        out.groups.push_back(makePoolGroup(p));
        out.numBlocks.push_back(d.num_blocks);
        out.hostBlocks.push_back(d.host_blocks);
    }
    return out;
}

}  // namespace pagedkv::runtime::capi
