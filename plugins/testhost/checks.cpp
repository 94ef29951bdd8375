#include "checks.h"

#include <dlfcn.h>

#include <cstring>
#include <map>
#include <stdexcept>
#include <vector>

#include "hostRegistry.h"
#include "tensorSpec.h"

namespace testhost {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::IPluginV3;
using nvinfer1::PluginCapabilityType;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;
using nvinfer1::TensorRTPhase;

namespace {

HostLogger& logger() { return hostLoggerFinder().logger(); }

// A garbage type for positions after `pos` in supportsFormatCombination: TensorRT documents them as invalid,
// so a plugin that looks at them gets a value no real tensor has.
constexpr DataType kGarbageType = static_cast<DataType>(0x5a);

template <typename Interface>
Interface* checkedCapability(IPluginV3* plugin, PluginCapabilityType type, char const* kind, Json& report,
                             char const* key) {
    nvinfer1::IPluginCapability* cap = plugin->getCapabilityInterface(type);
    if (cap == nullptr) {
        report.set(key, Json());
        return nullptr;
    }
    std::string const got = interfaceString(*cap);
    report.set(key, got);
    nvinfer1::InterfaceInfo const info = cap->getInterfaceInfo();
    if (info.kind == nullptr || std::strcmp(info.kind, kind) != 0) return nullptr;
    return static_cast<Interface*>(cap);
}

Json fieldSetReport(nvinfer1::PluginFieldCollection const* fc) {
    return FieldSet::copyOf(fc).describe();
}

DynamicPluginTensorDesc dynamicDesc(TensorSpec const& t, DataType type, TensorFormat format, Bindings const& min,
                                    Bindings const& opt, Bindings const& max) {
    DynamicPluginTensorDesc d{};
    d.desc.dims = t.buildDims();
    d.desc.type = type;
    d.desc.format = format;
    d.desc.scale = 1.f;
    d.min = t.concreteDims(min);
    d.opt = t.concreteDims(opt);
    d.max = t.concreteDims(max);
    return d;
}

// An output's spec from its shape expressions: constants stay numbers, symbolic ones become their text so that
// dynamicDesc maps them to -1 at build time and evaluates them under the profile's bindings.
struct OutputSpec {
    std::vector<HostDimensionExpr const*> exprs;
    DataType type;
    Dims evaluate(Bindings const& b) const {
        Dims d{};
        d.nbDims = static_cast<int32_t>(exprs.size());
        for (size_t i = 0; i < exprs.size(); ++i) d.d[i] = exprs[i]->evaluate(b);
        return d;
    }
    Dims buildDims() const {
        Dims d{};
        d.nbDims = static_cast<int32_t>(exprs.size());
        for (size_t i = 0; i < exprs.size(); ++i) d.d[i] = exprs[i]->isConstant() ? exprs[i]->getConstantValue() : -1;
        return d;
    }
};

}  // namespace

Capabilities capabilitiesOf(IPluginV3* plugin) {
    Capabilities c;
    c.report = Json::object();
    c.core = checkedCapability<nvinfer1::IPluginV3OneCore>(plugin, PluginCapabilityType::kCORE, "PLUGIN_V3ONE_CORE",
                                                           c.report, "core");
    c.build = checkedCapability<nvinfer1::IPluginV3OneBuild>(plugin, PluginCapabilityType::kBUILD,
                                                             "PLUGIN_V3ONE_BUILD", c.report, "build");
    c.runtime = checkedCapability<nvinfer1::IPluginV3OneRuntime>(plugin, PluginCapabilityType::kRUNTIME,
                                                                 "PLUGIN_V3ONE_RUNTIME", c.report, "runtime");
    return c;
}

FieldSet fieldSetOf(nvinfer1::IPluginCreatorV3One* creator, Json const& spec) {
    std::string const caller = spec.has("caller") ? spec.at("caller").asString() : "onnx_parser";
    Json const& attrs = spec.at("attrs");
    if (caller == "onnx_parser") return FieldSet::fromOnnxAttributes(attrs, creator->getFieldNames());
    if (caller == "direct") return FieldSet::direct(attrs);
    throw std::runtime_error("spec 'caller': expected onnx_parser or direct, got " + caller);
}

Json runInfo(PluginLibrary& library) {
    Json creators = Json::array();
    for (nvinfer1::IPluginCreatorInterface* c : library.creators()) {
        Json entry = Json::object().set("interface", interfaceString(*c));
        if (nvinfer1::IPluginCreatorV3One* v3 = asCreatorV3One(c)) {
            entry.set("name", v3->getPluginName())
                .set("version", v3->getPluginVersion())
                .set("namespace", v3->getPluginNamespace());
            Json fields = Json::array();
            nvinfer1::PluginFieldCollection const* fc = v3->getFieldNames();
            for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
                fields.push(Json::object()
                                .set("name", fc->fields[i].name ? fc->fields[i].name : "")
                                .set("type", fieldTypeName(fc->fields[i].type))
                                .set("length", fc->fields[i].length));
            }
            entry.set("fields", fields);
        }
        creators.push(entry);
    }
    return Json::object().set("creators", creators).set("messages", logger().drain());
}

namespace {

char const* kHexDigits = "0123456789abcdef";

std::string toHex(std::vector<uint8_t> const& bytes) {
    std::string out;
    for (uint8_t b : bytes) {
        out.push_back(kHexDigits[b >> 4]);
        out.push_back(kHexDigits[b & 15]);
    }
    return out;
}

std::vector<uint8_t> fromHex(std::string const& hex) {
    if (hex.size() % 2 != 0) throw std::runtime_error("blob: odd number of hex digits");
    auto digit = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        throw std::runtime_error(std::string("blob: not a hex digit: ") + c);
    };
    std::vector<uint8_t> out;
    for (size_t i = 0; i < hex.size(); i += 2) out.push_back(static_cast<uint8_t>(digit(hex[i]) * 16 + digit(hex[i + 1])));
    return out;
}

// A spec's "phase": "build" | "runtime" | any integer (a value outside TensorRTPhase, for malformed calls).
TensorRTPhase phaseOf(Json const& spec) {
    if (!spec.has("phase")) return TensorRTPhase::kBUILD;
    Json const& phase = spec.at("phase");
    if (phase.isInteger()) return static_cast<TensorRTPhase>(phase.asInt());
    if (phase.asString() == "build") return TensorRTPhase::kBUILD;
    if (phase.asString() == "runtime") return TensorRTPhase::kRUNTIME;
    throw std::runtime_error("spec 'phase': build, runtime or an integer");
}

// A spec's "logger": "finder" (default): the finder answers with the host logger; "null": it answers nullptr,
// as TensorRT-RTX's does (the library's messages then go to stderr and its kept messages).
void selectLogger(Json const& spec) {
    std::string const mode = spec.has("logger") ? spec.at("logger").asString() : "finder";
    if (mode != "finder" && mode != "null") throw std::runtime_error("spec 'logger': expected finder or null");
    hostLoggerFinder().setAnswers(mode == "finder");
}

// What the library kept (pagedkv_plugin_messages), read and cleared; "" when the library does not export it.
std::string keptMessages(PluginLibrary& library) {
    using MessagesFn = size_t (*)(char*, size_t, int32_t);
    auto fn = reinterpret_cast<MessagesFn>(dlsym(library.handle(), "pagedkv_plugin_messages"));
    if (fn == nullptr) return "";
    std::vector<char> buffer(fn(nullptr, 0, 0) + 1);
    fn(buffer.data(), buffer.size(), 1);
    return buffer.data();
}

std::vector<std::string> problems(Json const& messages) {
    std::vector<std::string> out;
    for (Json const& m : messages.items()) {
        std::string const severity = m.at("severity").asString();
        if (severity == "ERROR" || severity == "INTERNAL_ERROR" || severity == "WARNING") {
            out.push_back(severity + ": " + m.at("message").asString());
        }
    }
    return out;
}

}  // namespace

Json runCreate(PluginLibrary& library, Json const& spec) {
    nvinfer1::IPluginCreatorV3One* creator = library.creator(spec.at("plugin").asString());
    TensorRTPhase const phase = phaseOf(spec);
    FieldSet fields = fieldSetOf(creator, spec);
    selectLogger(spec);
    logger().drain();
    keptMessages(library);
    PluginPtr plugin(creator->createPlugin("layer0", fields.get(), phase));
    Json report = Json::object().set("created", plugin != nullptr).set("messages", logger().drain());
    report.set("kept_messages", keptMessages(library));
    report.set("fields_given", fields.describe());
    if (plugin) {
        Capabilities caps = capabilitiesOf(plugin.get());
        report.set("capabilities", caps.report);
        if (caps.runtime != nullptr) {
            nvinfer1::PluginFieldCollection const* serialized = caps.runtime->getFieldsToSerialize();
            report.set("fields", fieldSetReport(serialized)).set("blob", toHex(FieldSet::copyOf(serialized).toBlob()));
        }
    }
    hostLoggerFinder().setAnswers(true);
    return report;
}

Json runFuzz(PluginLibrary& library, Json const& cases) {
    Json results = Json::array();
    for (Json const& c : cases.items()) {
        nvinfer1::IPluginCreatorV3One* creator = library.creator(c.at("plugin").asString());
        FieldSet fields = c.has("blob") ? FieldSet::fromBlob(fromHex(c.at("blob").asString())) : fieldSetOf(creator, c);
        // "collection": a malformed PluginFieldCollection itself: "null", "negative_count" or "null_fields".
        std::string const collection = c.has("collection") ? c.at("collection").asString() : "";
        nvinfer1::PluginFieldCollection malformed{};
        nvinfer1::PluginFieldCollection const* fc = fields.get();
        if (collection == "null") {
            fc = nullptr;
        } else if (collection == "negative_count") {
            malformed = nvinfer1::PluginFieldCollection{-3, fc->fields};
            fc = &malformed;
        } else if (collection == "null_fields") {
            malformed = nvinfer1::PluginFieldCollection{3, nullptr};
            fc = &malformed;
        } else if (!collection.empty()) {
            throw std::runtime_error("case 'collection': expected null, negative_count or null_fields");
        }
        logger().drain();
        PluginPtr plugin(creator->createPlugin("layer0", fc, phaseOf(c)));
        Json r = Json::object().set("created", plugin != nullptr);
        if (plugin) {
            // What an accepted collection becomes must itself be accepted: serialize, deserialize, clone.
            Capabilities caps = capabilitiesOf(plugin.get());
            bool roundTrip = caps.runtime != nullptr;
            if (roundTrip) {
                FieldSet again = FieldSet::copyOf(caps.runtime->getFieldsToSerialize());
                PluginPtr deserialized(creator->createPlugin("layer0", again.get(), TensorRTPhase::kRUNTIME));
                PluginPtr cloned(plugin->clone());
                roundTrip = deserialized != nullptr && cloned != nullptr;
            }
            r.set("round_trip", roundTrip);
        }
        Json messages = Json::array();
        for (std::string const& m : problems(logger().drain())) messages.push(m);
        results.push(r.set("messages", messages));
    }
    return Json::object().set("results", results);
}

// `check` spec:
//   {"plugin": "PagedKVQKVWrite", "caller": "onnx_parser", "attrs": {...},
//    "inputs": [{"name": "qkv", "type": "kHALF", "dims": ["T", 384]}, ...],
//    "bindings": {"T": 7, ...},                        run-time values (onShapeChange, evaluated shapes)
//    "profile": {"min": {...}, "opt": {...}, "max": {...}}}   optional, defaults to bindings
Json runCheck(PluginLibrary& library, Json const& spec) {
    nvinfer1::IPluginCreatorV3One* creator = library.creator(spec.at("plugin").asString());
    std::vector<TensorSpec> inputs;
    for (Json const& j : spec.at("inputs").items()) inputs.push_back(TensorSpec::parse(j));
    Bindings const bindings = parseBindings(spec.at("bindings"));
    Bindings minB = bindings, optB = bindings, maxB = bindings;
    if (Json const* profile = spec.find("profile")) {
        minB = parseBindings(profile->at("min"));
        optB = parseBindings(profile->at("opt"));
        maxB = parseBindings(profile->at("max"));
    }
    int32_t const nbInputs = static_cast<int32_t>(inputs.size());
    Json report = Json::object();

    // 1. Build phase: createPlugin from the attributes.
    FieldSet fields = fieldSetOf(creator, spec);
    logger().drain();
    PluginPtr plugin(creator->createPlugin("layer0", fields.get(), TensorRTPhase::kBUILD));
    report.set("created", plugin != nullptr).set("create_messages", logger().drain());
    if (!plugin) return report;

    // 2. Capabilities and identity.
    Capabilities caps = capabilitiesOf(plugin.get());
    report.set("capabilities", caps.report);
    if (caps.core == nullptr || caps.build == nullptr || caps.runtime == nullptr) return report;
    report.set("identity", Json::object()
                               .set("name", caps.core->getPluginName())
                               .set("version", caps.core->getPluginVersion())
                               .set("namespace", caps.core->getPluginNamespace()));
    int32_t const nbOutputs = caps.build->getNbOutputs();
    report.set("nb_outputs", nbOutputs);
    if (nbOutputs <= 0 || nbOutputs > 16) return report;

    // 3. Output types for the spec's input types.
    std::vector<DataType> inTypes;
    for (TensorSpec const& t : inputs) inTypes.push_back(t.type);
    std::vector<DataType> outTypes(nbOutputs, kGarbageType);
    int32_t rc = caps.build->getOutputDataTypes(outTypes.data(), nbOutputs, inTypes.data(), nbInputs);
    Json outTypeNames = Json::array();
    for (DataType t : outTypes) outTypeNames.push(dataTypeName(t));
    report.set("output_types_rc", rc).set("output_types", outTypeNames).set("output_types_messages", logger().drain());

    // 4. Output shapes from symbolic input shapes.
    HostExprBuilder builder;
    std::map<std::string, HostDimensionExpr const*> symbols;
    std::vector<DimsExprs> inExprs;
    for (TensorSpec const& t : inputs) inExprs.push_back(t.exprs(builder, symbols));
    std::vector<DimsExprs> outExprs(nbOutputs);
    for (DimsExprs& e : outExprs) e.nbDims = -1;
    rc = caps.build->getOutputShapes(inExprs.data(), nbInputs, nullptr, 0, outExprs.data(), nbOutputs, builder);
    report.set("output_shapes_rc", rc).set("output_shapes_messages", logger().drain());
    Json shapes = Json::array();
    std::vector<OutputSpec> outSpecs(nbOutputs);
    bool shapesUsable = rc == 0;
    for (int32_t o = 0; o < nbOutputs; ++o) {
        DimsExprs const& e = outExprs[o];
        Json s = Json::object().set("nb_dims", e.nbDims);
        Json text = Json::array(), isConst = Json::array(), values = Json::array();
        bool owned = true;
        for (int32_t i = 0; i >= 0 && i < e.nbDims && i < Dims::MAX_DIMS; ++i) {
            if (e.d[i] == nullptr || !builder.owns(e.d[i])) {
                owned = false;
                shapesUsable = false;
                text.push(Json());
                continue;
            }
            HostDimensionExpr const& x = HostExprBuilder::cast(*e.d[i]);
            outSpecs[o].exprs.push_back(&x);
            text.push(x.toString());
            isConst.push(x.isConstant());
            try {
                values.push(Json(x.evaluate(bindings)));
            } catch (std::exception const& ex) {
                values.push(Json(std::string("error: ") + ex.what()));
                shapesUsable = false;
            }
        }
        if (e.nbDims < 0 || e.nbDims > Dims::MAX_DIMS) shapesUsable = false;
        s.set("exprs", text).set("constant", isConst).set("values", values).set("owned_by_builder", owned);
        shapes.push(s);
        outSpecs[o].type = outTypes[o];
    }
    report.set("output_shapes", shapes);
    if (!shapesUsable) return report;

    // 5. Format combinations. The spec's combination: inputs as given, outputs as getOutputDataTypes said.
    int32_t const nbIO = nbInputs + nbOutputs;
    auto descAt = [&](int32_t pos, DataType type, TensorFormat format) {
        if (pos < nbInputs) return dynamicDesc(inputs[pos], type, format, minB, optB, maxB);
        OutputSpec const& o = outSpecs[pos - nbInputs];
        DynamicPluginTensorDesc d{};
        d.desc.dims = o.buildDims();
        d.desc.type = type;
        d.desc.format = format;
        d.desc.scale = 1.f;
        d.min = o.evaluate(minB);
        d.opt = o.evaluate(optB);
        d.max = o.evaluate(maxB);
        return d;
    };
    auto typeAt = [&](int32_t pos) { return pos < nbInputs ? inTypes[pos] : outTypes[pos - nbInputs]; };
    std::vector<DynamicPluginTensorDesc> combo;
    for (int32_t p = 0; p < nbIO; ++p) combo.push_back(descAt(p, typeAt(p), TensorFormat::kLINEAR));
    Json comboSupported = Json::array(), supportedTypes = Json::array(), nonLinear = Json::array();
    for (int32_t pos = 0; pos < nbIO; ++pos) {
        // As TensorRT asks: positions before `pos` hold a supported choice, later ones are not meaningful.
        std::vector<DynamicPluginTensorDesc> probe = combo;
        for (int32_t later = pos + 1; later < nbIO; ++later) probe[later].desc.type = kGarbageType;
        comboSupported.push(caps.build->supportsFormatCombination(pos, probe.data(), nbInputs, nbOutputs));
        Json types = Json::array();
        for (DataType t : allDataTypes()) {
            probe[pos].desc.type = t;
            probe[pos].desc.format = TensorFormat::kLINEAR;
            if (caps.build->supportsFormatCombination(pos, probe.data(), nbInputs, nbOutputs)) {
                types.push(dataTypeName(t));
            }
        }
        supportedTypes.push(types);
        bool anyNonLinear = false;
        for (TensorFormat f : {TensorFormat::kCHW32, TensorFormat::kHWC8, TensorFormat::kCHW2}) {
            probe[pos].desc.type = typeAt(pos);
            probe[pos].desc.format = f;
            anyNonLinear = caps.build->supportsFormatCombination(pos, probe.data(), nbInputs, nbOutputs) || anyNonLinear;
        }
        nonLinear.push(anyNonLinear);
    }
    report.set("formats", Json::object()
                              .set("combination_supported", comboSupported)
                              .set("supported_types", supportedTypes)
                              .set("non_linear_accepted", nonLinear)
                              .set("messages", logger().drain()));

    // 6. configurePlugin with build-time dims and the profile, then getWorkspaceSize.
    std::vector<DynamicPluginTensorDesc> in(combo.begin(), combo.begin() + nbInputs);
    std::vector<DynamicPluginTensorDesc> out(combo.begin() + nbInputs, combo.end());
    rc = caps.build->configurePlugin(in.data(), nbInputs, out.data(), nbOutputs);
    report.set("configure_rc", rc).set("configure_messages", logger().drain());
    report.set("workspace_bytes", Json(static_cast<uint64_t>(caps.build->getWorkspaceSize(in.data(), nbInputs, out.data(), nbOutputs))));
    report.set("workspace_messages", logger().drain());

    // 7. Serialization: build-phase fields -> runtime-phase createPlugin -> the same fields.
    FieldSet serialized = FieldSet::copyOf(caps.runtime->getFieldsToSerialize());
    report.set("serialized_fields", serialized.describe());
    PluginPtr runtimePlugin(creator->createPlugin("layer0", serialized.get(), TensorRTPhase::kRUNTIME));
    report.set("runtime_created", runtimePlugin != nullptr).set("runtime_messages", logger().drain());
    if (!runtimePlugin) return report;
    Capabilities rcaps = capabilitiesOf(runtimePlugin.get());
    report.set("runtime_capabilities", rcaps.report);
    if (rcaps.runtime == nullptr || rcaps.core == nullptr) return report;
    report.set("runtime_fields_equal", FieldSet::copyOf(rcaps.runtime->getFieldsToSerialize()).sameAs(serialized));

    // 8. clone (build plugin) and attachToContext (runtime plugin): full, independent copies.
    PluginPtr cloned(plugin->clone());
    report.set("clone_ok", cloned != nullptr && cloned.get() != plugin.get());
    if (cloned) {
        Capabilities ccaps = capabilitiesOf(cloned.get());
        report.set("clone_fields_equal", ccaps.runtime != nullptr &&
                                             FieldSet::copyOf(ccaps.runtime->getFieldsToSerialize()).sameAs(serialized));
    }
    HostResourceContext context;
    PluginPtr attached(rcaps.runtime->attachToContext(&context));
    report.set("attach_ok", attached != nullptr && attached.get() != runtimePlugin.get());
    if (!attached) return report;
    Capabilities acaps = capabilitiesOf(attached.get());
    report.set("attach_fields_equal", acaps.runtime != nullptr &&
                                          FieldSet::copyOf(acaps.runtime->getFieldsToSerialize()).sameAs(serialized));
    // The original runtime plugin goes away first, as when an engine is destroyed before its contexts.
    runtimePlugin.reset();
    plugin.reset();
    cloned.reset();
    if (acaps.runtime == nullptr) return report;

    // 9. onShapeChange on the attached plugin with the run-time shapes.
    std::vector<PluginTensorDesc> inRt, outRt;
    for (int32_t p = 0; p < nbInputs; ++p) {
        inRt.push_back(PluginTensorDesc{inputs[p].concreteDims(bindings), inTypes[p], TensorFormat::kLINEAR, 1.f});
    }
    for (int32_t o = 0; o < nbOutputs; ++o) {
        outRt.push_back(PluginTensorDesc{outSpecs[o].evaluate(bindings), outTypes[o], TensorFormat::kLINEAR, 1.f});
    }
    rc = acaps.runtime->onShapeChange(inRt.data(), nbInputs, outRt.data(), nbOutputs);
    report.set("on_shape_change_rc", rc).set("on_shape_change_messages", logger().drain());
    return report;
}

// ---- expression builder self-test ---------------------------------------------------------------------------

Json runExprSelfTest(Json const& pairs) {
    using nvinfer1::DimensionOperation;
    HostExprBuilder builder;
    Json out = Json::array();
    for (int32_t op = 0; op < nvinfer1::EnumMax<DimensionOperation>(); ++op) {
        auto const operation = static_cast<DimensionOperation>(op);
        for (Json const& pair : pairs.items()) {
            int64_t const a = pair.items().at(0).asInt();
            int64_t const b = pair.items().at(1).asInt();
            nvinfer1::IExprBuilder& eb = builder;  // through the public inline API, as a plugin calls it
            nvinfer1::IDimensionExpr const* folded = eb.operation(operation, *eb.constant(a), *eb.constant(b));
            HostDimensionExpr const* sa = builder.symbol("a");
            HostDimensionExpr const* sb = builder.symbol("b");
            nvinfer1::IDimensionExpr const* symbolic = eb.operation(operation, *sa, *sb);
            Json r = Json::object().set("op", dimensionOperationName(operation)).set("a", Json(a)).set("b", Json(b));
            r.set("folded", folded != nullptr && folded->isConstant() ? Json(folded->getConstantValue()) : Json());
            if (symbolic != nullptr) {
                HostDimensionExpr const& x = HostExprBuilder::cast(*symbolic);
                r.set("symbolic_is_constant", x.isConstant()).set("text", x.toString());
                try {
                    r.set("evaluated", Json(x.evaluate({{"a", a}, {"b", b}})));
                } catch (std::exception const&) {
                    r.set("evaluated", Json());
                }
            }
            out.push(r);
        }
    }
    // An operation value outside DimensionOperation: TensorRT answers nullptr.
    nvinfer1::IExprBuilder& eb = builder;
    bool const badOpRejected =
        eb.operation(static_cast<DimensionOperation>(99), *eb.constant(1), *eb.constant(2)) == nullptr;
    return Json::object().set("results", out).set("bad_op_rejected", badOpRejected);
}

// ---- self-registration ---------------------------------------------------------------------------------------

namespace {

// A creator that owns PagedKVQKVWrite/1/pagedkv before the library loads (another copy of the library).
class PlaceholderCreator final : public nvinfer1::IPluginCreatorV3One {
public:
    IPluginV3* createPlugin(char const*, nvinfer1::PluginFieldCollection const*, TensorRTPhase) noexcept override {
        return nullptr;
    }
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override { return &mEmpty; }
    char const* getPluginName() const noexcept override { return "PagedKVQKVWrite"; }
    char const* getPluginVersion() const noexcept override { return "1"; }
    char const* getPluginNamespace() const noexcept override { return "pagedkv"; }

private:
    nvinfer1::PluginFieldCollection mEmpty{};
};

Json registryEntries() {
    Json out = Json::array();
    for (HostPluginRegistry::Entry const& e : HostPluginRegistry::instance().entries()) {
        out.push(Json::object().set("name", e.name).set("version", e.version).set("namespace", e.pluginNamespace));
    }
    return out;
}

Json registryEvents() {
    Json out = Json::array();
    for (std::string const& e : HostPluginRegistry::instance().events()) out.push(e);
    return out;
}

}  // namespace

Json runSelfRegistration(std::string const& libraryPath, std::string const& scenario) {
    HostPluginRegistry& registry = HostPluginRegistry::instance();
    Json report = Json::object().set("scenario", scenario).set("symbol_visible", HostPluginRegistry::symbolVisible());
    static PlaceholderCreator placeholder;

    bool const plainDlopen = scenario == "dlopen" || scenario == "no_registry" || scenario == "preregistered" ||
                             scenario == "api_mismatch";
    if (plainDlopen) {
        registry.setEnabled(scenario != "no_registry");
        if (scenario == "preregistered") registry.registerCreator(placeholder, "pagedkv");
        if (scenario == "api_mismatch") registry.setApiMajorVersion(1);  // as TensorRT-RTX 1.x reports itself
        // A plain dlopen, as polygraphy --plugins / ctypes.CDLL / trtexec --staticPlugins do.
        void* handle = dlopen(libraryPath.c_str(), RTLD_LAZY | RTLD_LOCAL);
        report.set("loaded", handle != nullptr);
        if (handle == nullptr) return report.set("error", dlerror());
        report.set("entries_after_load", registryEntries());
        if (scenario == "dlopen") {
            dlclose(handle);
            bool const unloaded = dlopen(libraryPath.c_str(), RTLD_LAZY | RTLD_NOLOAD) == nullptr;
            report.set("unloaded", unloaded).set("entries_after_unload", registryEntries());
        }
    } else if (scenario == "load_library") {
        // IPluginRegistry::loadLibrary: dlopen, setLoggerFinder, getCreators, then the loader's own
        // registrations, which must all succeed.
        registry.setEnabled(true);
        void* handle = registry.loadLibrary(libraryPath.c_str());
        report.set("loaded", handle != nullptr).set("entries_after_load", registryEntries());
    } else {
        throw std::runtime_error("selfreg scenario: expected dlopen, load_library, no_registry, preregistered or "
                                 "api_mismatch");
    }
    report.set("events", registryEvents()).set("messages", logger().drain());
    return report;
}

}  // namespace testhost
