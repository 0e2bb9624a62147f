// sha256.h: SHA-256 (FIPS 180-4), for the KDTR readers' hashes (bundle.cpp): plain C++17, and the
// CPU's SHA extensions (x86-64 SHA-NI) where it has them, about 5 times as fast.
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
    // portable: the plain C++ rounds even where the CPU has SHA extensions (the tests compare both).
    explicit Sha256(bool portable = false);
    void update(const void* data, size_t n);
    Digest digest();  // pads and finishes; the object is spent afterwards

private:
    void blocks(const uint8_t* p, size_t n);  // n whole 64-byte blocks
    bool accelerated_;
    uint32_t h_[8];
    uint8_t buf_[64];
    size_t used_ = 0;
    uint64_t total_ = 0;  // bytes hashed so far
};

// The SHA-256 of n bytes at data.
Digest sha256(const void* data, size_t n);
// Whether this CPU's SHA extensions do the hashing (else the plain C++ rounds).
bool sha256_accelerated();
// Lower-case hex of a digest.
std::string hex(const Digest& d);

}  // namespace kd
