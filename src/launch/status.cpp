// Reading and showing a job's live status (status.h).
#include "dtrain/launch/status.h"

#include <fmt/format.h>

#include <chrono>
#include <nlohmann/json.hpp>

#include "dtrain/core/error.h"

namespace dtrain::launch {

namespace {

double unix_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::system_clock::now().time_since_epoch()).count();
}

RankStatus parse_rank(int rank, const std::string& text, double now_ms) {
  RankStatus s;
  s.rank = rank;
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object()) return s;
  s.published = true;
  s.pid = j.value("pid", 0);
  s.host = j.value("host", "");
  s.step = j.value("step", int64_t{-1});
  s.what = j.value("what", "");
  const double what_ms = j.value("what_ms", -1.0), wait_ms = j.value("wait_ms", -1.0);
  const double interval_ms = j.value("interval_ms", 1000.0), timeout_ms = j.value("timeout_ms", 0.0);
  s.age_s = std::max(0.0, now_ms - j.value("time_ms", now_ms)) / 1000.0;
  // Two missed beats: the heartbeat thread itself stands still (SIGSTOP, a dead host).
  s.stale = s.age_s * 1000.0 > std::max(2.0 * interval_ms, interval_ms + 1000.0);
  // The durations as published; a stale rank is still where it was, so they grew with the age.
  const double grown = s.stale ? s.age_s : 0.0;
  s.what_s = what_ms >= 0 ? what_ms / 1000.0 + grown : -1;
  s.wait_s = wait_ms >= 0 ? wait_ms / 1000.0 + grown : -1;
  s.rate = j.value("rate", -1.0);
  s.unit = j.value("unit", "");
  s.timeout_s = timeout_ms / 1000.0;
  if (j.contains("ops") && j["ops"].is_array() && !j["ops"].empty()) {
    // The one that has waited longest.
    const nlohmann::json* oldest = nullptr;
    for (const auto& op : j["ops"]) {
      if (oldest == nullptr || op.value("ms", 0.0) > oldest->value("ms", 0.0)) oldest = &op;
    }
    s.op = fmt::format("{} #{} on '{}'", oldest->value("op", "?"), oldest->value("seq", uint64_t{0}),
                       oldest->value("group", "?"));
    s.op_s = oldest->value("ms", 0.0) / 1000.0 + grown;
  }
  s.stuck = !s.stale && timeout_ms > 0 && s.wait_s < 0 && s.what_s * 1000.0 > timeout_ms;
  return s;
}

std::string seconds(double s) {
  if (s < 0) return "-";
  if (s < 10) return fmt::format("{:.1f} s", s);
  if (s < 600) return fmt::format("{:.0f} s", s);
  return fmt::format("{}m{:02}s", static_cast<int64_t>(s) / 60, static_cast<int64_t>(s) % 60);
}

}  // namespace

JobStatus read_job_status(comm::Store& store) {
  const auto world = store.try_get(kJobWorldKey);
  DT_CHECK(world.has_value(), "status", "the store has no '{}' key: not a job started by dtrain launch", kJobWorldKey);
  const nlohmann::json w = nlohmann::json::parse(*world, nullptr, false);
  DT_CHECK(w.is_object() && w.contains("name") && w.contains("size"), "status", "the store's '{}' is unreadable: {}",
           kJobWorldKey, *world);
  JobStatus out;
  out.world = w["name"].get<std::string>();
  out.size = w["size"].get<int>();
  DT_CHECK(out.size >= 0 && out.size <= (1 << 20), "status", "the store's '{}' names {} ranks", kJobWorldKey, out.size);
  for (int r = 0; r < out.size; ++r) {
    const auto text = store.try_get(fmt::format("{}/status/{}", out.world, r));
    RankStatus s = text ? parse_rank(r, *text, unix_ms()) : RankStatus{};
    s.rank = r;
    out.ranks.push_back(std::move(s));
  }
  return out;
}

std::string format_job_status(const JobStatus& status, const JobInfo* job) {
  std::string out;
  if (job != nullptr) {
    const double up = job->started > 0 ? unix_ms() / 1000.0 - job->started : -1;
    out += fmt::format("job of launcher pid {} at {}:{}, up {}: {}\n", job->pid, job->addr, job->port, seconds(up),
                       job->command);
  }
  int stale = 0, stuck = 0;
  for (const RankStatus& r : status.ranks) {
    stale += r.stale ? 1 : 0;
    stuck += r.stuck ? 1 : 0;
  }
  out +=
      fmt::format("world '{}': {} ranks{}{}\n", status.world, status.size,
                  stale > 0 ? fmt::format(", {} STALE", stale) : "", stuck > 0 ? fmt::format(", {} STUCK", stuck) : "");
  out += fmt::format("{:>5}  {:>8}  {:>6}  {:<44} {:>8}  {:>10}  {}\n", "rank", "pid", "step", "doing", "for",
                     "heartbeat", "throughput");
  for (const RankStatus& r : status.ranks) {
    if (!r.published) {
      out += fmt::format("{:>5}  {:>8}  {:>6}  {:<44} {:>8}  {:>10}  {}\n", r.rank, "-", "-",
                         "no status yet (starting, or heartbeats off)", "-", "-", "-");
      continue;
    }
    std::string doing = r.what.empty() ? "-" : r.what;
    double for_s = r.what_s;
    if (!r.op.empty()) {
      doing = r.op;
      for_s = r.op_s;
    } else if (r.wait_s >= 0) {
      doing = "waiting in communication (" + r.what + ")";
      for_s = r.wait_s;
    }
    if (doing.size() > 44) doing = doing.substr(0, 41) + "...";
    std::string rate = r.rate >= 0 ? fmt::format("{:.1f} {}/s", r.rate, r.unit) : "-";
    if (r.stale) {
      rate += fmt::format("  STALE: no heartbeat for {} (stopped, hung or gone)", seconds(r.age_s));
    } else if (r.stuck) {
      rate +=
          fmt::format("  STUCK: no progress for {} (heartbeat timeout {})", seconds(r.what_s), seconds(r.timeout_s));
    }
    out +=
        fmt::format("{:>5}  {:>8}  {:>6}  {:<44} {:>8}  {:>10}  {}\n", r.rank, r.pid,
                    r.step >= 0 ? std::to_string(r.step) : "-", doing, seconds(for_s), seconds(r.age_s) + " ago", rate);
  }
  return out;
}

}  // namespace dtrain::launch
