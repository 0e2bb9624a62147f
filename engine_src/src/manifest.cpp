// manifest.cpp: the manifest reader; a manifest names files, so every name is confined to the
// manifest's own folder before anything is opened.
#include "manifest.h"
#include "json.h"

#include <cstdint>
#include <set>
#include <stdexcept>

namespace kd {
namespace {

constexpr size_t kMaxBundles = 4096;
constexpr size_t kMaxNameBytes = 128;
constexpr size_t kMaxGolden = size_t{1} << 24;

std::string dir_of(const std::string& path) {
    const size_t slash = path.rfind('/');
    if (slash == std::string::npos) return ".";
    return slash == 0 ? "/" : path.substr(0, slash);
}

// Why `file` would leave the manifest's folder or is no plain relative path; empty when fine.
std::string file_problem(const std::string& file) {
    if (file.empty()) return "is empty";
    if (file.size() > 4096) return "is longer than 4096 bytes";
    if (file[0] == '/') return "is an absolute path";
    if (file.find('\0') != std::string::npos) return "holds a NUL byte";
    size_t start = 0;
    while (true) {
        const size_t slash = file.find('/', start);
        const std::string part = file.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
        if (part == "..") return "leaves the manifest's folder ('..')";
        if (part.empty() || part == ".") return "has an empty or '.' path component";
        if (slash == std::string::npos) return "";
        start = slash + 1;
    }
}

bool valid_name(const std::string& name) {
    if (name.empty() || name.size() > kMaxNameBytes) return false;
    for (const char c : name)
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-')) return false;
    return true;
}

}  // namespace

std::vector<ManifestEntry> read_manifest(const std::string& path) {
    const Json manifest = Json::parse_file(path, "manifest");
    const std::string where = "manifest " + printable(path, 200);
    const auto fail = [&](const std::string& what) { return std::runtime_error(where + ": " + what); };
    if (!manifest.is_object()) throw fail(std::string("expected an object, got ") + manifest.type_name());
    const Json* bundles = manifest.find("bundles");
    if (!bundles) throw fail("bundles: missing");
    if (!bundles->is_array()) throw fail(std::string("bundles: expected an array, got ") + bundles->type_name());
    if (bundles->items().size() > kMaxBundles) throw fail("bundles: more than " + std::to_string(kMaxBundles) + " entries");
    std::vector<ManifestEntry> out;
    std::set<std::string> names;
    for (size_t i = 0; i < bundles->items().size(); ++i) {
        const Json& e = bundles->items()[i];
        const std::string at = "bundles[" + std::to_string(i) + "]";
        if (!e.is_object()) throw fail(at + ": expected an object, got " + e.type_name());
        const auto field = [&](const char* key, bool (Json::*is)() const, const char* type) -> const Json& {
            const Json* v = e.find(key);
            if (!v) throw fail(at + "." + key + ": missing");
            if (!(v->*is)()) throw fail(at + "." + key + ": expected " + type + ", got " + v->type_name());
            return *v;
        };
        ManifestEntry entry;
        entry.name = field("name", &Json::is_string, "a string").as_string();
        if (!valid_name(entry.name))
            throw fail(at + ".name: '" + printable(entry.name) + "' is not 1 to " + std::to_string(kMaxNameBytes) + " of [A-Za-z0-9_.-]");
        if (!names.insert(entry.name).second) throw fail(at + ".name: '" + entry.name + "' is listed twice");
        const std::string& file = field("file", &Json::is_string, "a string").as_string();
        const std::string problem = file_problem(file);
        if (!problem.empty()) throw fail(at + ".file: '" + printable(file) + "' " + problem);
        entry.path = dir_of(path) + "/" + file;
        const Json& golden = field("golden", &Json::is_array, "an array");
        if (golden.items().empty()) throw fail(at + ".golden: empty (its length is the number of tokens to generate)");
        if (golden.items().size() > kMaxGolden) throw fail(at + ".golden: more than " + std::to_string(kMaxGolden) + " tokens");
        for (size_t k = 0; k < golden.items().size(); ++k) {
            const Json& t = golden.items()[k];
            if (!t.is_integer() || t.as_int() < 0 || t.as_int() > INT32_MAX)
                throw fail(at + ".golden[" + std::to_string(k) + "]: expected a token id in [0, 2^31), got " +
                           describe(t));
        }
        entry.golden_length = golden.items().size();
        out.push_back(entry);
    }
    return out;
}

}  // namespace kd
