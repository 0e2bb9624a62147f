// main.cpp: the kdtree command line.
#include "backend.h"
#include "cli.h"
#include "version.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

namespace {

const char* kUsage =
    "usage:\n"
    "  kdtree --version\n"
    "  kdtree generate --bundle F [--mode ar|ddtree] [-n N] [--prompt 1,2,3] [--budget B] [--block L]\n"
    "                  [--backend cpu|cuda] [--json]\n"
    "  kdtree check    --bundle F [--expect golden|ar|1,2,3] [--mode ar|ddtree] [-n N] [--prompt 1,2,3]\n"
    "                  [--budget B] [--block L] [--backend cpu|cuda]\n"
    "  kdtree outputs  --manifest tests/refs/manifest.json [--out build/outputs.json] [--budget B] [--block L]\n"
    "                  [--backend cpu|cuda]\n"
    "  kdtree bench    --manifest tests/refs/manifest.json [--out build/bench.json] [--budgets 4,8,16,32]\n"
    "                  [--repeats R] [--moe-experts E] [--moe-tokens 1,2,4,8,16] [--backend cpu|cuda]\n";

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
        std::fputs(kUsage, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const std::string cmd = argv[1];
    try {
        if (cmd == "--version") {
            std::printf("%s\n", kd::version_line().c_str());
            return 0;
        }
        if (cmd == "generate") return kd::cmd_generate(argc, argv);
        if (cmd == "check") return kd::cmd_check(argc, argv);
        if (cmd == "outputs") return kd::cmd_outputs(argc, argv);
        if (cmd == "bench") return kd::cmd_bench(argc, argv);
        std::fprintf(stderr, "kdtree: unknown command '%s'\n%s", cmd.c_str(), kUsage);
        return 2;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kdtree %s: error: %s\n", cmd.c_str(), e.what());
        return 1;
    }
}
