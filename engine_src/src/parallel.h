// parallel.h: independent tasks on up to hardware_concurrency threads, their failures collected.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace kd {

// Runs task(i) for every i in `order` (a permutation of 0..n-1, taken in that order) on up to
// std::thread::hardware_concurrency() threads (fewer when no more can be started); a task returns
// "" or what went wrong, and a task that throws counts as its message. Throws the failure of the
// lowest i, whatever order they ran in. Returns the number of threads that ran.
size_t run_in_parallel(const std::vector<size_t>& order, const std::function<std::string(size_t)>& task);

}  // namespace kd
