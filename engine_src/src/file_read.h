// file_read.h: a whole file read into memory with pread on parallel threads (the bundle's bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace kd {

// An allocator whose value-initialising construct() default-initialises, so a vector of bytes
// sized with it is not zero-filled: sizing one touches no page. The reader writes every byte, and
// a zero fill first would touch each page of a 13 GB bundle once more (slow where page faults
// are: docs/engine/bundle-format.md, "Loading").
template <class T>
struct UninitAllocator : std::allocator<T> {
    template <class U>
    struct rebind {
        using other = UninitAllocator<U>;
    };
    UninitAllocator() = default;
    template <class U>
    UninitAllocator(const UninitAllocator<U>&) noexcept {}
    template <class U>
    void construct(U* p) noexcept(std::is_nothrow_default_constructible<U>::value) {
        ::new (static_cast<void*>(p)) U;
    }
    template <class U, class... A>
    void construct(U* p, A&&... a) {
        ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
    }
};

using FileBytes = std::vector<uint8_t, UninitAllocator<uint8_t>>;

// Bytes one pread task reads: every thread gets several of a big file, and one syscall's cost is
// nothing beside copying them.
constexpr uint64_t kReadChunk = uint64_t{32} << 20;

// A regular file open for reading, with its size and modification time at opening. Errors throw
// std::runtime_error saying what went wrong; callers name the file.
class InputFile {
public:
    // Throws "cannot open the file: <errno text>" or "not a regular file".
    explicit InputFile(const std::string& path);
    ~InputFile();
    InputFile(const InputFile&) = delete;
    InputFile& operator=(const InputFile&) = delete;

    uint64_t size() const { return size_; }
    // The whole file: chunks of `chunk` bytes read with pread on up to hardware_concurrency
    // threads (*threads: how many ran). Throws, for the lowest chunk that failed, "cannot read
    // bytes [a, b) at offset o: <errno text>" or "short read at offset o: ..." (the file ended
    // before its size at opening); then "the file changed size while read: ..." or "the file
    // changed while read: ..." when its size or modification time after the read differ from
    // those at opening.
    FileBytes read_all(size_t* threads = nullptr, uint64_t chunk = kReadChunk) const;

private:
    int fd_ = -1;
    uint64_t size_ = 0;
    int64_t mtime_ns_ = 0;
};

}  // namespace kd
