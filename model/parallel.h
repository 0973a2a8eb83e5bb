// Carries an exception out of an OpenMP parallel region. An exception that
// leaves a region's structured block terminates the process (exit 134), so
// work inside a region runs through run(), which records the first
// exception and makes later work skip; rethrow() after the region throws it
// on the calling thread, where the CLI turns it into its one-line error.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>

namespace kvq::model {

class ParallelErrors {
 public:
  // Runs f unless an earlier call failed; never throws.
  template <typename F>
  void run(F&& f) noexcept {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      f();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!first_) first_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::exception_ptr first_;
};

}  // namespace kvq::model
