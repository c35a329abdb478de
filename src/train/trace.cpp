#include "trace.h"

#include <fmt/format.h>

#include "dtrain/core/error.h"
#include "dtrain/core/file.h"

namespace dtrain::train {

namespace {

constexpr uint32_t kTagTrace = 9;  // point-to-point tag on the world group: trace events to rank 0
constexpr const char* kOriginEvent = "dtrain_clock_origin";

}  // namespace

nlohmann::json Trace::events() const {
  nlohmann::json out = nlohmann::json::array();
  for (const Span& s : spans_) {
    nlohmann::json e{{"name", s.index >= 0 ? fmt::format("{} {}", s.name, s.index) : std::string(s.name)},
                     {"ph", "X"},
                     {"pid", rank_},
                     {"tid", s.tid},
                     {"ts", s.ts},
                     {"dur", s.dur},
                     {"args", {{"step", s.step}}}};
    if (s.bytes >= 0) e["args"]["bytes"] = s.bytes;
    out.push_back(std::move(e));
  }
  return out;
}

// Every rank sends its events to rank 0, which writes them all into `path` (one process per
// rank row), atomically and never through a symlink (write_file_atomic).
void write_trace(const Trace& trace, const std::string& path, comm::Group* group, int rank, int world,
                 const std::string& run_id) {
  auto metadata = [](int r, int tid, const std::string& name) {
    return nlohmann::json{{"name", "thread_name"}, {"ph", "M"}, {"pid", r}, {"tid", tid}, {"args", {{"name", name}}}};
  };
  nlohmann::json ev = trace.events();
  ev.push_back(nlohmann::json{
      {"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", fmt::format("rank {}", rank)}}}});
  ev.push_back(metadata(rank, 0, "compute"));
  ev.push_back(metadata(rank, 1, "communication"));
  // This rank's clock origin travels as a metadata event and ends in "otherData" (below).
  ev.push_back(
      nlohmann::json{{"name", kOriginEvent}, {"ph", "M"}, {"pid", rank}, {"args", {{"us", trace.origin_us()}}}});
  if (world > 1 && group != nullptr && rank != 0) {
    const std::string text = ev.dump();
    const uint64_t n = text.size();
    group->send(&n, 1, comm::DataType::i64, 0, kTagTrace);
    group->send(text.data(), text.size(), comm::DataType::u8, 0, kTagTrace);
    return;
  }
  nlohmann::json all = std::move(ev);
  for (int r = 1; group != nullptr && r < world; ++r) {
    uint64_t n = 0;
    group->recv(&n, 1, comm::DataType::i64, r, kTagTrace);
    DT_CHECK(n < (uint64_t{1} << 34), "train", "rank {} sent a trace of {} bytes", r, n);
    std::string text(n, '\0');
    group->recv(text.data(), text.size(), comm::DataType::u8, r, kTagTrace);
    nlohmann::json part = nlohmann::json::parse(text, nullptr, false);
    DT_CHECK(part.is_array(), "train", "rank {} sent an unreadable trace", r);
    for (auto& e : part) all.push_back(std::move(e));
  }
  nlohmann::json events = nlohmann::json::array(), origins = nlohmann::json::array();
  for (auto& e : all) {
    if (e.value("name", "") == kOriginEvent) {
      origins.push_back({{"rank", e.at("pid")}, {"us", e.at("args").at("us")}});
    } else {
      events.push_back(std::move(e));
    }
  }
  const nlohmann::json other{{"run_id", run_id}, {"world", world}, {"clock_origin_us", origins}};
  write_file_atomic(
      path, nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}, {"otherData", other}}.dump() + "\n",
      "train");
}

}  // namespace dtrain::train
