// args.h: command-line flags of the form `--name value`, `-n value` and `--switch`.
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
    // unknown flag (anything not in `valued` or `switches`) or a missing value.
    Args(int argc, char** argv, int first, const std::set<std::string>& valued, const std::set<std::string>& switches);

    bool has(const std::string& flag) const { return values_.count(flag) != 0; }
    std::string str(const std::string& flag, const std::string& fallback) const;
    int integer(const std::string& flag, int fallback) const;
    // "1,2,3" -> {1, 2, 3}
    static std::vector<int32_t> int_list(const std::string& text, const std::string& flag);
    std::vector<int> int_list_or(const std::string& flag, const std::vector<int>& fallback) const;

private:
    std::map<std::string, std::string> values_;
};

}  // namespace kd
