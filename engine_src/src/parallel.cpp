// parallel.cpp: see parallel.h.
#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <system_error>
#include <thread>

namespace kd {

size_t run_in_parallel(const std::vector<size_t>& order, const std::function<std::string(size_t)>& task) {
    std::vector<std::string> errors(order.size());
    std::atomic<size_t> next{0};
    const auto work = [&] {
        for (size_t k; (k = next++) < order.size();) {
            try {
                errors[order[k]] = task(order[k]);
            } catch (const std::exception& e) {  // never out of a thread: that would terminate the process
                errors[order[k]] = e.what();
            }
        }
    };
    const size_t n = std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()), std::max<size_t>(order.size(), 1));
    std::vector<std::thread> threads;
    for (size_t i = 1; i < n; ++i) {
        try {
            threads.emplace_back(work);
        } catch (const std::system_error&) {
            break;  // no more threads to be had: the ones started and this one do the rest
        }
    }
    work();
    for (std::thread& t : threads) t.join();
    for (const std::string& e : errors)
        if (!e.empty()) throw std::runtime_error(e);
    return threads.size() + 1;
}

}  // namespace kd
