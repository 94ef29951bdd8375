// pagedkv_generate: a TensorRT engine + the plugin library + token-id prompts (JSON lines) -> the generated
// tokens of every prompt and the per-step timings, through libpagedkv_runtime (no Python). docs/deploy-cpp.md
// walks through it. The TensorRT part is written against TensorRT 10.14's documented API and NOT RUN in the
// workplace that wrote it (no GPU, no TensorRT there); what runs there is every check before TensorRT.
//
//   pagedkv_generate --engine model.engine --plugins libpagedkv_plugins.so --groups groups.json
//                    --prompts prompts.jsonl [--max-new-tokens 32] [--kv-fraction 0.5 | --blocks N]
//
// Exit status: 0 done, 1 a runtime error (one line "error: ..."), 2 bad arguments.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "json.h"  // the test host's small JSON reader (plugins/testhost/json.h)
#include "pagedkv/runtime/engine.h"
#include "pagedkv/runtime/trt_engine.h"

namespace rt = pagedkv::runtime;
using testhost::Json;

namespace {

char const* kUsage = R"(usage: pagedkv_generate --engine FILE --plugins FILE --groups FILE --prompts FILE [options]

Generates tokens for token-id prompts with a pagedkv TensorRT engine, without Python.

required:
  --engine FILE          the serialized engine (`pagedkv build`)
  --plugins FILE         libpagedkv_plugins.so (the wheel's pagedkv/lib/ or the build tree's plugins/)
  --groups FILE          the engine's pool groups, a JSON list (docs/deploy-cpp.md): group g = kv_pools row g
  --prompts FILE         JSON lines {"id": ..., "input_ids": [...]} (ids default to the line number)
options:
  --max-new-tokens N     per prompt (default 32)
  --kv-fraction F        KV pools take F of the free device memory (default 0.5)
  --blocks N             KV pools of N blocks per group instead
  --max-num-seqs N       sequences per step (default 64)
  --chunk-size N         prefill tokens of one request per step (default 512)
  --eos ID               stop at this token id (repeatable)
  --no-cuda-graphs       run decode steps eagerly
  --help                 this text
)";

struct UsageError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct Args {
    std::string engine, plugins, groups, prompts;
    int32_t maxNewTokens = 32, maxNumSeqs = 64, chunkSize = 512;
    double kvFraction = 0.5;
    int64_t blocks = 0;
    std::vector<int32_t> eos;
    bool cudaGraphs = true;
};

int64_t integer(std::string const& flag, std::string const& text, int64_t min) {
    char* end = nullptr;
    long long const v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end || v < min)
        throw UsageError(flag + ": expected an integer >= " + std::to_string(min) + ", got '" + text + "'");
    return v;
}

Args parse(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        std::string const flag = argv[i];
        if (flag == "--no-cuda-graphs") {
            a.cudaGraphs = false;
            continue;
        }
        if (i + 1 >= argc) throw UsageError(flag + ": expected a value");
        std::string const v = argv[++i];
        if (flag == "--engine") a.engine = v;
        else if (flag == "--plugins") a.plugins = v;
        else if (flag == "--groups") a.groups = v;
        else if (flag == "--prompts") a.prompts = v;
        else if (flag == "--max-new-tokens") a.maxNewTokens = int32_t(integer(flag, v, 1));
        else if (flag == "--max-num-seqs") a.maxNumSeqs = int32_t(integer(flag, v, 1));
        else if (flag == "--chunk-size") a.chunkSize = int32_t(integer(flag, v, 0));
        else if (flag == "--blocks") a.blocks = integer(flag, v, 1);
        else if (flag == "--eos") a.eos.push_back(int32_t(integer(flag, v, 0)));
        else if (flag == "--kv-fraction") {
            char* end = nullptr;
            a.kvFraction = std::strtod(v.c_str(), &end);
            if (v.empty() || *end || !(a.kvFraction > 0 && a.kvFraction <= 1))
                throw UsageError("--kv-fraction: expected a number in (0, 1], got '" + v + "'");
        } else {
            throw UsageError(flag + ": unknown option (see --help)");
        }
    }
    for (auto [value, flag] : {std::pair{&a.engine, "--engine"}, {&a.plugins, "--plugins"}, {&a.groups, "--groups"},
                               {&a.prompts, "--prompts"}})
        if (value->empty()) throw UsageError(std::string(flag) + ": required (see --help)");
    return a;
}

// The file must exist and be readable (checked before anything else, TensorRT included).
void readable(std::string const& what, std::string const& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error(what + " " + path + ": cannot open it");
}

template <typename E>
E enumOf(Json const& g, char const* key, std::map<std::string, E> const& names, E fallback) {
    Json const* v = g.find(key);
    if (!v) return fallback;
    auto it = names.find(v->asString());
    if (it == names.end()) throw std::runtime_error(std::string("groups: ") + key + " '" + v->asString() + "' unknown");
    return it->second;
}

// [{"name", "num_layers", "num_kv_heads", "page_size", "head_dim", "page_layout": "HND"|"NHD",
//   "cache_dtype": "fp16"|"bf16"|"fp8_e4m3"|"int8", "window", "attention_sinks", "ring_sink_tokens", "cyclic_len"}]
std::vector<rt::PoolGroup> readGroups(std::string const& path) {
    Json const list = Json::parse(testhost::readFile(path));
    if (!list.isArray() || !list.size()) throw std::runtime_error("groups " + path + ": expected a non-empty JSON list");
    std::vector<rt::PoolGroup> out;
    for (Json const& g : list.items()) {
        auto get = [&](char const* key, int64_t fallback = -1) {
            Json const* v = g.find(key);
            if (!v && fallback < 0) throw std::runtime_error("groups " + path + ": a group lacks '" + key + "'");
            return int32_t(v ? v->asInt() : fallback);
        };
        rt::PoolGroupParams p;
        p.name = g.at("name").asString();
        p.numLayers = get("num_layers");
        p.numKVHeads = get("num_kv_heads");
        p.pageSize = get("page_size");
        p.headDim = get("head_dim");
        p.pageLayout = enumOf<pagedkv::PageLayout>(g, "page_layout", {{"HND", pagedkv::PageLayout::kHND},
                                                                      {"NHD", pagedkv::PageLayout::kNHD}},
                                                   pagedkv::PageLayout::kHND);
        p.cacheDType = enumOf<pagedkv::CacheDType>(
            g, "cache_dtype", {{"fp16", pagedkv::CacheDType::kFP16}, {"bf16", pagedkv::CacheDType::kBF16},
                               {"fp8_e4m3", pagedkv::CacheDType::kFP8E4M3}, {"int8", pagedkv::CacheDType::kINT8}},
            pagedkv::CacheDType::kFP16);
        p.window = get("window", 0);
        p.attentionSinks = get("attention_sinks", 0);
        p.ringSinkTokens = get("ring_sink_tokens", 0);
        p.cyclicLen = get("cyclic_len", 0);
        out.push_back(rt::makePoolGroup(p));
    }
    return out;
}

struct Prompt {
    int64_t id;
    std::vector<int32_t> ids;
};

std::vector<Prompt> readPrompts(std::string const& path) {
    std::ifstream in(path);
    std::vector<Prompt> out;
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        std::string const where = "prompts " + path + ":" + std::to_string(n);
        Json record;
        try {
            record = Json::parse(line);
        } catch (std::exception const& e) {
            throw std::runtime_error(where + ": not JSON (" + e.what() + ")");
        }
        Json const* ids = record.isObject() ? record.find("input_ids") : nullptr;
        if (!ids || !ids->isArray() || !ids->size())
            throw std::runtime_error(where + ": expected an object {\"id\": ..., \"input_ids\": [...]}");
        Prompt p{record.has("id") ? record.at("id").asInt() : n, {}};
        for (Json const& t : ids->items()) {
            if (!t.isInteger() || t.asInt() < 0)
                throw std::runtime_error(where + ": input_ids must be a non-empty list of token ids >= 0");
            p.ids.push_back(int32_t(t.asInt()));
        }
        out.push_back(std::move(p));
    }
    if (out.empty()) throw std::runtime_error("prompts " + path + ": no prompt");
    return out;
}

int run(Args const& a) {
    // Everything that needs no GPU first, so that a wrong path is named before TensorRT is looked for.
    readable("engine", a.engine);
    rt::checkPluginLibrary(a.plugins);
    std::vector<rt::PoolGroup> groups = readGroups(a.groups);
    std::vector<Prompt> const prompts = readPrompts(a.prompts);
    std::printf("%s\n", rt::loadTensorRT().c_str());

    rt::TensorRTOptions o;
    o.engine = a.engine;
    o.pluginLibrary = a.plugins;
    o.groups = groups;
    o.device.cudaGraphs = a.cudaGraphs;
    o.device.kvMemoryFraction = a.kvFraction;
    if (a.blocks) o.device.numBlocks.assign(groups.size(), a.blocks);
    std::unique_ptr<rt::DeviceExecutor> executor = rt::openTensorRTEngine(o);

    rt::EngineConfig config;
    config.scheduler.maxNumSeqs = std::min(a.maxNumSeqs, executor->limits().maxSeqs);
    config.scheduler.maxNumBatchedTokens = executor->limits().maxTokens;
    config.scheduler.chunkSize = a.chunkSize;
    config.eosTokenIds = a.eos;
    rt::Engine engine(*executor, config);
    for (Prompt const& p : prompts) {
        rt::SamplingParams params;
        params.maxNewTokens = a.maxNewTokens;
        engine.addRequest(p.id, p.ids, params);
    }
    std::printf("step  seqs  tokens  decode  host_us  execute_us\n");
    for (int64_t n = 0; engine.hasUnfinished(); ++n) {
        engine.step();
        rt::StepShape const& s = engine.stepShape();
        rt::StepTiming const& t = engine.timing();
        std::printf("%4lld  %4d  %6d  %6s  %7.1f  %10.1f\n", static_cast<long long>(n), s.numSeqs, s.numTokens,
                    s.decodeOnly ? "yes" : "no", t.host() * 1e6, t.execute * 1e6);
    }
    for (auto const& r : engine.takeFinished()) {
        std::printf("{\"id\": %lld, \"output_ids\": [", static_cast<long long>(r->id));
        for (size_t i = 0; i < r->output.size(); ++i) std::printf("%s%d", i ? ", " : "", r->output[i]);
        std::printf("]}\n");
    }
    std::printf("CUDA graphs: %d captured%s%s\n", executor->numGraphs(),
                executor->graphsOffReason().empty() ? "" : "; off: ", executor->graphsOffReason().c_str());
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    for (int i = 1; i < argc; ++i)
        if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
            std::fputs(kUsage, stdout);
            return 0;
        }
    try {
        return run(parse(argc, argv));
    } catch (UsageError const& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    } catch (std::exception const& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}
