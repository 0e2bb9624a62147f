// version.h: what this binary was built from (values compiled in by scripts/build.sh).
#pragma once

#include <string>

namespace kd {

std::string engine_version();   // e.g. "0.1.0"
std::string source_tree_hash(); // scripts/tree_hash.sh of the tree it was built from
std::string build_backend();    // "cuda" when built with the CUDA backend, else "cpu"
std::string build_arch();       // "sm_90", "sm_120", ... or "none"
std::string version_line();     // kdtree <version> tree=<hash> backend=<cpu|cuda> arch=<sm_XX|none>

}  // namespace kd
