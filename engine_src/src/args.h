// args.h: command-line flags of the form `--name value`, `-n value` and `--switch`. Every number
// is parsed exactly and range-checked; errors name the flag.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace kd {

class Args {
public:
    // switches: flags that take no value (e.g. "--json"). Throws std::runtime_error on an
    // unknown flag (anything not in `valued` or `switches`), a repeated flag or a missing value.
    Args(int argc, char** argv, int first, const std::set<std::string>& valued, const std::set<std::string>& switches);

    bool has(const std::string& flag) const { return values_.count(flag) != 0; }
    std::string str(const std::string& flag, const std::string& fallback) const;
    // The flag's integer in [lo, hi], or fallback when absent.
    int integer(const std::string& flag, int fallback, int lo, int hi) const;
    // A byte count: digits with an optional K, M, G or T suffix (powers of 1024, "GiB" too), in [lo, hi].
    uint64_t bytes(const std::string& flag, uint64_t fallback, uint64_t lo, uint64_t hi) const;
    // "1,2,3" -> {1, 2, 3}, each in [lo, hi]
    static std::vector<int32_t> int_list(const std::string& text, const std::string& flag, int lo, int hi);
    std::vector<int> int_list_or(const std::string& flag, const std::vector<int>& fallback, int lo, int hi) const;

private:
    std::map<std::string, std::string> values_;
};

}  // namespace kd
