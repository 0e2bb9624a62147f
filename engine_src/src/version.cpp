// version.cpp: build.sh writes build/gen/build_stamp.h with KD_TREE_HASH and KD_ARCH.
#include "version.h"

#if __has_include("build_stamp.h")
#include "build_stamp.h"
#endif
#ifndef KD_TREE_HASH
#define KD_TREE_HASH "unknown"
#endif
#ifndef KD_ARCH
#define KD_ARCH "none"
#endif

namespace kd {

std::string engine_version() { return "0.1.0"; }
std::string source_tree_hash() { return KD_TREE_HASH; }
std::string build_backend() {
#ifdef KD_WITH_CUDA
    return "cuda";
#else
    return "cpu";
#endif
}
std::string build_arch() { return KD_ARCH; }
std::string version_line() {
    return "kdtree " + engine_version() + " tree=" + source_tree_hash() + " backend=" + build_backend() +
           " arch=" + build_arch();
}

}  // namespace kd
