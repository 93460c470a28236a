// A helper thread for the blocked linears of a step that runs on fewer threads than the rank has cores, which the
// caller never waits for to be scheduled.
//
// Why: a decode step of a small model is a few hundred microseconds of products split by many small ops. With two
// OpenMP threads every op ends in a barrier, and on a machine where another process (the server's front end, its
// clients) takes the second core now and then, a barrier whose other thread lost its core waits for a time slice:
// the step collapses. So such a step runs on one thread (engine/execution/cpu_threads.py), and the second core's
// idle time would be lost.
//
// Here the calling thread does all of a linear's blocks itself unless the helper, running at that moment, takes some
// of them first: chunks are claimed one at a time from one atomic word, and the caller waits only for chunks the
// helper has already started. A helper that is not scheduled takes nothing. One preempted in the middle of a chunk
// holds the caller up until it runs again, which a long step amortises and a lone stream's one-token step does not
// (the engine keeps it off there). Between jobs the helper spins for kSpin (a step's linears come a few
// microseconds apart), then sleeps on a futex until the next job.
//
// One job runs at a time: a caller that finds the pool busy (another thread's job) runs its blocks itself.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace ferry::helping {

// Runs a job's blocks [begin, end).
using ChunkFn = void (*)(const void* context, int64_t begin, int64_t end);

class Pool {
 public:
  // Blocks a job may have: the count shares one atomic word with the job's number and its next unclaimed block.
  static constexpr int64_t kMaxBlocks = (int64_t{1} << 24) - 1;

  // The process's pool, its helper started at the first call (never stopped: it sleeps while unused).
  static Pool& instance() {
    static Pool* pool = new Pool();
    return *pool;
  }

  // Calls fn(context, begin, end) over [0, n) in chunks of `grain` blocks, on this thread and on the helper where it
  // takes some. False, without running anything, when another thread's job holds the pool.
  bool run(int64_t n, int64_t grain, ChunkFn fn, const void* context) {
    if (n <= 0 || n > kMaxBlocks || busy_.test_and_set(std::memory_order_acquire)) return false;
    fn_.store(fn, std::memory_order_relaxed);
    context_.store(context, std::memory_order_relaxed);
    grain_.store(std::max<int64_t>(1, grain), std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    job_ = (job_ + 1) & kJobMask;
    state_.store(pack(job_, n, 0), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) state_.notify_all();
    work(job_, false);
    // Only chunks the helper has claimed remain: it is running them.
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4096) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
    busy_.clear(std::memory_order_release);
    return true;
  }

  // Blocks the helper has run since the process started (tests watch it take some).
  int64_t helped() const { return helped_.load(std::memory_order_relaxed); }

 private:
  static constexpr uint64_t kJobMask = 0xffff;
  static constexpr auto kSpin = std::chrono::microseconds(100);

  Pool() { std::thread([this] { serve(); }).detach(); }

  static uint64_t pack(uint64_t job, int64_t n, int64_t next) {
    return job << 48 | static_cast<uint64_t>(n) << 24 | static_cast<uint64_t>(next);
  }
  static uint64_t job_of(uint64_t state) { return state >> 48; }
  static int64_t n_of(uint64_t state) { return static_cast<int64_t>(state >> 24 & kMaxBlocks); }
  static int64_t next_of(uint64_t state) { return static_cast<int64_t>(state & kMaxBlocks); }

  // Claims the next chunk of job `job`: its first block, and its end in `end`; -1 when the job has none left (or is
  // over). A claim succeeds only while the job's blocks are not all claimed, so the job is still running and its
  // function and context are this job's.
  int64_t claim(uint64_t job, int64_t& end) {
    uint64_t state = state_.load(std::memory_order_acquire);
    for (;;) {
      const int64_t n = n_of(state), next = next_of(state);
      if (job_of(state) != job || next >= n) return -1;
      const int64_t stop = std::min(n, next + grain_.load(std::memory_order_relaxed));
      if (state_.compare_exchange_weak(state, pack(job, n, stop), std::memory_order_acq_rel,
                                       std::memory_order_acquire)) {
        end = stop;
        return next;
      }
    }
  }

  // Runs the chunks of job `job` it can claim; `helping`: on the helper thread.
  void work(uint64_t job, bool helping) {
    int64_t end = 0;
    for (int64_t begin = claim(job, end); begin >= 0; begin = claim(job, end)) {
      fn_.load(std::memory_order_relaxed)(context_.load(std::memory_order_relaxed), begin, end);
      if (helping) helped_.fetch_add(end - begin, std::memory_order_relaxed);
      done_.fetch_add(end - begin, std::memory_order_release);
    }
  }

  void serve() {
    uint64_t last = job_of(state_.load(std::memory_order_acquire));
    auto idle_since = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      const uint64_t state = state_.load(std::memory_order_acquire);
      if (job_of(state) != last) {
        last = job_of(state);
        work(last, true);
        idle_since = std::chrono::steady_clock::now();
        continue;
      }
      if (spins % 64 != 0 || std::chrono::steady_clock::now() - idle_since < kSpin) {
        _mm_pause();
        continue;
      }
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      const uint64_t seen = state_.load(std::memory_order_seq_cst);
      if (job_of(seen) == last) state_.wait(seen, std::memory_order_acquire);
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
      idle_since = std::chrono::steady_clock::now();
    }
  }

  std::atomic<uint64_t> state_{0};  // job number (16 bits), its blocks (24), its next unclaimed block (24)
  std::atomic<int64_t> done_{0};    // blocks of the current job run to the end
  std::atomic<ChunkFn> fn_{nullptr};
  std::atomic<const void*> context_{nullptr};
  std::atomic<int64_t> grain_{1};
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> helped_{0};
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;
  uint64_t job_ = 0;  // the caller's: set under busy_
};

// Whether linears on one thread take the helper (`ferry_kernels::set_linear_helper`: the engine's
// thread policy, engine/execution/cpu_threads.py). Off until set.
inline std::atomic<bool>& enabled() {
  static std::atomic<bool> on{false};
  return on;
}

}  // namespace ferry::helping
