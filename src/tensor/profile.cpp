// Time per op kind (profile.h). Each thread keeps the kind it is charging now and since when;
// entering or leaving a scope charges the time since then to that kind (so an outer scope is
// not charged while an inner one runs) and switches. The totals are process-wide atomics.
#include "dtrain/tensor/profile.h"

#include <time.h>

#include <array>
#include <atomic>

namespace dtrain::profile {

namespace {

struct Totals {
  std::array<std::atomic<int64_t>, kKinds> forward_ns{};
  std::array<std::atomic<int64_t>, kKinds> backward_ns{};
  std::array<std::atomic<int64_t>, kKinds> calls{};
};

Totals& totals() {
  static Totals t;
  return t;
}

struct ThreadState {
  bool active = false;  // a scope is open on this thread
  Kind current = Kind::matmul;
  int64_t since_ns = 0;
  bool backward = false;
};
thread_local ThreadState t_state;

int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void charge(ThreadState& s, int64_t now) {
  if (!s.active) return;
  auto& slot = (s.backward ? totals().backward_ns : totals().forward_ns)[static_cast<size_t>(s.current)];
  slot.fetch_add(now - s.since_ns, std::memory_order_relaxed);
}

}  // namespace

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::matmul:
      return "matmul";
    case Kind::linear:
      return "linear";
    case Kind::layer_norm:
      return "layer_norm";
    case Kind::gelu:
      return "gelu";
    case Kind::softmax:
      return "softmax";
    case Kind::attention:
      return "attention";
    case Kind::cross_entropy:
      return "cross_entropy";
    case Kind::embedding:
      return "embedding";
    case Kind::elementwise:
      return "elementwise";
    case Kind::dropout:
      return "dropout";
    case Kind::grad_accumulate:
      return "grad_accumulate";
    case Kind::bucket_copy:
      return "bucket_copy";
    case Kind::comm_wait:
      return "comm_wait";
    case Kind::optimizer:
      return "optimizer";
    case Kind::grad_zero:
      return "grad_zero";
    case Kind::data:
      return "data";
    case Kind::count:
      break;
  }
  return "?";
}

void set_enabled(bool on) { detail::g_enabled.store(on, std::memory_order_relaxed); }

bool enabled() { return detail::enabled_fast(); }

void reset() {
  Totals& t = totals();
  for (int k = 0; k < kKinds; ++k) {
    t.forward_ns[static_cast<size_t>(k)].store(0, std::memory_order_relaxed);
    t.backward_ns[static_cast<size_t>(k)].store(0, std::memory_order_relaxed);
    t.calls[static_cast<size_t>(k)].store(0, std::memory_order_relaxed);
  }
}

std::vector<Entry> snapshot() {
  Totals& t = totals();
  std::vector<Entry> out;
  for (int k = 0; k < kKinds; ++k) {
    const auto i = static_cast<size_t>(k);
    Entry e;
    e.kind = static_cast<Kind>(k);
    e.forward_s = static_cast<double>(t.forward_ns[i].load(std::memory_order_relaxed)) * 1e-9;
    e.backward_s = static_cast<double>(t.backward_ns[i].load(std::memory_order_relaxed)) * 1e-9;
    e.calls = t.calls[i].load(std::memory_order_relaxed);
    out.push_back(e);
  }
  return out;
}

namespace detail {

void enter(Kind kind, Kind* saved, bool* saved_active) {
  ThreadState& s = t_state;
  const int64_t now = now_ns();
  charge(s, now);
  *saved = s.current;
  *saved_active = s.active;
  s.current = kind;
  s.active = true;
  s.since_ns = now;
  totals().calls[static_cast<size_t>(kind)].fetch_add(1, std::memory_order_relaxed);
}

void leave(Kind saved, bool saved_active) {
  ThreadState& s = t_state;
  const int64_t now = now_ns();
  charge(s, now);
  s.current = saved;
  s.active = saved_active;
  s.since_ns = now;
}

}  // namespace detail

BackwardPhase::BackwardPhase() : saved_(t_state.backward) {
  // Time so far belongs to the phase it ran in.
  if (t_state.active) {
    const int64_t now = now_ns();
    charge(t_state, now);
    t_state.since_ns = now;
  }
  t_state.backward = true;
}

BackwardPhase::~BackwardPhase() {
  if (t_state.active) {
    const int64_t now = now_ns();
    charge(t_state, now);
    t_state.since_ns = now;
  }
  t_state.backward = saved_;
}

}  // namespace dtrain::profile
