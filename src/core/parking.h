// src/core/parking.h — a 32-bit word that threads wait on to change (internal).
//
// The hand-over of the worker pool and the local communicator's barrier both wait for
// a counter to move: a short spin, then a park in the kernel. ParkingWord makes the
// wake-up free when nobody is parked (Note [Parking]).
//
//   ParkingWord posted;
//   std::uint32_t seen = posted.await_change(seen, kSpins);   // waiter
//   posted.bump();                                             // notifier: +1, wakes one
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>
#endif

namespace dp::detail {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Note [Parking]
// A waiter spins on the word for a bounded number of pause instructions, then parks:
// it counts itself in `parked_`, looks at the word once more and, if it still holds
// the old value, sleeps in a futex wait on it. A notifier changes the word and makes a
// wake system call only when `parked_` is non-zero. Both sides use sequentially
// consistent operations (waiter: increment parked_, then load the word; notifier:
// change the word, then load parked_), so at least one of them sees the other's write:
// either the waiter sees the new value and does not sleep, or the notifier sees the
// waiter and wakes it — and a wake that comes between the waiter's look and its futex
// wait is caught by the kernel, which sleeps only while the word still holds the old
// value. A hand-over between threads that are both spinning (the common case inside a
// step) thus costs no system call at all.
// The park is bounded (kParkLimitNs) and the word re-checked after it, so even a
// missed wake-up — there is none by the argument above — would cost one bound, never
// a hang. Elsewhere than Linux, std::atomic::wait/notify stand in for the futex.
class ParkingWord {
 public:
  static constexpr std::int64_t kParkLimitNs = 20'000'000;  // 20 ms

  /// `park_limit_ns` bounds one park (tests make it long, to turn a lost wake-up into
  /// a hang that the test's timeout reports).
  explicit ParkingWord(std::int64_t park_limit_ns = kParkLimitNs) : park_limit_ns_(park_limit_ns) {}

  std::uint32_t load(std::memory_order order = std::memory_order_acquire) const { return word_.load(order); }

  /// Returns the word's value once it differs from `old`: `spins` pause instructions
  /// first, then parked.
  std::uint32_t await_change(std::uint32_t old, int spins) const {
    for (int i = 0; i < spins; ++i) {
      const std::uint32_t v = word_.load(std::memory_order_acquire);
      if (v != old) return v;
      cpu_relax();
    }
    for (;;) {
      parked_.fetch_add(1, std::memory_order_seq_cst);
      if (word_.load(std::memory_order_seq_cst) == old) park(old);
      parked_.fetch_sub(1, std::memory_order_release);
      const std::uint32_t v = word_.load(std::memory_order_acquire);
      if (v != old) return v;
    }
  }

  /// Adds one and wakes `waiters` parked threads (INT_MAX: all) if any is parked.
  /// Returns the new value.
  std::uint32_t bump(int waiters = 1) {
    const std::uint32_t v = word_.fetch_add(1, std::memory_order_seq_cst) + 1;
    if (parked_.load(std::memory_order_seq_cst) != 0) wake(waiters);
    return v;
  }

  /// Sets the word and wakes as bump() does.
  void set(std::uint32_t v, int waiters = 1) {
    word_.store(v, std::memory_order_seq_cst);
    if (parked_.load(std::memory_order_seq_cst) != 0) wake(waiters);
  }

 private:
  void park(std::uint32_t old) const {
#if defined(__linux__)
    const timespec limit{static_cast<time_t>(park_limit_ns_ / 1'000'000'000),
                         static_cast<long>(park_limit_ns_ % 1'000'000'000)};
    // EAGAIN (moved already), EINTR and ETIMEDOUT all mean: look again.
    syscall(SYS_futex, reinterpret_cast<const std::uint32_t*>(&word_), FUTEX_WAIT_PRIVATE, old, &limit, nullptr,
            0);
#else
    word_.wait(old, std::memory_order_acquire);
#endif
  }
  void wake(int waiters) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word_), FUTEX_WAKE_PRIVATE, waiters, nullptr, nullptr, 0);
#else
    if (waiters == 1) word_.notify_one();
    else word_.notify_all();
#endif
  }

  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t) &&
                    std::atomic<std::uint32_t>::is_always_lock_free,
                "a futex word is a plain 32-bit integer");
  alignas(64) std::atomic<std::uint32_t> word_{0};
  mutable std::atomic<std::uint32_t> parked_{0};
  std::int64_t park_limit_ns_;
};

}  // namespace dp::detail
