// ParkingWord (Note [Parking]): no wake-up is lost when the notifier skips the system
// call for a word nobody is parked on. Every park here is bounded by an hour, so a lost
// wake-up is a hang that the suite's timeout reports.
#include <doctest/doctest.h>

#include <climits>
#include <cstdint>
#include <thread>
#include <vector>

#include "core/parking.h"

namespace {

using dp::detail::ParkingWord;
constexpr std::int64_t kHour = 3'600'000'000'000;

// Two threads hand a token back and forth through two words: each waits for its own
// word to move, then bumps the other's. With `spins` = 0 every wait parks at once, the
// case where a missed wake-up would show.
void ping_pong(int spins, int rounds) {
  ParkingWord ping(kHour), pong(kHour);
  std::thread other([&] {
    std::uint32_t seen = 0;
    for (int i = 0; i < rounds; ++i) {
      seen = ping.await_change(seen, spins);
      pong.bump();
    }
  });
  std::uint32_t seen = 0;
  for (int i = 0; i < rounds; ++i) {
    ping.bump();
    seen = pong.await_change(seen, spins);
  }
  other.join();
  CHECK(ping.load() == static_cast<std::uint32_t>(rounds));
  CHECK(pong.load() == static_cast<std::uint32_t>(rounds));
}

}  // namespace

TEST_CASE("a value that already moved is returned without waiting") {
  ParkingWord w(kHour);
  w.set(7);
  CHECK(w.await_change(3, 0) == 7);
  CHECK(w.bump() == 8);
  CHECK(w.await_change(7, 0) == 8);
}

TEST_CASE("ping-pong through parked waits loses no wake-up") {
  SUBCASE("always parked") { ping_pong(0, 5000); }
  SUBCASE("a few spins, then parked") { ping_pong(16, 5000); }
  SUBCASE("spinning") { ping_pong(1 << 14, 20000); }
}

TEST_CASE("one bump wakes every parked waiter when asked to") {
  ParkingWord w(kHour);
  constexpr int kWaiters = 4;
  for (int round = 0; round < 200; ++round) {
    const std::uint32_t old = w.load();
    std::vector<std::uint32_t> got(kWaiters, old);
    std::vector<std::thread> waiters;
    for (int i = 0; i < kWaiters; ++i) waiters.emplace_back([&, i] { got[i] = w.await_change(old, 0); });
    w.bump(INT_MAX);
    for (auto& t : waiters) t.join();
    for (std::uint32_t v : got) CHECK(v == old + 1);
  }
}
