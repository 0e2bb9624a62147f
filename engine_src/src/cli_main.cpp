// cli_main.cpp: the kdtree command line: usage, dispatch to the subcommands, and the one place
// errors become an exit status.
#include "args.h"
#include "backend.h"
#include "bundle.h"
#include "cli.h"
#include "version.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>

namespace kd {
namespace {

const char* kUsage =
    "usage:\n"
    "  kdtree --version\n"
    "  kdtree generate --bundle F [--mode ar|ddtree] [-n N] [--prompt 1,2,3] [--budget B] [--block L]\n"
    "                  [--backend cpu|cuda] [--max-memory 4G] [--json]\n"
    "  kdtree check    --bundle F [--expect golden|ar|1,2,3] [--mode ar|ddtree] [-n N] [--prompt 1,2,3]\n"
    "                  [--budget B] [--block L] [--backend cpu|cuda] [--max-memory 4G]\n"
    "  kdtree outputs  --manifest tests/refs/manifest.json [--out build/outputs.json] [--budget B] [--block L]\n"
    "                  [--backend cpu|cuda] [--max-memory 4G]\n"
    "  kdtree bench    --manifest tests/refs/manifest.json [--out build/bench.json] [--budgets 4,8,16,32]\n"
    "                  [--repeats R] [-n N] [--moe-experts E] [--moe-tokens 1,2,4,8,16] [--backend cpu|cuda]\n"
    "                  [--max-memory 4G]\n"
    "  kdtree verify   --bundle F [--max-memory 4G] [--upload [--backend cpu|cuda]]\n";

}  // namespace

uint64_t max_memory_flag(const Args& a) {
    return a.bytes("--max-memory", kDefaultMaxMemory, uint64_t{1} << 20, uint64_t{1} << 50);
}

std::string backend_flag(const Args& a) {
    const std::string name = a.str("--backend", build_backend());
    if (name != "cpu" && name != "cuda") throw std::runtime_error("flag --backend expects cpu or cuda, got '" + printable(name) + "'");
    const std::string built = available_backends();
    if (("," + built + ",").find("," + name + ",") == std::string::npos)
        throw std::runtime_error("flag --backend: " + name + " is not in this build (built with: " + built + ")");
    return name;
}

int cli_main(int argc, char** argv) {
    if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
        std::fputs(kUsage, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const std::string cmd = argv[1];
    try {
        if (cmd == "--version") {
            std::printf("%s\n", version_line().c_str());
            return 0;
        }
        if (cmd == "generate") return cmd_generate(argc, argv);
        if (cmd == "check") return cmd_check(argc, argv);
        if (cmd == "outputs") return cmd_outputs(argc, argv);
        if (cmd == "bench") return cmd_bench(argc, argv);
        if (cmd == "verify") return cmd_verify(argc, argv);
        std::fprintf(stderr, "kdtree: unknown command '%s'\n%s", printable(cmd).c_str(), kUsage);
        return 2;
    } catch (const std::bad_alloc&) {
        // Input is checked before anything is allocated for it, so this is the machine, not the input.
        std::fprintf(stderr, "kdtree %s: error: out of memory\n", cmd.c_str());
        return 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kdtree %s: error: %s\n", cmd.c_str(), e.what());
        return 1;
    }
}

}  // namespace kd
