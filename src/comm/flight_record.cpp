// The flight recorder and its JSON (see flight_record.h).
#include "flight_record.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <thread>

namespace dtrain::comm {

const char* name_of(FlightEntry::State s) {
  switch (s) {
    case FlightEntry::State::queued:
      return "queued";
    case FlightEntry::State::running:
      return "running";
    case FlightEntry::State::done:
      return "done";
    case FlightEntry::State::failed:
      return "failed";
  }
  return "?";
}

}  // namespace dtrain::comm

namespace dtrain::comm::detail {

// ---------------------------------------------------------------------------------- FlightRecorder

FlightRecorder::Lock::Lock(const std::atomic<bool>& f) : flag(const_cast<std::atomic<bool>&>(f)) {
  for (int spins = 0; flag.exchange(true, std::memory_order_acquire); ++spins) {
    if (spins > 64) std::this_thread::yield();
  }
}

FlightRecorder::Lock::~Lock() { flag.store(false, std::memory_order_release); }

uint64_t FlightRecorder::write(const char* op, uint64_t seq, bool collective, size_t bytes, int peer,
                               FlightEntry::State state, Clock::time_point queued, Clock::time_point started,
                               Clock::time_point finished, std::string error) {
  Lock lock(busy_);
  const uint64_t id = next_++;
  const size_t slot = next_slot_;  // id % ring_.size(), without a division on the latency path
  next_slot_ = slot + 1 == ring_.size() ? 0 : slot + 1;
  FlightEntry& e = ring_[slot];
  e.seq = seq;
  e.op = op;
  e.collective = collective;
  e.bytes = bytes;
  e.peer = peer;
  e.state = state;
  e.queued_at = queued;
  e.started_at = started;
  e.finished_at = finished;
  e.error = std::move(error);
  ids_[slot] = id;
  return id;
}

uint64_t FlightRecorder::queued(const char* op, uint64_t seq, bool collective, size_t bytes, int peer, bool running) {
  if (ring_.empty()) return UINT64_MAX;
  const auto now = Clock::now();
  return write(op, seq, collective, bytes, peer, running ? FlightEntry::State::running : FlightEntry::State::queued,
               now, running ? now : Clock::time_point{}, Clock::time_point{}, {});
}

FlightEntry* FlightRecorder::find(uint64_t id) {
  if (ring_.empty() || id == UINT64_MAX) return nullptr;
  const size_t slot = id % ring_.size();
  return ids_[slot] == id ? &ring_[slot] : nullptr;
}

void FlightRecorder::started(uint64_t id) {
  if (id == UINT64_MAX) return;
  const auto now = Clock::now();
  Lock lock(busy_);
  if (FlightEntry* e = find(id)) {
    e->state = FlightEntry::State::running;
    e->started_at = now;
  }
}

namespace {
std::string error_text(const std::exception_ptr& error) {
  if (!error) return {};
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown error";
  }
}
}  // namespace

void FlightRecorder::completed(const char* op, uint64_t seq, size_t bytes, int peer, Clock::time_point start,
                               const std::exception_ptr& error) {
  if (ring_.empty()) return;
  const auto now = error ? Clock::now() : start;  // no clock read on the success path (see FlightEntry)
  write(op, seq, true, bytes, peer, error ? FlightEntry::State::failed : FlightEntry::State::done, start, start, now,
        error_text(error));
}

void FlightRecorder::ended(uint64_t id, const std::exception_ptr& error) {
  if (id == UINT64_MAX) return;
  std::string what = error_text(error);
  const auto now = Clock::now();
  Lock lock(busy_);
  if (FlightEntry* e = find(id)) {
    e->state = error ? FlightEntry::State::failed : FlightEntry::State::done;
    e->finished_at = now;
    if (e->started_at == Clock::time_point{}) e->started_at = e->finished_at;
    e->error = std::move(what);
  }
}

std::optional<FlightEntry> FlightRecorder::oldest_pending() const {
  Lock lock(busy_);
  const size_t n = ring_.size();
  const uint64_t first = next_ > n ? next_ - n : 0;
  for (uint64_t id = first; id < next_; ++id) {
    const FlightEntry& e = ring_[id % n];
    if (e.state == FlightEntry::State::queued || e.state == FlightEntry::State::running) return e;
  }
  return std::nullopt;
}

std::vector<FlightEntry> FlightRecorder::entries() const {
  Lock lock(busy_);
  std::vector<FlightEntry> out;
  const size_t n = ring_.size();
  const uint64_t first = next_ > n ? next_ - n : 0;
  for (uint64_t id = first; id < next_; ++id) out.push_back(ring_[id % n]);
  return out;
}

std::string flight_record_json(const std::string& group, int rank, int size, const std::string& transport,
                               const std::vector<FlightEntry>& entries, const std::vector<int>& members) {
  const auto now = Clock::now();
  auto ago = [&](Clock::time_point t) {
    return t == Clock::time_point{} ? std::string("null")
                                    : fmt::format("{:.3f}", std::chrono::duration<double, std::milli>(now - t).count());
  };
  std::string out =
      fmt::format(R"({{"group":"{}","rank":{},"size":{},"transport":"{}",)", json_escape(group), rank, size, transport);
  if (!members.empty()) out += fmt::format(R"("members":[{}],)", fmt::join(members, ","));
  out += R"("entries":[)";
  bool first = true;
  for (const FlightEntry& e : entries) {
    out += fmt::format(
        R"({}{{"seq":{},"op":"{}","collective":{},"bytes":{},"peer":{},"state":"{}","queued_ms_ago":{},"started_ms_ago":{},"finished_ms_ago":{},"error":"{}"}})",
        first ? "" : ",", e.seq, e.op, e.collective, e.bytes, e.peer, name_of(e.state), ago(e.queued_at),
        ago(e.started_at), ago(e.finished_at), json_escape(e.error));
    first = false;
  }
  return out + "]}";
}

std::string pending_json(const std::string& group, const std::optional<FlightEntry>& pending) {
  if (!pending) return {};
  const FlightEntry& e = *pending;
  const Clock::time_point since = e.started_at != Clock::time_point{} ? e.started_at : e.queued_at;
  return fmt::format(R"({{"group":"{}","op":"{}","seq":{},"state":"{}","ms":{:.1f}}})", json_escape(group), e.op, e.seq,
                     name_of(e.state), std::chrono::duration<double, std::milli>(Clock::now() - since).count());
}

std::string json_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20 || u >= 0x7f) {
      out += fmt::format("\\u{:04x}", u);
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace dtrain::comm::detail
