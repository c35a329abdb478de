// The elastic agent (dtrain launch --nnodes MIN:MAX): node agents meet in numbered rounds at
// the rendezvous store and run one world of workers per round.
//
// Store keys, for round R:
//   elastic/R/joined    how many agents asked to join (an agent's join number is its slot)
//   elastic/R/slot/J    the --node-rank of the agent with join number J
//   elastic/R/closed    the number of members, written once (compare-and-set) by whichever
//                       agent closes the round; slots past it are late and join round R+1
//   elastic/R/failed    why the round failed (the first node to see a failure writes it)
//   elastic/R/done      how many members' workers finished (node 0, which serves the store,
//                       waits for all of them before it exits)
//   elastic/R/alive     bumped by the members while their workers run; elastic/R/ended once they
//                       stopped. Round R+1 does not start its last call while R still runs, so a
//                       joiner waits for the members of R instead of forming a round alone.
// A running round is stopped for a joiner only when it has fewer than MAX nodes (a spare node
// waits for a failure). elastic/finished (the round whose workers finished) sends the agents
// still waiting home.
// A running round ends early when elastic/(R+1)/joined becomes non-zero: a node is waiting.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/store.h"
#include "dtrain/core/error.h"
#include "dtrain/launch/launcher.h"
#include "finish.h"
#include "job_file.h"

namespace dtrain::launch {

namespace {

using Clock = std::chrono::steady_clock;

std::string key(int64_t round, const std::string& what) { return fmt::format("elastic/{}/{}", round, what); }

void say(const std::string& text) {
  const std::string line = "dtrain launch: " + text + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
}

struct Membership {
  int64_t round = 0;
  std::vector<int> nodes;  // --node-rank of each member, ascending: the node index is the position
  int index = -1;          // this node's position
};

int64_t parse_count(const std::string& text, const std::string& what) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  DT_CHECK(end != text.c_str() && *end == '\0' && v >= 0, "launch", "store key {} holds '{}', not a count", what, text);
  return v;
}

// Joins the first round that is still open at or after `round` and waits until it closes.
// No nodes in the result: the job finished meanwhile.
Membership join(comm::Store& store, int64_t round, const LaunchOptions& o) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(o.join_timeout_seconds);
  const auto last_call = std::chrono::duration<double>(o.last_call_seconds);
  const auto tick = std::chrono::milliseconds(50);
  for (;; ++round) {
    if (store.try_get(key(round, "closed"))) continue;
    const int64_t slot = store.add(key(round, "joined"), 1);
    store.set(key(round, fmt::format("slot/{}", slot)), std::to_string(o.node_rank));
    auto enough_since = Clock::time_point::max();
    std::string previous_alive;
    auto previous_change = Clock::now();
    // Whether round - 1 still has workers running (its members bump "alive" every 200 ms).
    auto previous_running = [&](Clock::time_point now) {
      if (round == 0 || !store.try_get(key(round - 1, "closed")) || store.try_get(key(round - 1, "ended")))
        return false;
      const std::string alive = store.try_get(key(round - 1, "alive")).value_or("");
      if (alive != previous_alive) {
        previous_alive = alive;
        previous_change = now;
      }
      return now - previous_change < std::chrono::seconds(3);
    };
    while (true) {
      if (store.try_get("elastic/finished")) return Membership{round, {}, -1};
      if (auto closed = store.try_get(key(round, "closed"))) {
        const int64_t n = parse_count(*closed, key(round, "closed"));
        if (slot > n) break;  // late: the next round
        Membership m;
        m.round = round;
        for (int64_t j = 1; j <= n; ++j) {
          const std::string who = store.get(key(round, fmt::format("slot/{}", j)), std::chrono::seconds(30));
          m.nodes.push_back(static_cast<int>(parse_count(who, key(round, fmt::format("slot/{}", j)))));
        }
        std::sort(m.nodes.begin(), m.nodes.end());
        DT_CHECK(std::adjacent_find(m.nodes.begin(), m.nodes.end()) == m.nodes.end(), "launch",
                 "round {}: two agents joined with the same --node-rank (give every node its own)", round);
        m.index = static_cast<int>(std::find(m.nodes.begin(), m.nodes.end(), o.node_rank) - m.nodes.begin());
        return m;
      }
      const int64_t joined = store.add(key(round, "joined"), 0);
      const auto now = Clock::now();
      if (joined >= o.max_nodes) {
        store.compare_set(key(round, "closed"), "", std::to_string(o.max_nodes));
      } else if (joined >= o.min_nodes) {
        if (previous_running(now)) {
          enough_since = Clock::time_point::max();
        } else if (enough_since == Clock::time_point::max()) {
          enough_since = now;
        }
        if (enough_since != Clock::time_point::max() && now - enough_since >= last_call)
          store.compare_set(key(round, "closed"), "", std::to_string(joined));
      } else if (now > deadline) {
        DT_THROW("launch", "round {}: only {} of at least {} nodes joined within {} s (--nnodes {}:{})", round, joined,
                 o.min_nodes, o.join_timeout_seconds, o.min_nodes, o.max_nodes);
      }
      std::this_thread::sleep_for(tick);  // polling the store: nothing to wake us sooner
    }
  }
}

}  // namespace

int run_elastic(const LaunchOptions& o) {
  DT_CHECK(o.min_nodes >= 1 && o.max_nodes >= o.min_nodes, "launch", "--nnodes {}:{}: expected 1 <= MIN <= MAX",
           o.min_nodes, o.max_nodes);
  DT_CHECK(o.master_port > 0 && o.master_port < 65536, "launch",
           "an elastic job needs --master-port (the store every node's agent meets at)");
  DT_CHECK(o.node_rank >= 0, "launch", "--node-rank {} must be non-negative", o.node_rank);
  const char* env = std::getenv("DTRAIN_SECRET");
  DT_CHECK(env != nullptr && *env != '\0', "launch",
           "an elastic job needs the same DTRAIN_SECRET on every node (export it before dtrain launch)");
  const std::string secret = env;
  comm::check_secret(secret, "dtrain launch --nnodes MIN:MAX: DTRAIN_SECRET");
  // Node 0's agent serves the store for the job's whole life, across rounds.
  std::unique_ptr<comm::TcpStoreServer> server;
  std::optional<JobFile> job_file;  // for dtrain status, while this agent serves the store
  if (o.node_rank == 0) {
    server = std::make_unique<comm::TcpStoreServer>(o.master_addr, static_cast<uint16_t>(o.master_port), secret);
    job_file.emplace(
        JobInfo{::getpid(), o.master_addr, server->port(), secret, fmt::format("{}", fmt::join(o.command, " ")),
                std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(), ""});
  }
  // Wait for the store (node 0's agent may start later), then talk to it with a short I/O
  // timeout: the agent polls it from the launcher's loop, which must keep serving signals.
  comm::connect_tcp_store(o.master_addr, static_cast<uint16_t>(o.master_port), secret,
                          std::chrono::milliseconds(static_cast<int64_t>(o.join_timeout_seconds * 1000)));
  auto store =
      comm::connect_tcp_store(o.master_addr, static_cast<uint16_t>(o.master_port), secret, std::chrono::seconds(10));
  int failures = 0;
  for (int64_t round = 0;;) {
    const Membership m = join(*store, round, o);
    round = m.round;
    if (m.nodes.empty()) {
      say(fmt::format("the job finished while this node waited to join (round {})", round));
      return 0;
    }
    say(fmt::format("round {}: {} node{} (node ranks {}), this is node {} of the round: ranks {}-{} of {}", round,
                    m.nodes.size(), m.nodes.size() > 1 ? "s" : "", fmt::join(m.nodes, ","), m.index,
                    m.index * o.nproc_per_node, (m.index + 1) * o.nproc_per_node - 1,
                    static_cast<int>(m.nodes.size()) * o.nproc_per_node));
    LaunchOptions lo = o;
    lo.nnodes = static_cast<int>(m.nodes.size());
    lo.node_rank = m.index;
    lo.serve_store = false;
    lo.secret = secret;
    lo.run_id = std::to_string(round);
    ::setenv("DTRAIN_RESTART", std::to_string(round).c_str(), 1);
    bool other_failed = false;
    auto last_poll = Clock::time_point{};
    lo.interrupt = [&]() -> std::string {
      const auto now = Clock::now();
      if (now - last_poll < std::chrono::milliseconds(200)) return "";
      last_poll = now;
      try {
        store->add(key(round, "alive"), 1);
        if (auto f = store->try_get(key(round, "failed"))) {
          other_failed = true;
          return fmt::format("round {} failed elsewhere: {}", round, *f);
        }
        const int64_t waiting =
            static_cast<int>(m.nodes.size()) < o.max_nodes ? store->add(key(round + 1, "joined"), 0) : 0;
        if (waiting > 0) {
          return fmt::format("round {}: {} node{} asked to join; stopping the workers to form a larger world", round,
                             waiting, waiting > 1 ? "s" : "");
        }
      } catch (const std::exception& e) {
        other_failed = true;
        return fmt::format("round {}: lost the rendezvous store (node 0's agent): {}", round, e.what());
      }
      return "";
    };
    const LaunchResult r = run_launch(lo);
    try {
      store->set(key(round, "ended"), "1");
    } catch (const std::exception&) {
    }
    if (r.exit_code == 0) {
      // Node 0 serves the store: it stays until every member's workers finished too.
      store->set("elastic/finished", std::to_string(round));
      finish_together(*store, key(round, "done"), static_cast<int64_t>(m.nodes.size()), server != nullptr,
                      key(round, "failed"));
      say(fmt::format("round {}: the workers finished", round));
      return 0;
    }
    if (r.received_signal != 0) {
      store->compare_set(key(round, "failed"), "",
                         fmt::format("node {} left (its agent got signal {})", o.node_rank, r.received_signal));
      say(fmt::format("round {}: stopped by signal {}; leaving the job", round, r.received_signal));
      return r.exit_code;
    }
    if (!r.interrupted) {
      store->compare_set(key(round, "failed"), "", fmt::format("on node {}: {}", o.node_rank, r.report));
    }
    const bool failed = !r.interrupted || other_failed;
    say(fmt::format("round {} ended: {}", round, r.report));
    // The next round's workers record why this one ended (dtrain report's timeline).
    const std::string why = r.cause.empty() ? r.report.substr(0, r.report.find('\n')) : r.cause;
    ::setenv("DTRAIN_RESTART_REASON", why.c_str(), 1);
    ::setenv("DTRAIN_RESTART_FAILED_AT",
             std::to_string(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count())
                 .c_str(),
             1);
    ::setenv("DTRAIN_RESTART_FLIGHT_DIR", r.flight_dir.c_str(), 1);
    if (failed && ++failures > o.max_restarts) {
      say(fmt::format("giving up after {} failed round{} (--max-restarts {})", failures, failures > 1 ? "s" : "",
                      o.max_restarts));
      return r.exit_code != 0 ? r.exit_code : 1;
    }
    ++round;
  }
}

}  // namespace dtrain::launch
