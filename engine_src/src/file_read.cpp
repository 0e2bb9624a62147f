// file_read.cpp: see file_read.h.
#include "file_read.h"
#include "parallel.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace kd {
namespace {

// strerror's text, from threads at once (strerror itself may share a buffer between them).
std::string errno_text(int e) {
    char buf[256];
    const char* text = strerror_r(e, buf, sizeof buf);  // the GNU variant: may return a static string
    return std::string(text) + " (errno " + std::to_string(e) + ")";
}

int64_t mtime_ns(const struct stat& st) { return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec; }

}  // namespace

InputFile::InputFile(const std::string& path) {
    // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0) throw std::runtime_error("cannot open the file: " + errno_text(errno));
    struct stat st;
    if (::fstat(fd_, &st) != 0) {
        const int e = errno;
        ::close(fd_);
        throw std::runtime_error("cannot stat the file: " + errno_text(e));
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd_);
        throw std::runtime_error("cannot read the file (not a regular file)");
    }
    size_ = static_cast<uint64_t>(st.st_size);
    mtime_ns_ = mtime_ns(st);
}

InputFile::~InputFile() { ::close(fd_); }

FileBytes InputFile::read_all(size_t* threads, uint64_t chunk) const {
    FileBytes bytes(static_cast<size_t>(size_));
    const uint64_t n_chunks = (size_ + chunk - 1) / chunk;
    std::vector<size_t> order(static_cast<size_t>(n_chunks));
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    const auto read_chunk = [&](size_t k) -> std::string {
        const uint64_t begin = k * chunk, end = std::min(size_, begin + chunk);
        for (uint64_t at = begin; at < end;) {
            const ssize_t got = ::pread(fd_, bytes.data() + at, static_cast<size_t>(end - at), static_cast<off_t>(at));
            if (got < 0 && errno == EINTR) continue;
            if (got < 0)
                return "cannot read bytes [" + std::to_string(begin) + ", " + std::to_string(end) + ") at offset " + std::to_string(at) +
                       ": " + errno_text(errno);
            if (got == 0)
                return "short read at offset " + std::to_string(at) + ": the file ends there, it had " + std::to_string(size_) +
                       " bytes when opened (it shrank while read)";
            at += static_cast<uint64_t>(got);
        }
        return "";
    };
    const size_t ran = run_in_parallel(order, read_chunk);
    if (threads) *threads = ran;
    struct stat st;
    if (::fstat(fd_, &st) != 0) throw std::runtime_error("cannot stat the file after reading it: " + errno_text(errno));
    if (static_cast<uint64_t>(st.st_size) != size_)
        throw std::runtime_error("the file changed size while read: " + std::to_string(size_) + " bytes when opened, " +
                                 std::to_string(st.st_size) + " after the read");
    if (mtime_ns(st) != mtime_ns_) throw std::runtime_error("the file changed while read: its modification time moved");
    return bytes;
}

}  // namespace kd
