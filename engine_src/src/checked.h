// checked.h: overflow-checked size arithmetic. Every size, offset or index computed from input
// (a bundle header, a manifest, a flag) goes through these, so a wrapped value can never pass a
// bounds check. On overflow they throw std::runtime_error naming `what`.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace kd {

inline uint64_t checked_add(uint64_t a, uint64_t b, const std::string& what) {
    uint64_t r = 0;
    if (__builtin_add_overflow(a, b, &r)) throw std::runtime_error(what + " overflows 64 bits");
    return r;
}

inline uint64_t checked_mul(uint64_t a, uint64_t b, const std::string& what) {
    uint64_t r = 0;
    if (__builtin_mul_overflow(a, b, &r)) throw std::runtime_error(what + " overflows 64 bits");
    return r;
}

// a * b as an int, for sizes the engine keeps in int; throws when the product leaves
// [0, INT32_MAX] or an operand is negative.
inline int checked_int_mul(int64_t a, int64_t b, const std::string& what) {
    int64_t r = 0;
    if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r) || r > INT32_MAX)
        throw std::runtime_error(what + " = " + std::to_string(a) + " x " + std::to_string(b) + " does not fit in 31 bits");
    return static_cast<int>(r);
}

}  // namespace kd
