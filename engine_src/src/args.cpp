// args.cpp
#include "args.h"
#include "json.h"

#include <stdexcept>

namespace kd {
namespace {

// A decimal integer (optional '-', then digits only) that fits int64; false otherwise.
bool parse_int64(const std::string& s, int64_t& out) {
    size_t i = s.size() > 1 && s[0] == '-' ? 1 : 0;
    if (i >= s.size()) return false;
    int64_t v = 0;
    for (; i < s.size(); ++i) {
        if (s[i] < '0' || s[i] > '9') return false;
        const int d = s[i] - '0';
        if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, s[0] == '-' ? -d : d, &v)) return false;
    }
    out = v;
    return true;
}

std::string range_text(int64_t lo, int64_t hi) { return "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]"; }

}  // namespace

Args::Args(int argc, char** argv, int first, const std::set<std::string>& valued, const std::set<std::string>& switches) {
    for (int i = first; i < argc; ++i) {
        const std::string flag = argv[i];
        if (!switches.count(flag) && !valued.count(flag)) throw std::runtime_error("unknown argument '" + printable(flag) + "'");
        if (values_.count(flag)) throw std::runtime_error("flag " + flag + " is given twice");
        if (switches.count(flag)) {
            values_[flag] = "1";
        } else {
            if (i + 1 >= argc) throw std::runtime_error("flag " + flag + " needs a value");
            values_[flag] = argv[++i];
        }
    }
}

std::string Args::str(const std::string& flag, const std::string& fallback) const {
    const auto it = values_.find(flag);
    return it == values_.end() ? fallback : it->second;
}

int Args::integer(const std::string& flag, int fallback, int lo, int hi) const {
    const auto it = values_.find(flag);
    if (it == values_.end()) return fallback;
    int64_t v = 0;
    if (!parse_int64(it->second, v) || v < lo || v > hi)
        throw std::runtime_error("flag " + flag + " expects an integer in " + range_text(lo, hi) + ", got '" + printable(it->second) + "'");
    return static_cast<int>(v);
}

uint64_t Args::bytes(const std::string& flag, uint64_t fallback, uint64_t lo, uint64_t hi) const {
    const auto it = values_.find(flag);
    if (it == values_.end()) return fallback;
    const std::string& s = it->second;
    size_t digits = 0;
    while (digits < s.size() && s[digits] >= '0' && s[digits] <= '9') ++digits;
    const std::string suffix = s.substr(digits);
    int shift = -1;
    if (suffix.empty()) shift = 0;
    else if (suffix == "K" || suffix == "KiB") shift = 10;
    else if (suffix == "M" || suffix == "MiB") shift = 20;
    else if (suffix == "G" || suffix == "GiB") shift = 30;
    else if (suffix == "T" || suffix == "TiB") shift = 40;
    int64_t n = 0;
    uint64_t v = 0;
    const bool ok = digits > 0 && shift >= 0 && parse_int64(s.substr(0, digits), n) &&
                    !__builtin_mul_overflow(static_cast<uint64_t>(n), uint64_t{1} << shift, &v) && v >= lo && v <= hi;
    if (!ok)
        throw std::runtime_error("flag " + flag + " expects a byte count (e.g. 4G, 512M, 1048576) in " + range_text(static_cast<int64_t>(lo), static_cast<int64_t>(hi)) +
                                 " bytes, got '" + printable(s) + "'");
    return v;
}

std::vector<int32_t> Args::int_list(const std::string& text, const std::string& flag, int lo, int hi) {
    std::vector<int32_t> out;
    size_t start = 0;
    while (start <= text.size()) {
        const size_t comma = text.find(',', start);
        const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        int64_t v = 0;
        if (!parse_int64(item, v))
            throw std::runtime_error("flag " + flag + " expects comma-separated integers, got '" + printable(text) + "'");
        if (v < lo || v > hi)
            throw std::runtime_error("flag " + flag + ": item " + std::to_string(out.size()) + " = " + item + " is outside " + range_text(lo, hi));
        out.push_back(static_cast<int32_t>(v));
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    return out;
}

std::vector<int> Args::int_list_or(const std::string& flag, const std::vector<int>& fallback, int lo, int hi) const {
    if (!has(flag)) return fallback;
    const std::vector<int32_t> v = int_list(str(flag, ""), flag, lo, hi);
    return std::vector<int>(v.begin(), v.end());
}

}  // namespace kd
