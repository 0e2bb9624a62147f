// cli_verify.cpp: `kdtree verify`: load a bundle with every check of the loader (bundle.h) and
// say what was checked and how long it took; runs nothing on it.
#include "args.h"
#include "bundle.h"
#include "cli.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <thread>

namespace kd {

int cmd_verify(int argc, char** argv) {
    const Args a(argc, argv, 2, {"--bundle", "--max-memory"}, {});
    if (!a.has("--bundle")) throw std::runtime_error("--bundle is required");
    const std::string path = a.str("--bundle", "");
    const uint64_t max_memory = max_memory_flag(a);
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    std::vector<uint8_t> bytes = Bundle::read_bytes(path, max_memory);
    const auto t1 = clock::now();
    const Bundle b = Bundle::from_bytes(path, std::move(bytes), max_memory);
    const auto t2 = clock::now();
    const double read_s = std::chrono::duration<double>(t1 - t0).count(), check_s = std::chrono::duration<double>(t2 - t1).count();
    std::printf("bundle %s: version %d, %zu tensors, %zu bytes: read in %.3f s, checked in %.3f s (%.2f GB/s, %u hardware threads); "
                "identity %s\n",
                printable(b.path, 200).c_str(), b.version, b.tensors.size(), b.bytes.size(), read_s, check_s,
                static_cast<double>(b.bytes.size()) / 1e9 / std::max(check_s, 1e-9), std::max(1u, std::thread::hardware_concurrency()),
                b.identity().c_str());
    return 0;
}

}  // namespace kd
