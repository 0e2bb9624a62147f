// backend.cpp: picks a backend by name at runtime.
#include "backend.h"

#include <stdexcept>

namespace kd {

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
