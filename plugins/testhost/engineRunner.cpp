#include "engineRunner.h"

#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>

#include "pagedkv/runtime/engine.h"
#include "pluginsExecutor.h"
#include "tensorSpec.h"

namespace testhost {

namespace rt = pagedkv::runtime;

namespace {

std::vector<float> readFloats(std::string const& path) {
    std::string const raw = readFile(path);
    if (raw.size() % sizeof(float) != 0) throw std::runtime_error(path + ": not a float32 array");
    std::vector<float> v(raw.size() / sizeof(float));
    std::memcpy(v.data(), raw.data(), raw.size());
    return v;
}

template <typename T>
void writeArray(std::string const& path, T const* data, size_t count) {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<char const*>(data), std::streamsize(count * sizeof(T)));
    if (!out) throw std::runtime_error("cannot write " + path);
}

int32_t intOr(Json const& j, char const* key, int32_t fallback) {
    return j.has(key) ? int32_t(j.at(key).asInt()) : fallback;
}

Json ints(std::vector<int32_t> const& v) {
    Json a = Json::array();
    for (int32_t x : v) a.push(x);
    return a;
}

// The real rows of the step just run: its engine inputs (before decode padding) and every layer's q and output.
void dumpStep(PluginsExecutor const& ex, rt::StepShape const& shape, std::string const& dir) {
    mkdir(dir.c_str(), 0755);
    rt::StepInputBuffers const& in = ex.stepInputs();
    int32_t const T = shape.numTokens, B = shape.numSeqs;
    writeArray(dir + "/input_ids.bin", in.inputIds, T);
    writeArray(dir + "/cu_q_lens.bin", in.cuQLens, B + 1);
    writeArray(dir + "/past_lens.bin", in.pastLens, B);
    writeArray(dir + "/block_table.bin", in.blockTables[0], size_t(B) * shape.tableWidth[0]);
    for (int32_t l = 0; l < ex.model().numLayers; ++l) {
        std::vector<uint16_t> const q = ex.readQ(l, T), out = ex.readOut(l, T);
        writeArray(dir + "/q" + std::to_string(l) + ".bin", q.data(), q.size());
        writeArray(dir + "/out" + std::to_string(l) + ".bin", out.data(), out.size());
    }
}

}  // namespace

Json runEngine(PluginLibrary& library, Json const& plan, std::string const& planDir, std::string const& outDir) {
    auto path = [&](std::string const& file) { return file.rfind('/', 0) == 0 ? file : planDir + "/" + file; };
    Json const& m = plan.at("model");
    PluginsModel model;
    model.numLayers = int32_t(m.at("layers").asInt());
    model.vocab = int32_t(m.at("vocab").asInt());
    model.qkvWidth = int32_t(m.at("qkv_width").asInt());
    model.maxPosition = int32_t(m.at("max_position").asInt());
    model.ioType = dataTypeFromName(m.at("io_type").asString());
    model.tokenRows = readFloats(path(m.at("token_rows").asString()));
    model.positionRows = readFloats(path(m.at("position_rows").asString()));
    model.writeAttrs = m.at("write_attrs").items();
    model.attentionAttrs = m.at("attention_attrs").items();

    Json const& g = plan.at("group");
    rt::PoolGroupParams gp;
    gp.name = "g0";
    gp.numLayers = int32_t(g.at("num_layers").asInt());
    gp.numKVHeads = int32_t(g.at("num_kv_heads").asInt());
    gp.pageSize = int32_t(g.at("page_size").asInt());
    gp.headDim = int32_t(g.at("head_dim").asInt());
    gp.pageLayout = static_cast<pagedkv::PageLayout>(intOr(g, "page_layout", 0));
    gp.cacheDType = static_cast<pagedkv::CacheDType>(intOr(g, "cache_dtype", 0));

    Json const& lim = plan.at("limits");
    rt::StepLimits limits;
    limits.maxTokens = int32_t(lim.at("max_tokens").asInt());
    limits.maxSeqs = limits.maxRows = int32_t(lim.at("max_seqs").asInt());
    limits.maxPenaltyWidth = 1;
    limits.maxBlocks = {int32_t(lim.at("max_blocks").asInt())};

    rt::DeviceOptions options;
    options.numBlocks = {plan.at("num_blocks").asInt()};
    if (int64_t const host = plan.has("host_blocks") ? plan.at("host_blocks").asInt() : 0; host > 0)
        options.hostBlocks = {host};
    options.prefixReuse = plan.at("prefix_reuse").asBool();
    options.cudaGraphs = plan.at("cuda_graphs").asBool();

    Json const& s = plan.at("scheduler");
    rt::EngineConfig config;
    config.scheduler.maxNumSeqs = int32_t(s.at("max_num_seqs").asInt());
    config.scheduler.maxNumBatchedTokens = int32_t(s.at("max_num_batched_tokens").asInt());
    config.scheduler.chunkSize = int32_t(s.at("chunk_size").asInt());
    std::string const preemption = s.has("preemption") ? s.at("preemption").asString() : "recompute";
    if (preemption != "recompute" && preemption != "swap") throw std::runtime_error("preemption: recompute or swap");
    config.scheduler.preemption = preemption == "swap" ? rt::Preemption::kSwap : rt::Preemption::kRecompute;

    PluginsExecutor executor(library, std::move(model), {rt::makePoolGroup(gp)}, limits, options);
    rt::Engine engine(executor, config);

    Json steps = Json::array();
    std::map<int64_t, Json> done;
    Json report = Json::object();
    int64_t const maxSteps = plan.at("max_steps").asInt();
    std::vector<Json> const& requests = plan.at("requests").items();
    try {
        for (int64_t step = 0; step < maxSteps; ++step) {
            for (Json const& r : requests) {
                if (r.at("arrival").asInt() != step) continue;
                std::vector<int32_t> prompt;
                for (Json const& t : r.at("prompt").items()) prompt.push_back(int32_t(t.asInt()));
                rt::SamplingParams params;
                params.maxNewTokens = int32_t(r.at("max_new_tokens").asInt());
                engine.addRequest(r.at("id").asInt(), std::move(prompt), params);
            }
            if (!engine.beginStep()) continue;
            rt::ScheduledStep const& scheduled = engine.scheduledStep();
            Json ids = Json::array();
            for (rt::Request const* r : scheduled.decodes) ids.push(Json(int64_t(r->id)));
            for (auto const& [r, n] : scheduled.prefills) ids.push(Json(int64_t(r->id)));
            rt::StepShape const shape = engine.stepShape();
            rt::StepOutputs outputs;
            try {
                outputs = executor.execute(shape);
            } catch (...) {
                engine.cancelStep();
                throw;
            }
            dumpStep(executor, shape, outDir + "/step" + std::to_string(step));
            steps.push(Json::object()
                           .set("step", Json(step))
                           .set("request_ids", ids)
                           .set("num_decodes", int64_t(scheduled.decodes.size()))
                           .set("decode_only", shape.decodeOnly)
                           .set("enqueues", executor.lastEnqueues())
                           .set("num_tokens", shape.numTokens)
                           .set("table_width", shape.tableWidth[0]));
            engine.endStep(outputs);
            executor.kv().validate();  // the KV manager's invariants after every step
            for (auto& r : engine.takeFinished())
                done[r->id] = Json::object().set("output", ints(r->output)).set("finish_reason",
                                                                               rt::finishReasonName(r->finishReason));
        }
        report.set("ok", !engine.hasUnfinished());
        if (engine.hasUnfinished()) report.set("error", "requests unfinished after max_steps");
    } catch (std::exception const& e) {
        report.set("ok", false).set("error", e.what());
    }
    Json finished = Json::object();
    for (auto const& [id, r] : done) finished.set(std::to_string(id), r);
    rt::SchedulerStats const& st = engine.scheduler().stats();
    rt::GroupStats const kv = executor.kv().stats(0);
    return report.set("steps", steps)
        .set("requests", finished)
        .set("graphs", executor.numGraphs())
        .set("graphs_off", executor.graphsOffReason())
        .set("stats", Json::object()
                          .set("steps", Json(st.steps))
                          .set("preemptions", Json(st.preemptions))
                          .set("swaps_out", Json(st.swapsOut))
                          .set("swaps_in", Json(st.swapsIn))
                          .set("prefix_tokens_reused", Json(st.prefixTokensReused)))
        .set("kv", Json::object()
                       .set("num_blocks", kv.numBlocks)
                       .set("num_free", kv.numFree)
                       .set("held_by_executor", Json(executor.heldBlocks(0)))
                       .set("host_free", kv.hostFree)
                       .set("host_blocks", kv.hostBlocks));
}

}  // namespace testhost
