// A co-tenant for the shared-GPU reference run: holds N MiB of GPU memory (default 4096) in a
// CUDA context until it is killed, so that nvidia-smi lists it as a compute process.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 4096;
    void *p = nullptr;
    cudaError_t err = cudaMalloc(&p, mib << 20);
    if (err != cudaSuccess) {
        std::fprintf(stderr, "hold_gpu: cudaMalloc of %zu MiB failed: %s\n", mib, cudaGetErrorString(err));
        return 1;
    }
    cudaMemset(p, 0, mib << 20);
    cudaDeviceSynchronize();
    std::printf("hold_gpu: pid %d holds %zu MiB\n", static_cast<int>(getpid()), mib);
    std::fflush(stdout);
    pause();
    return 0;
}
