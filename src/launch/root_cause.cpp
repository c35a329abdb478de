// The one-line root cause (see root_cause.h for the vocabulary: divergence, arrived, missing).
#include "root_cause.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>

namespace dtrain::launch {

namespace {

// One collective call as a rank recorded it; times in Unix ms (the record's time_ms minus "ago").
struct Call {
  std::string op, state, error;
  uint64_t bytes = 0;
  double start_ms = 0.0, waited_ms = 0.0;
};

struct GroupView {
  std::string name;
  std::vector<int> members;                       // world rank by group rank (-1: unknown)
  std::map<int, std::map<uint64_t, Call>> calls;  // world rank -> seq -> call
};

struct RecordView {
  double time_ms = 0.0;
  std::string reason;  // why its process aborted every group (a heartbeat's finding)
};

struct Divergence {
  const GroupView* group = nullptr;
  uint64_t seq = 0;
  std::map<std::string, std::vector<int>> ops;  // what the arrived ranks called at seq, by op (and size)
  std::vector<int> arrived, missing;            // world ranks; -1: a member whose world rank is unknown
  double start_ms = std::numeric_limits<double>::max(), waited_ms = 0.0;
};

double number_or(const nlohmann::json& j, const char* key, double fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : fallback;
}

// "rank 2", "ranks 0 and 1", "ranks 0, 1 and 3" (-1: a rank whose world rank is unknown).
std::string ranks_text(const std::vector<int>& ranks) {
  std::vector<std::string> names;
  names.reserve(ranks.size());
  for (int r : ranks) names.push_back(r >= 0 ? std::to_string(r) : std::string("?"));
  if (names.size() == 1) return "rank " + names[0];
  std::string out = "ranks ";
  for (size_t i = 0; i < names.size(); ++i) {
    out += names[i];
    if (i + 2 < names.size()) out += ", ";
    if (i + 2 == names.size()) out += " and ";
  }
  return out;
}

std::string seconds_text(double ms) {
  const double s = std::max(0.0, ms) / 1000.0;
  return s >= 10 ? fmt::format("{:.0f} s", s) : (s >= 0.1 ? fmt::format("{:.1f} s", s) : fmt::format("{:.2f} s", s));
}

std::string op_key(const Call& c) { return fmt::format("{}|{}", c.op, c.bytes); }

// The records as groups of calls; records that cannot be read are left out (flight_summary names them).
std::vector<GroupView> read_groups(const std::vector<FlightRecord>& records, std::map<int, RecordView>* views) {
  std::map<std::string, GroupView> groups;
  for (const FlightRecord& record : records) {
    const nlohmann::json j = nlohmann::json::parse(record.text, nullptr, false);
    if (!j.is_object() || !j.contains("rank") || !j.contains("groups") || !j["groups"].is_array()) continue;
    const std::string who = j["rank"].is_string() ? j["rank"].get<std::string>() : j["rank"].dump();
    char* end = nullptr;
    const long world_rank = std::strtol(who.c_str(), &end, 10);
    if (end == who.c_str() || *end != '\0' || world_rank < 0) continue;  // "pidN": not started by a launcher
    const int me = static_cast<int>(world_rank);
    RecordView& view = (*views)[me];
    view.time_ms = number_or(j, "time_ms", 0.0);
    if (j.contains("reason") && j["reason"].is_string()) view.reason = j["reason"].get<std::string>();
    for (const auto& g : j["groups"]) {
      if (!g.is_object() || !g.contains("group") || !g.contains("entries")) continue;
      GroupView& gv = groups[g["group"].get<std::string>()];
      gv.name = g["group"].get<std::string>();
      const int size = static_cast<int>(number_or(g, "size", 0));
      const int group_rank = static_cast<int>(number_or(g, "rank", -1));
      if (static_cast<int>(gv.members.size()) < size) gv.members.resize(static_cast<size_t>(size), -1);
      if (g.contains("members") && g["members"].is_array()) {
        for (size_t i = 0; i < g["members"].size() && i < gv.members.size(); ++i) {
          gv.members[i] = g["members"][i].get<int>();
        }
      } else if (gv.name == "world" || gv.name.starts_with("world@")) {
        for (int i = 0; i < size; ++i) gv.members[static_cast<size_t>(i)] = i;  // the world: group rank = world rank
      }
      if (group_rank >= 0 && group_rank < size) gv.members[static_cast<size_t>(group_rank)] = me;
      auto& mine = gv.calls[me];
      for (const auto& e : g["entries"]) {
        if (!e.value("collective", true)) continue;  // point to point: numbered per pair, not per group
        Call c;
        c.op = e.value("op", "?");
        c.state = e.value("state", "?");
        c.error = e.value("error", "");
        c.bytes = static_cast<uint64_t>(number_or(e, "bytes", 0));
        const double started = number_or(e, "started_ms_ago", number_or(e, "queued_ms_ago", 0.0));
        const double finished = number_or(e, "finished_ms_ago", 0.0);
        c.start_ms = view.time_ms - started;
        c.waited_ms = started - finished;
        mine[static_cast<uint64_t>(number_or(e, "seq", 0))] = c;
      }
    }
  }
  std::vector<GroupView> out;
  out.reserve(groups.size());
  for (auto& [name, g] : groups) out.push_back(std::move(g));
  return out;
}

// The group's lowest sequence number with a call that did not complete, if any.
std::optional<Divergence> divergence_of(const GroupView& g) {
  std::optional<uint64_t> k;
  for (const auto& [rank, calls] : g.calls) {
    for (const auto& [seq, c] : calls) {
      if (c.state != "done" && (!k || seq < *k)) k = seq;
    }
  }
  if (!k) return std::nullopt;
  Divergence d;
  d.group = &g;
  d.seq = *k;
  for (int member : g.members) {
    auto calls = member >= 0 ? g.calls.find(member) : g.calls.end();
    auto call = calls != g.calls.end() ? calls->second.find(*k) : std::map<uint64_t, Call>::const_iterator{};
    if (calls == g.calls.end() || call == calls->second.end()) {
      d.missing.push_back(member);
      continue;
    }
    d.arrived.push_back(member);
    d.ops[op_key(call->second)].push_back(member);
    d.start_ms = std::min(d.start_ms, call->second.start_ms);
    d.waited_ms = std::max(d.waited_ms, call->second.waited_ms);
  }
  return d;
}

std::string op_name(const std::string& key) { return key.substr(0, key.find('|')); }
uint64_t op_bytes(const std::string& key) { return std::strtoull(key.c_str() + key.find('|') + 1, nullptr, 10); }

// The arrived ranks' call at the divergence, by most ranks (the order the others kept).
std::string majority_op(const Divergence& d) {
  std::string best;
  size_t n = 0;
  for (const auto& [key, ranks] : d.ops) {
    if (ranks.size() > n) {
      best = key;
      n = ranks.size();
    }
  }
  return best;
}

// Where `rank` waits when it is not at `d` (another divergence it arrived at), or nothing.
const Divergence* waiting_elsewhere(int rank, const Divergence& d, const std::vector<Divergence>& all) {
  for (const Divergence& other : all) {
    if (&other == &d) continue;
    if (std::find(other.arrived.begin(), other.arrived.end(), rank) != other.arrived.end() && !other.missing.empty()) {
      return &other;
    }
  }
  return nullptr;
}

std::string where(const Divergence& d, const std::string& op) {
  return fmt::format("{} #{} on group '{}'", op, d.seq, d.group->name);
}

// The rank whose heartbeat found it cannot reach the store, or -1.
int lost_network_rank(const std::map<int, RecordView>& views) {
  static const std::regex lost("rank (\\d+) cannot reach the rendezvous store");
  for (const auto& [rank, view] : views) {
    std::smatch m;
    if (std::regex_search(view.reason, m, lost)) return std::stoi(m[1].str());
  }
  return -1;
}

// What else is known of a rank that did not arrive: how it ended, what the heartbeats found,
// where it went instead, what it last did.
std::string missing_context(int rank, const Divergence& d, const std::vector<Divergence>& all,
                            const std::map<int, RankFate>& fates, const std::map<int, RecordView>& views, int silent,
                            bool stalled) {
  std::vector<std::string> parts;
  if (rank == silent) parts.push_back(stalled ? "it made no progress: hung" : "it sent no heartbeats: stopped or hung");
  if (lost_network_rank(views) == rank) parts.push_back("it lost its network: it cannot reach the rendezvous store");
  if (const Divergence* other = waiting_elsewhere(rank, d, all)) {
    parts.push_back(fmt::format("it went on to {}", where(*other, op_name(majority_op(*other)))));
  }
  if (auto f = fates.find(rank); f != fates.end()) {
    if (!f->second.ended.empty() && !f->second.stopped_by_launcher) parts.push_back("it " + f->second.ended);
    if (!f->second.last_status.empty()) parts.push_back("last seen in " + f->second.last_status);
  }
  if (parts.empty()) return "";
  std::string out = " (";
  for (size_t i = 0; i < parts.size(); ++i) out += (i > 0 ? "; " : "") + parts[i];
  return out + ")";
}

// Every arrived rank called the same operation: some never came.
std::string never_called(const Divergence& d, const std::vector<Divergence>& all, const std::map<int, RankFate>& fates,
                         const std::map<int, RecordView>& views, int silent, bool stalled) {
  const std::string op = op_name(majority_op(d));
  // A wait for each other: the missing ranks are blocked in a call the arrived ones never made.
  const bool cycle = std::all_of(d.missing.begin(), d.missing.end(), [&](int r) {
    const Divergence* other = r >= 0 ? waiting_elsewhere(r, d, all) : nullptr;
    return other != nullptr;
  });
  if (cycle && d.arrived.size() < d.missing.size()) {
    const Divergence* other = waiting_elsewhere(d.missing.front(), d, all);
    return fmt::format("{} called {} that {} never called (one call too many); they waited in {} for {}",
                       ranks_text(d.arrived), where(d, op), ranks_text(d.missing),
                       where(*other, op_name(majority_op(*other))), seconds_text(other->waited_ms));
  }
  const std::string context =
      d.missing.size() == 1 ? missing_context(d.missing.front(), d, all, fates, views, silent, stalled) : "";
  return fmt::format("{} never called {}{}; {} waited {} in it", ranks_text(d.missing), where(d, op), context,
                     ranks_text(d.arrived), seconds_text(d.waited_ms));
}

// The arrived ranks called different operations (or sizes) at one sequence number.
std::string mismatched(const Divergence& d) {
  const std::string common = majority_op(d);
  std::vector<int> odd;
  std::string odd_key;
  for (const auto& [key, ranks] : d.ops) {
    if (key == common) continue;
    odd.insert(odd.end(), ranks.begin(), ranks.end());
    odd_key = key;
  }
  std::sort(odd.begin(), odd.end());
  const std::vector<int>& usual = d.ops.at(common);
  if (op_name(odd_key) != op_name(common)) {
    return fmt::format("{} called {} where {} called {} #{} (mismatched collectives)", ranks_text(odd),
                       where(d, op_name(odd_key)), ranks_text(usual), op_name(common), d.seq);
  }
  return fmt::format("{} called {} with {} bytes where {} called it with {} bytes", ranks_text(odd),
                     where(d, op_name(common)), op_bytes(odd_key), ranks_text(usual), op_bytes(common));
}

// Every rank arrived and the call failed everywhere: the rank whose heartbeat or error started it.
std::string failed_together(const Divergence& d, const std::map<int, RecordView>& views, int silent, bool stalled) {
  const std::string op = op_name(majority_op(d));
  if (const int lost = lost_network_rank(views); lost >= 0) {
    return fmt::format("rank {} lost its network (it cannot reach the rendezvous store) while every rank was in {}",
                       lost, where(d, op));
  }
  if (silent >= 0) {
    return fmt::format("rank {} {} while every rank was in {}", silent,
                       stalled ? "made no progress (hung)" : "sent no heartbeats (stopped or hung)", where(d, op));
  }
  // The first error recorded at the divergence.
  const Call* first = nullptr;
  int first_rank = -1;
  for (int r : d.arrived) {
    auto calls = d.group->calls.find(r);
    if (calls == d.group->calls.end()) continue;
    auto c = calls->second.find(d.seq);
    if (c == calls->second.end() || c->second.error.empty()) continue;
    const double at = c->second.start_ms + c->second.waited_ms;
    if (first == nullptr || at < first->start_ms + first->waited_ms) {
      first = &c->second;
      first_rank = r;
    }
  }
  if (first == nullptr) return "";
  std::string error = first->error.substr(0, 200);
  return fmt::format("{} failed on rank {} first, after {}: {}", where(d, op), first_rank,
                     seconds_text(first->waited_ms), error);
}

}  // namespace

std::string root_cause(const std::vector<FlightRecord>& records, const std::map<int, RankFate>& fates, int silent,
                       bool stalled) {
  std::map<int, RecordView> views;
  const std::vector<GroupView> groups = read_groups(records, &views);
  std::vector<Divergence> all;
  for (const GroupView& g : groups) {
    if (auto d = divergence_of(g)) all.push_back(std::move(*d));
  }
  // The root: the earliest divergence that some rank missed or that mixes calls.
  const Divergence* root = nullptr;
  for (const Divergence& d : all) {
    if (d.missing.empty() && d.ops.size() < 2) continue;
    if (root == nullptr || d.start_ms < root->start_ms) root = &d;
  }
  if (root != nullptr && root->ops.size() < 2) {
    // A rank that lost its network fails where it stands, possibly one call ahead of the others
    // (an intra-host call needs no socket): the others did not skip that call, the network went.
    // Or it fails between calls and the job is stopped just as some rank enters the next one: the
    // lost rank is then one of several that "never called" it, and still the cause.
    const int lost = lost_network_rank(views);
    const bool lost_missing = std::find(root->missing.begin(), root->missing.end(), lost) != root->missing.end();
    if (lost >= 0 && !lost_missing) {
      return fmt::format(
          "rank {} lost its network (it cannot reach the rendezvous store) while in {}, which {} had "
          "not reached yet",
          lost, where(*root, op_name(majority_op(*root))), ranks_text(root->missing));
    }
    if (lost >= 0 && root->missing.size() > 1) {
      std::vector<int> others;
      std::copy_if(root->missing.begin(), root->missing.end(), std::back_inserter(others),
                   [&](int r) { return r != lost; });
      return fmt::format(
          "rank {} lost its network (it cannot reach the rendezvous store) before it reached {}, which {} had "
          "entered and {} had not reached yet",
          lost, where(*root, op_name(majority_op(*root))), ranks_text(root->arrived), ranks_text(others));
    }
  }
  if (root != nullptr) {
    return root->ops.size() > 1 ? mismatched(*root) : never_called(*root, all, fates, views, silent, stalled);
  }
  // Every rank arrived everywhere: the earliest failed call.
  for (const Divergence& d : all) {
    if (root == nullptr || d.start_ms < root->start_ms) root = &d;
  }
  return root != nullptr ? failed_together(*root, views, silent, stalled) : std::string();
}

}  // namespace dtrain::launch
