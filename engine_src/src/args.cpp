// args.cpp
#include "args.h"

#include <stdexcept>

namespace kd {

Args::Args(int argc, char** argv, int first, const std::set<std::string>& valued, const std::set<std::string>& switches) {
    for (int i = first; i < argc; ++i) {
        const std::string flag = argv[i];
        if (switches.count(flag)) {
            values_[flag] = "1";
        } else if (valued.count(flag)) {
            if (i + 1 >= argc) throw std::runtime_error("flag " + flag + " needs a value");
            values_[flag] = argv[++i];
        } else {
            throw std::runtime_error("unknown argument '" + flag + "'");
        }
    }
}

std::string Args::str(const std::string& flag, const std::string& fallback) const {
    const auto it = values_.find(flag);
    return it == values_.end() ? fallback : it->second;
}

int Args::integer(const std::string& flag, int fallback) const {
    const auto it = values_.find(flag);
    if (it == values_.end()) return fallback;
    size_t used = 0;
    int v = 0;
    try {
        v = std::stoi(it->second, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (used != it->second.size() || it->second.empty())
        throw std::runtime_error("flag " + flag + " expects an integer, got '" + it->second + "'");
    return v;
}

std::vector<int32_t> Args::int_list(const std::string& text, const std::string& flag) {
    std::vector<int32_t> out;
    size_t start = 0;
    while (start <= text.size()) {
        const size_t comma = text.find(',', start);
        const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        size_t used = 0;
        try {
            out.push_back(std::stoi(item, &used));
        } catch (const std::exception&) {
            used = 0;
        }
        if (item.empty() || used != item.size())
            throw std::runtime_error("flag " + flag + " expects comma-separated integers, got '" + text + "'");
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    return out;
}

std::vector<int> Args::int_list_or(const std::string& flag, const std::vector<int>& fallback) const {
    if (!has(flag)) return fallback;
    const std::vector<int32_t> v = int_list(str(flag, ""), flag);
    return std::vector<int>(v.begin(), v.end());
}

}  // namespace kd
