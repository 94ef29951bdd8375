// pagedkv_testhost: does with the plugin library what TensorRT does, through its public interface only, and
// prints a JSON report on stdout for tests/test_plugin_library.py and tests/gpu/test_plugins_enqueue.py.
//
//   pagedkv_testhost info    --lib LIB
//   pagedkv_testhost create  --lib LIB --spec SPEC.json     createPlugin only; exit 1 when it returns nullptr
//   pagedkv_testhost create  --lib LIB --plugin NAME --attrs ATTRS.json [--phase build|runtime] [--caller direct]
//   pagedkv_testhost check   --lib LIB --spec SPEC.json     build + runtime interface of one configuration
//   pagedkv_testhost fuzz    --lib LIB --cases CASES.json   createPlugin on many cases in one process
//   pagedkv_testhost selfreg --lib LIB --scenario dlopen|load_library|no_registry|preregistered|api_mismatch
//   pagedkv_testhost enqueue --lib LIB --plan PLAN.json --out DIR      (GPU)
//   pagedkv_testhost run-engine --lib LIB --plan PLAN.json --out DIR   (GPU) the C++ runtime over the plugins
//   pagedkv_testhost exprs   --pairs "[[7,2],[-7,2]]"                  the host's IExprBuilder on its own
//
// Exit status: 0 the command ran (for `create`: the plugin was created), 1 `create` got nullptr, `enqueue` had a
// failing step or `run-engine` a failing step or unfinished requests, 2 a usage or host error (message on
// stderr). A crash of the library is a signal.
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <map>
#include <string>

#include "checks.h"
#include "engineRunner.h"
#include "enqueueRunner.h"
#include "json.h"
#include "pluginLibrary.h"

namespace {

int usage() {
    std::fprintf(stderr,
                 "usage: pagedkv_testhost info|create|check|fuzz|selfreg|enqueue|run-engine --lib LIB [--spec FILE] "
                 "[--cases FILE] [--scenario NAME] [--plan FILE --out DIR] | exprs --pairs JSON\n");
    return 2;
}

std::string directoryOf(std::string const& path) {
    size_t const slash = path.rfind('/');
    return slash == std::string::npos ? "." : path.substr(0, slash);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) return usage();
    std::string const command = argv[1];
    std::map<std::string, std::string> options;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (std::strncmp(argv[i], "--", 2) != 0) return usage();
        options[argv[i] + 2] = argv[i + 1];
    }
    try {
        using namespace testhost;
        Json report;
        int status = 0;
        if (command == "exprs") {
            if (!options.count("pairs")) return usage();
            std::cout << runExprSelfTest(Json::parse(options["pairs"])).dump() << std::endl;
            return 0;
        }
        if (!options.count("lib")) return usage();
        if (command == "selfreg") {
            if (!options.count("scenario")) return usage();
            report = runSelfRegistration(options["lib"], options["scenario"]);
        } else {
            PluginLibrary library(options["lib"]);
            if (command == "info") {
                report = runInfo(library);
            } else if (command == "create" && !options.count("spec")) {
                // Attributes alone (as an ONNX node carries them), for a quick look by hand.
                if (!options.count("plugin") || !options.count("attrs")) return usage();
                Json spec = Json::object()
                                .set("plugin", options["plugin"])
                                .set("attrs", Json::parse(readFile(options["attrs"])))
                                .set("phase", options.count("phase") ? options["phase"] : "build")
                                .set("caller", options.count("caller") ? options["caller"] : "onnx_parser");
                report = runCreate(library, spec);
                if (!report.at("created").asBool()) status = 1;
            } else if (command == "create" || command == "check") {
                if (!options.count("spec")) return usage();
                Json const spec = Json::parse(readFile(options["spec"]));
                report = command == "create" ? runCreate(library, spec) : runCheck(library, spec);
                if (command == "create" && !report.at("created").asBool()) status = 1;
            } else if (command == "fuzz") {
                if (!options.count("cases")) return usage();
                report = runFuzz(library, Json::parse(readFile(options["cases"])));
            } else if (command == "enqueue") {
                if (!options.count("plan") || !options.count("out")) return usage();
                Json const plan = Json::parse(readFile(options["plan"]));
                report = runEnqueue(library, plan, directoryOf(options["plan"]), options["out"]);
                if (!report.at("ok").asBool()) status = 1;
            } else if (command == "run-engine") {
                if (!options.count("plan") || !options.count("out")) return usage();
                Json const plan = Json::parse(readFile(options["plan"]));
                report = runEngine(library, plan, directoryOf(options["plan"]), options["out"]);
                if (!report.at("ok").asBool()) status = 1;
            } else {
                return usage();
            }
        }
        std::cout << report.dump() << std::endl;
        return status;
    } catch (std::exception const& e) {
        std::fprintf(stderr, "pagedkv_testhost %s: %s\n", command.c_str(), e.what());
        return 2;
    }
}
