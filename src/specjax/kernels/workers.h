// specjax CPU kernels: the helper threads that share a kernel call's work with its caller, kept spinning between
// the calls of a step.
//
// A decoding step of SmolLM2 makes ~150 kernel calls (4 products and an attention per layer, the head), each split
// between the calling thread and a helper.  Handing the helper its share through XLA:CPU's intra-op pool
// (ffi::ThreadPool::Schedule) wakes a sleeping pool thread: 7-9 us of the caller's time per call on the 2-vCPU VM
// (a futex wake and an inter-processor interrupt), ~1 ms of a ~7 ms step.  These helpers instead spin for
// kSpinMicros after their last job, so a call inside a step hands over its share with a queue push, and sleep
// on a condition variable once the step is over (the first call of the next step pays one wake).  While spinning
// they yield the core every ~2 us, so an XLA:CPU thread that needs it (its executor moves between its pool's
// threads) is not kept waiting for the scheduler's time slice.
//
// Only calls of at most kMaxSpinTokens tokens go to them (Share): a decoding or verification step at batch 1, whose
// XLA fusions run on one thread.  Wider steps' fusions run on XLA:CPU's pool, and a helper spinning beside them
// took a core they needed (batch 8 x 4 rows: 0.93x the step, its fusions 2-3x slower); their calls are long enough
// for a pool thread's wake not to matter, so they go to the pool as before.
//
// The caller never waits for a helper to start (a job a busy or sleeping helper has not begun finds its call's
// work taken and returns): the kernels' items are claimed from shared counters, and the caller waits only for items
// a helper has claimed and is running.  Every kernel library built from this directory uses one set of helpers: the
// instance lives in an inline function's static, which GCC emits as a unique global symbol that the dynamic linker
// binds once across libraries (otherwise each library's helpers would spin beside the other's).  The namespace
// carries a version: change it whenever this file changes, so libraries of two revisions loaded together
// (scripts/kernel_step_ab.py) do not share helpers whose code or layout they disagree on.
#pragma once

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"

namespace specjax_workers_v4 {

constexpr int64_t kSpinMicros = 200;  // a step's gaps between kernel calls are its XLA fusions: ~1-20 us each
constexpr int64_t kMaxSpinTokens = 16;  // the widest call that goes to the spinning helpers (see above)

class Workers {
 public:
  // The process's helpers (new ones after a fork: the parent's threads do not exist in the child).
  static Workers& Get() {
    static std::atomic<Workers*> instance{nullptr};
    static std::once_flag fork_handler;
    std::call_once(fork_handler, [] { pthread_atfork(nullptr, nullptr, [] { instance.store(nullptr); }); });
    Workers* w = instance.load(std::memory_order_acquire);
    if (w == nullptr) {
      Workers* fresh = new Workers();  // never deleted: its threads run until the process ends
      if (instance.compare_exchange_strong(w, fresh, std::memory_order_acq_rel)) return *fresh;
      delete fresh;  // another thread installed one first (it has no threads yet)
    }
    return *w;
  }

  // fn(1) .. fn(copies) on up to `copies` helpers as they come free; returns at once.
  void Post(int copies, const std::function<void(int)>& fn) {
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (threads_ < copies) {
        std::thread([this] { Loop(); }).detach();
        ++threads_;
      }
      for (int i = 1; i <= copies; ++i) jobs_.emplace_back(fn, i);
      queued_.fetch_add(copies, std::memory_order_release);
      wake = sleepers_ > 0;
    }
    if (wake) cv_.notify_all();
  }

 private:
  void Loop() {
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
      for (int64_t i = 1; queued_.load(std::memory_order_acquire) == 0; ++i) {
        _mm_pause();
        if (i % 64 == 0) {  // every ~2 us: a thread waiting for this core (an XLA:CPU pool task) gets it at once
          if (std::chrono::steady_clock::now() > until) break;
          sched_yield();
        }
      }
      std::pair<std::function<void(int)>, int> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (jobs_.empty()) {
          ++sleepers_;
          cv_.wait(lock, [this] { return !jobs_.empty(); });
          --sleepers_;
        }
        job = std::move(jobs_.front());
        jobs_.pop_front();
        queued_.fetch_sub(1, std::memory_order_release);
      }
      job.first(job.second);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::function<void(int)>, int>> jobs_;  // guarded by mu_
  std::atomic<int64_t> queued_{0};                               // jobs_.size(), read without the lock
  int threads_ = 0, sleepers_ = 0;                               // guarded by mu_
};

// fn(1) .. fn(copies) beside the caller: on the spinning helpers for a call of at most kMaxSpinTokens tokens, else
// on XLA:CPU's intra-op pool.  Returns at once either way.
template <class Fn>
inline void Share(xla::ffi::ThreadPool& pool, int64_t tokens, int copies, const Fn& fn) {
  if (copies <= 0) return;
  if (tokens <= kMaxSpinTokens) {
    Workers::Get().Post(copies, fn);
    return;
  }
  for (int i = 1; i <= copies; ++i) pool.Schedule([fn, i] { fn(i); });
}

}  // namespace specjax_workers_v4
