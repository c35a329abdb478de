// Shared by the comm, Group and DataParallel tests: ranks as threads over one in-memory store.
#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/group.h"

namespace dtrain::comm::test_util {

// Milliseconds since `start`.
inline std::chrono::milliseconds since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
}

// Polls `cond` until it holds or `timeout` passes (for counters another thread updates).
template <typename F>
bool eventually(F cond, std::chrono::milliseconds timeout = std::chrono::milliseconds(2000)) {
  const auto deadline = Clock::now() + timeout;
  while (!cond()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Options for tests: a timeout short enough that a hang fails the test soon.
inline GroupOptions quick_options() {
  GroupOptions o;
  o.timeout = std::chrono::seconds(30);
  return o;
}

// Runs fn(group) on `size` threads, each joining one new group through one in-memory store
// with options_of(rank); rethrows the first failure (in rank order) on the calling thread.
inline void run_ranks(int size, const std::function<void(Group&)>& fn,
                      const std::function<GroupOptions(int rank)>& options_of) {
  auto store = make_memory_store();
  static std::atomic<int> job{0};
  const std::string name = "test" + std::to_string(job++);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        Group g = Group::create(store, r, size, options_of(r), name);
        fn(g);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// The same, every rank with the same options.
inline void run_ranks(int size, const std::function<void(Group&)>& fn, const GroupOptions& opts = {}) {
  run_ranks(size, fn, [&](int) { return opts; });
}

}  // namespace dtrain::comm::test_util
