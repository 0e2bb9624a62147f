// sha256.h: SHA-256 (FIPS 180-4) in plain C++17, for the KDTR readers' hashes (bundle.cpp).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace kd {

using Digest = std::array<uint8_t, 32>;

// Incremental SHA-256: update() with any number of byte ranges, then digest() once.
class Sha256 {
public:
    Sha256();
    void update(const void* data, size_t n);
    Digest digest();  // pads and finishes; the object is spent afterwards

private:
    void block(const uint8_t* p);
    uint32_t h_[8];
    uint8_t buf_[64];
    size_t used_ = 0;
    uint64_t total_ = 0;  // bytes hashed so far
};

// The SHA-256 of n bytes at data.
Digest sha256(const void* data, size_t n);
// Lower-case hex of a digest.
std::string hex(const Digest& d);

}  // namespace kd
