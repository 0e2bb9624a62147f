// manifest.h: the bundle manifest reader (README.md, "Result files" and "Input validation").
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace kd {

struct ManifestEntry {
    std::string name;          // the bundle's name (a key of outputs.json / bench.json)
    std::string path;          // the bundle file: the manifest's folder + its `file`
    size_t golden_length = 0;  // how many golden tokens the manifest lists
};

// Reads and checks a manifest: `bundles` an array of objects, each with a unique `name` of
// [A-Za-z0-9_.-] characters, a `file` that stays inside the manifest's folder (a relative path
// without empty, "." or ".." parts) and a `golden` array of non-negative integers. Throws
// std::runtime_error("manifest <path>: bundles[i].<key>: <problem>").
std::vector<ManifestEntry> read_manifest(const std::string& path);

}  // namespace kd
