// backend.cpp: picks a backend by name at runtime.
#include "backend.h"

#include <stdexcept>

namespace kd {

BackendCounters operator-(const BackendCounters& a, const BackendCounters& b) {
    BackendCounters d;
    d.kernels = a.kernels - b.kernels;
    d.launches = a.launches - b.launches;
    d.graph_launches = a.graph_launches - b.graph_launches;
    d.h2d = a.h2d - b.h2d;
    d.d2h = a.d2h - b.d2h;
    d.d2d = a.d2d - b.d2d;
    d.syncs = a.syncs - b.syncs;
    return d;
}

std::string available_backends() {
#ifdef KD_WITH_CUDA
    return "cpu,cuda";
#else
    return "cpu";
#endif
}

std::unique_ptr<Backend> make_backend(const std::string& name) {
    if (name == "cpu") return make_cpu_backend();
#ifdef KD_WITH_CUDA
    if (name == "cuda") return make_cuda_backend();
#endif
    throw std::runtime_error("backend '" + name + "' is not available in this build (built with: " +
                             available_backends() + ")");
}

}  // namespace kd
