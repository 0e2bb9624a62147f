// cli_verify.cpp: `kdtree verify`: load a bundle with every check of the loader (bundle.h) and
// say what was checked and how long each load phase took; with --upload, also put its weights in
// a backend's memory as a run would (model.h); runs nothing on it.
#include "args.h"
#include "backend.h"
#include "bundle.h"
#include "cli.h"
#include "model.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <thread>

namespace kd {
namespace {

double gb_per_s(uint64_t bytes, double seconds) { return static_cast<double>(bytes) / 1e9 / std::max(seconds, 1e-9); }

}  // namespace

std::string load_phases(const Bundle& b, const std::string& backend, double upload_seconds) {
    char buf[320];
    int n = std::snprintf(buf, sizeof buf, "read in %.3f s (%.2f GB/s, %zu %s), checked in %.3f s (%.2f GB/s, %u hardware threads)",
                          b.read_seconds, gb_per_s(b.bytes.size(), b.read_seconds), b.read_threads,
                          b.read_threads == 1 ? "thread" : "threads", b.check_seconds,
                          gb_per_s(b.bytes.size(), b.check_seconds), std::max(1u, std::thread::hardware_concurrency()));
    if (upload_seconds >= 0 && n > 0 && static_cast<size_t>(n) < sizeof buf)
        std::snprintf(buf + n, sizeof buf - n, ", uploaded to %s in %.3f s (%.2f GB/s of weights)", backend.c_str(), upload_seconds,
                      gb_per_s(b.weight_bytes, upload_seconds));
    return buf;
}

int cmd_verify(int argc, char** argv) {
    const Args a(argc, argv, 2, {"--bundle", "--max-memory", "--backend"}, {"--upload"});
    if (!a.has("--bundle")) throw std::runtime_error("--bundle is required");
    if (a.has("--backend") && !a.has("--upload")) throw std::runtime_error("flag --backend: only with --upload (verify runs nothing)");
    const uint64_t max_memory = max_memory_flag(a);
    std::unique_ptr<Backend> be = a.has("--upload") ? make_backend(backend_flag(a)) : nullptr;
    const Bundle b = Bundle::load(a.str("--bundle", ""), max_memory);
    double upload_seconds = -1;
    if (be) upload_seconds = Model(b, *be, static_cast<int>(b.prompt.size())).upload_seconds();
    std::printf("bundle %s: version %d, %zu tensors, %zu bytes: %s; identity %s\n", printable(b.path, 200).c_str(), b.version,
                b.tensors.size(), b.bytes.size(), load_phases(b, be ? be->name() : "", upload_seconds).c_str(), b.identity().c_str());
    return 0;
}

}  // namespace kd
