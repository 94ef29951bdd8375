#include "enqueueRunner.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <vector>

#include "checks.h"
#include "exprBuilder.h"
#include "tensorSpec.h"

namespace testhost {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;
using nvinfer1::TensorRTPhase;

namespace {

void checkCuda(cudaError_t err, std::string const& what) {
    if (err != cudaSuccess) throw std::runtime_error(what + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

struct DeviceBuffer {
    void* ptr = nullptr;
    size_t bytes = 0;
    DeviceBuffer() = default;
    explicit DeviceBuffer(size_t n) : bytes(n) { checkCuda(cudaMalloc(&ptr, n > 0 ? n : 1), "cudaMalloc"); }
    DeviceBuffer(DeviceBuffer const&) = delete;
    DeviceBuffer& operator=(DeviceBuffer const&) = delete;
    ~DeviceBuffer() {
        if (ptr) cudaFree(ptr);
    }
};

struct DeviceTensor {
    DataType type;
    Dims dims;
    std::unique_ptr<DeviceBuffer> buffer;
};

std::vector<uint8_t> readBytes(std::string const& path) {
    std::string const s = readFile(path);
    return std::vector<uint8_t>(s.begin(), s.end());
}

void writeBytes(std::string const& path, void const* data, size_t n) {
    std::ofstream out(path, std::ios::binary);
    out.write(static_cast<char const*>(data), static_cast<std::streamsize>(n));
    if (!out) throw std::runtime_error("cannot write " + path);
}

std::unique_ptr<DeviceBuffer> upload(std::vector<uint8_t> const& host) {
    auto buf = std::make_unique<DeviceBuffer>(host.size());
    if (!host.empty()) checkCuda(cudaMemcpy(buf->ptr, host.data(), host.size(), cudaMemcpyHostToDevice), "upload");
    return buf;
}

Dims jsonDims(Json const& j) {
    Dims d{};
    d.nbDims = static_cast<int32_t>(j.size());
    for (size_t i = 0; i < j.size(); ++i) d.d[i] = j.items()[i].asInt();
    return d;
}

}  // namespace

// One plugin step, as an engine runs it. Output tensors are added to `tensors` under the step's output names.
Json runStep(PluginLibrary& library, Json const& step, std::map<std::string, DeviceTensor>& tensors,
             cudaStream_t stream) {
    Json r = Json::object().set("plugin", step.at("plugin").asString());
    nvinfer1::IPluginCreatorV3One* creator = library.creator(step.at("plugin").asString());
    FieldSet fields = fieldSetOf(creator, step);
    PluginPtr build(creator->createPlugin("layer", fields.get(), TensorRTPhase::kBUILD));
    if (!build) {
        return r.set("stage", "createPlugin(build)").set("ok", false);
    }
    Capabilities caps = capabilitiesOf(build.get());
    if (caps.core == nullptr || caps.build == nullptr || caps.runtime == nullptr) {
        return r.set("stage", "getCapabilityInterface").set("capabilities", caps.report).set("ok", false);
    }
    auto tensorNamed = [&tensors](std::string const& name) -> DeviceTensor const& {
        auto it = tensors.find(name);
        if (it == tensors.end()) throw std::runtime_error("plan: no tensor named '" + name + "' (yet)");
        return it->second;
    };
    std::vector<std::string> inNames, outNames;
    for (Json const& n : step.at("inputs").items()) inNames.push_back(n.asString());
    for (Json const& n : step.at("outputs").items()) outNames.push_back(n.asString());
    int32_t const nbIn = static_cast<int32_t>(inNames.size());
    int32_t const nbOut = caps.build->getNbOutputs();
    if (nbOut != static_cast<int32_t>(outNames.size())) {
        return r.set("stage", "getNbOutputs").set("nb_outputs", nbOut).set("ok", false);
    }
    std::vector<DataType> inTypes, outTypes(nbOut);
    std::vector<Dims> inDims, outDims(nbOut);
    HostExprBuilder builder;
    std::vector<DimsExprs> inExprs, outExprs(nbOut);
    for (std::string const& n : inNames) {
        DeviceTensor const& t = tensorNamed(n);
        inTypes.push_back(t.type);
        inDims.push_back(t.dims);
        DimsExprs e{};
        e.nbDims = t.dims.nbDims;
        for (int32_t i = 0; i < t.dims.nbDims; ++i) e.d[i] = builder.constant(t.dims.d[i]);
        inExprs.push_back(e);
    }
    int32_t rc = caps.build->getOutputDataTypes(outTypes.data(), nbOut, inTypes.data(), nbIn);
    if (rc == 0) rc = caps.build->getOutputShapes(inExprs.data(), nbIn, nullptr, 0, outExprs.data(), nbOut, builder);
    if (rc != 0) {
        return r.set("stage", "getOutputDataTypes/getOutputShapes").set("ok", false);
    }
    for (int32_t o = 0; o < nbOut; ++o) {
        if (outExprs[o].nbDims < 0 || outExprs[o].nbDims > Dims::MAX_DIMS) {
            return r.set("stage", "getOutputShapes").set("output", o).set("ok", false);
        }
        outDims[o].nbDims = outExprs[o].nbDims;
        for (int32_t i = 0; i < outExprs[o].nbDims; ++i) {
            if (outExprs[o].d[i] == nullptr || !builder.owns(outExprs[o].d[i])) {
                return r.set("stage", "getOutputShapes").set("output", o).set("ok", false);
            }
            outDims[o].d[i] = HostExprBuilder::cast(*outExprs[o].d[i]).evaluate({});  // inputs are constants
        }
    }
    // Formats, configure, workspace: a profile with min = opt = max = this step's shapes.
    std::vector<DynamicPluginTensorDesc> io;
    for (int32_t p = 0; p < nbIn + nbOut; ++p) {
        DynamicPluginTensorDesc d{};
        d.desc.dims = p < nbIn ? inDims[p] : outDims[p - nbIn];
        d.desc.type = p < nbIn ? inTypes[p] : outTypes[p - nbIn];
        d.desc.format = TensorFormat::kLINEAR;
        d.desc.scale = 1.f;
        d.min = d.opt = d.max = d.desc.dims;
        io.push_back(d);
    }
    bool formatsOk = true;
    for (int32_t p = 0; p < nbIn + nbOut; ++p) {
        formatsOk = caps.build->supportsFormatCombination(p, io.data(), nbIn, nbOut) && formatsOk;
    }
    if (!formatsOk || caps.build->configurePlugin(io.data(), nbIn, io.data() + nbIn, nbOut) != 0) {
        return r.set("stage", formatsOk ? "configurePlugin" : "supportsFormatCombination").set("ok", false);
    }
    size_t const workspaceBytes = caps.build->getWorkspaceSize(io.data(), nbIn, io.data() + nbIn, nbOut);
    r.set("workspace_bytes", Json(static_cast<uint64_t>(workspaceBytes)));

    FieldSet serialized = FieldSet::copyOf(caps.runtime->getFieldsToSerialize());
    PluginPtr deserialized(creator->createPlugin("layer", serialized.get(), TensorRTPhase::kRUNTIME));
    if (!deserialized) {
        return r.set("stage", "createPlugin(runtime)").set("ok", false);
    }
    Capabilities dcaps = capabilitiesOf(deserialized.get());
    HostResourceContext context;
    PluginPtr runtime(dcaps.runtime->attachToContext(&context));
    Capabilities rcaps = runtime ? capabilitiesOf(runtime.get()) : Capabilities{};
    if (!runtime || rcaps.runtime == nullptr) {
        return r.set("stage", "attachToContext").set("ok", false);
    }

    int const poison = step.has("poison_byte") ? static_cast<int>(step.at("poison_byte").asInt()) : 0xFF;
    for (int32_t o = 0; o < nbOut; ++o) {
        DeviceTensor t{outTypes[o], outDims[o], nullptr};
        t.buffer = std::make_unique<DeviceBuffer>(static_cast<size_t>(volume(t.dims) * dataTypeBytes(t.type)));
        checkCuda(cudaMemset(t.buffer->ptr, poison, t.buffer->bytes), "poison output");
        tensors[outNames[o]] = std::move(t);
    }
    DeviceBuffer workspace(workspaceBytes);
    checkCuda(cudaMemset(workspace.ptr, poison, workspace.bytes), "poison workspace");

    std::vector<PluginTensorDesc> inDesc, outDesc;
    std::vector<void const*> inPtrs;
    std::vector<void*> outPtrs;
    for (int32_t p = 0; p < nbIn; ++p) {
        inDesc.push_back(PluginTensorDesc{inDims[p], inTypes[p], TensorFormat::kLINEAR, 1.f});
        inPtrs.push_back(tensorNamed(inNames[p]).buffer->ptr);
    }
    for (int32_t o = 0; o < nbOut; ++o) {
        outDesc.push_back(PluginTensorDesc{outDims[o], outTypes[o], TensorFormat::kLINEAR, 1.f});
        outPtrs.push_back(tensorNamed(outNames[o]).buffer->ptr);
    }
    // "enqueue_phase": "build" enqueues the build-phase instance, as TensorRT does while it times tactics (with
    // whatever the inputs hold); the default is the engine's: the deserialized, attached instance.
    std::string const enqueuePhase = step.has("enqueue_phase") ? step.at("enqueue_phase").asString() : "runtime";
    if (enqueuePhase != "build" && enqueuePhase != "runtime") throw std::runtime_error("enqueue_phase: build or runtime");
    nvinfer1::IPluginV3OneRuntime* const target = enqueuePhase == "build" ? caps.runtime : rcaps.runtime;
    r.set("enqueue_phase", enqueuePhase);
    if (target->onShapeChange(inDesc.data(), nbIn, outDesc.data(), nbOut) != 0) {
        return r.set("stage", "onShapeChange").set("ok", false);
    }
    // The uploads and poison fills above ran on the legacy stream (cudaMemset is asynchronous for device
    // memory), which a non-blocking stream does not wait for: finish them before TensorRT-style enqueue.
    checkCuda(cudaDeviceSynchronize(), "synchronize before enqueue");
    rc = target->enqueue(inDesc.data(), outDesc.data(), inPtrs.data(), outPtrs.data(),
                         workspaceBytes > 0 ? workspace.ptr : nullptr, stream);
    cudaError_t const syncErr = cudaStreamSynchronize(stream);
    r.set("enqueue_rc", rc).set("cuda", cudaGetErrorName(syncErr));
    if (rc != 0 || syncErr != cudaSuccess) {
        return r.set("stage", "enqueue").set("ok", false);
    }
    Json shapes = Json::array();
    for (Dims const& d : outDims) shapes.push(dimsToJson(d));
    r.set("output_dims", shapes);
    return r.set("ok", true);
}

Json runEnqueue(PluginLibrary& library, Json const& plan, std::string const& planDir, std::string const& outDir) {
    HostLogger& logger = hostLoggerFinder().logger();
    auto path = [&](std::string const& file) { return file.rfind('/', 0) == 0 ? file : planDir + "/" + file; };

    std::map<std::string, std::unique_ptr<DeviceBuffer>> buffers;
    if (Json const* bs = plan.find("buffers")) {
        for (auto const& m : bs->members()) {
            if (m.second.has("file")) {
                buffers[m.first] = upload(readBytes(path(m.second.at("file").asString())));
            } else {
                auto buf = std::make_unique<DeviceBuffer>(static_cast<size_t>(m.second.at("nbytes").asInt()));
                int const fill = m.second.has("fill_byte") ? static_cast<int>(m.second.at("fill_byte").asInt()) : 0;
                checkCuda(cudaMemset(buf->ptr, fill, buf->bytes), "cudaMemset buffer");
                buffers[m.first] = std::move(buf);
            }
        }
    }
    std::map<std::string, DeviceTensor> tensors;
    for (auto const& m : plan.at("tensors").members()) {
        DeviceTensor t{dataTypeFromName(m.second.at("type").asString()), jsonDims(m.second.at("dims")), nullptr};
        std::vector<uint8_t> host = readBytes(path(m.second.at("file").asString()));
        size_t const expected = static_cast<size_t>(volume(t.dims) * dataTypeBytes(t.type));
        if (host.size() != expected) {
            throw std::runtime_error("tensor '" + m.first + "': file has " + std::to_string(host.size()) +
                                     " bytes, dims and type need " + std::to_string(expected));
        }
        if (Json const* addrs = m.second.find("addresses")) {
            for (Json const& a : addrs->items()) {
                // The pool is a device allocation TensorRT never sees; kv_pools carries its address.
                auto const& buf = buffers.at(a.at("buffer").asString());
                int64_t const offset = a.has("offset") ? a.at("offset").asInt() : 0;  // e.g. past a guard zone
                if (offset < 0 || static_cast<size_t>(offset) > buf->bytes) {
                    throw std::runtime_error("tensor '" + m.first + "': address offset outside its buffer");
                }
                auto const address = static_cast<int64_t>(reinterpret_cast<uintptr_t>(buf->ptr)) + offset;
                size_t const element = static_cast<size_t>(a.at("element").asInt());
                if (t.type != DataType::kINT64 || (element + 1) * 8 > host.size()) {
                    throw std::runtime_error("tensor '" + m.first + "': address patch outside an INT64 tensor");
                }
                std::memcpy(host.data() + element * 8, &address, 8);
            }
        }
        t.buffer = upload(host);
        tensors[m.first] = std::move(t);
    }

    cudaStream_t stream = nullptr;
    checkCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    Json steps = Json::array();
    bool allOk = true;
    for (Json const& step : plan.at("steps").items()) {
        Json r = runStep(library, step, tensors, stream);
        r.set("messages", logger.drain());
        allOk = r.at("ok").asBool();
        steps.push(r);
        if (!allOk) break;  // later steps would read what this one did not write
    }
    cudaStreamDestroy(stream);

    Json manifest = Json::object();
    for (Json const& n : plan.at("dump").items()) {
        std::string const name = n.asString();
        void const* ptr = nullptr;
        size_t bytes = 0;
        Json entry = Json::object().set("file", name + ".bin");
        if (tensors.count(name)) {
            DeviceTensor const& t = tensors.at(name);
            ptr = t.buffer->ptr;
            bytes = t.buffer->bytes;
            entry.set("type", dataTypeName(t.type)).set("dims", dimsToJson(t.dims));
        } else if (buffers.count(name)) {
            ptr = buffers.at(name)->ptr;
            bytes = buffers.at(name)->bytes;
        } else {
            continue;  // not produced (a failed step): absent from the manifest
        }
        std::vector<uint8_t> host(bytes);
        if (bytes > 0) checkCuda(cudaMemcpy(host.data(), ptr, bytes, cudaMemcpyDeviceToHost), "download " + name);
        writeBytes(outDir + "/" + name + ".bin", host.data(), bytes);
        manifest.set(name, entry.set("nbytes", Json(static_cast<uint64_t>(bytes))));
    }
    std::ofstream(outDir + "/manifest.json") << manifest.dump();
    return Json::object().set("ok", allOk).set("steps", steps);
}

}  // namespace testhost
