// The launcher's one-line root cause (src/launch/root_cause.h): on flight records written by
// hand for each way the ranks can part (a rank that never came, one that made an extra call,
// one that skipped a call, mismatched calls, a rank that lost its network), and end to end on
// real jobs with eight injected failure kinds.
#include "../src/launch/root_cause.h"

#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <string>
#include <vector>

#include "cli_util.h"

namespace {

using dtrain::launch::FlightRecord;
using dtrain::launch::RankFate;
using dtrain::launch::root_cause;

// One collective in a record: seq, op, state, ms since it started (at the dump), ms since it ended (-1: running).
struct E {
  uint64_t seq;
  std::string op;
  std::string state;
  double started_ago, finished_ago = -1;
  size_t bytes = 8;
};

struct G {
  std::string name;
  int rank, size;
  std::vector<int> members;  // empty: the world
  std::vector<E> entries;
};

FlightRecord record(int rank, double time_ms, const std::vector<G>& groups, const std::string& reason = "") {
  nlohmann::json j{{"rank", std::to_string(rank)}, {"pid", 100 + rank}, {"time_ms", time_ms}, {"reason", reason}};
  j["groups"] = nlohmann::json::array();
  for (const G& g : groups) {
    nlohmann::json gj{{"group", g.name}, {"rank", g.rank}, {"size", g.size}, {"transport", "shm"}};
    if (!g.members.empty()) gj["members"] = g.members;
    gj["entries"] = nlohmann::json::array();
    for (const E& e : g.entries) {
      gj["entries"].push_back(
          {{"seq", e.seq},
           {"op", e.op},
           {"collective", true},
           {"bytes", e.bytes},
           {"peer", -1},
           {"state", e.state},
           {"queued_ms_ago", e.started_ago},
           {"started_ms_ago", e.started_ago},
           {"finished_ms_ago", e.finished_ago < 0 ? nlohmann::json() : nlohmann::json(e.finished_ago)},
           {"error", e.state == "failed" ? "timed out" : ""}});
    }
    j["groups"].push_back(gj);
  }
  return {"/flight/rank-" + std::to_string(rank) + ".json", j.dump()};
}

// Done calls #0..#n-1 of a group.
std::vector<E> done(uint64_t n, const std::string& op = "all_reduce") {
  std::vector<E> out;
  for (uint64_t s = 0; s < n; ++s) out.push_back({s, op, "done", 9000.0 - s, 8999.0 - s});
  return out;
}

std::vector<E> plus(std::vector<E> a, const std::vector<E>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(RootCause, ARankWithoutARecordNeverCalledWhatTheOthersWaitIn) {
  const double t = 1e6;
  std::vector<FlightRecord> records;
  for (int r : {0, 1, 3}) {
    records.push_back(record(r, t, {{"world", r, 4, {}, plus(done(17), {{17, "all_reduce", "failed", 300000, 0}})}}));
  }
  std::map<int, RankFate> fates;
  fates[2].ended = "was killed by signal 9 (Killed)";
  EXPECT_EQ(root_cause(records, fates, -1, false),
            "rank 2 never called all_reduce #17 on group 'world' (it was killed by signal 9 (Killed)); ranks 0, 1 and "
            "3 waited 300 s in it");
}

TEST(RootCause, NamesMembersOfASplitByTheirWorldRanks) {
  // dp groups {0, 2} and {1, 3}: world rank 3 (group rank 1 of the second) left no record.
  const G dp1{"world/split0/color1", 0, 2, {1, 3}, plus(done(4), {{4, "all_reduce_shared", "failed", 2000, 0}})};
  std::vector<FlightRecord> records = {
      record(0, 5e5, {{"world", 0, 4, {}, done(3)}, {"world/split0/color0", 0, 2, {0, 2}, done(5)}}),
      record(1, 5e5, {{"world", 1, 4, {}, done(3)}, dp1}),
      record(2, 5e5, {{"world", 2, 4, {}, done(3)}, {"world/split0/color0", 1, 2, {0, 2}, done(5)}})};
  EXPECT_EQ(root_cause(records, {}, 3, false),
            "rank 3 never called all_reduce_shared #4 on group 'world/split0/color1' (it sent no heartbeats: stopped "
            "or hung); rank 1 waited 2.0 s in it");
}

TEST(RootCause, ARankThatCalledOneExtraIsBlamedNotTheOthers) {
  // Rank 2 called world #5 a second time; ranks 0 and 1 went on to the dp group's #9 and wait
  // for rank 2 there: a wait for each other, and the smaller side broke the order.
  const double t = 1e6;
  std::vector<FlightRecord> records;
  for (int r : {0, 1}) {
    records.push_back(
        record(r, t,
               {{"world", r, 3, {}, done(5)},
                {"world/split0/color0", r, 3, {0, 1, 2}, plus(done(9), {{9, "all_reduce", "failed", 4000, 0}})}}));
  }
  records.push_back(record(2, t,
                           {{"world", 2, 3, {}, plus(done(5), {{5, "all_reduce", "failed", 4100, 0}})},
                            {"world/split0/color0", 2, 3, {0, 1, 2}, done(9)}}));
  EXPECT_EQ(root_cause(records, {}, -1, false),
            "rank 2 called all_reduce #5 on group 'world' that ranks 0 and 1 never called (one call too many); they "
            "waited in all_reduce #9 on group 'world/split0/color0' for 4.0 s");
}

TEST(RootCause, ARankThatSkippedACallIsBlamedWithWhereItWent) {
  const double t = 1e6;
  std::vector<FlightRecord> records;
  for (int r : {0, 1}) {
    records.push_back(record(r, t,
                             {{"world", r, 3, {}, plus(done(5), {{5, "all_reduce", "failed", 4100, 0}})},
                              {"world/split0/color0", r, 3, {0, 1, 2}, done(9)}}));
  }
  records.push_back(
      record(2, t,
             {{"world", 2, 3, {}, done(5)},
              {"world/split0/color0", 2, 3, {0, 1, 2}, plus(done(9), {{9, "all_reduce", "failed", 4000, 0}})}}));
  EXPECT_EQ(root_cause(records, {}, -1, false),
            "rank 2 never called all_reduce #5 on group 'world' (it went on to all_reduce #9 on group "
            "'world/split0/color0'); ranks 0 and 1 waited 4.1 s in it");
}

TEST(RootCause, MismatchedCallsNameTheOddRankAndBothOperations) {
  const double t = 1e6;
  std::vector<FlightRecord> records;
  for (int r : {0, 1, 3}) {
    records.push_back(record(r, t, {{"world", r, 4, {}, plus(done(7), {{7, "all_reduce", "failed", 10, 0}})}}));
  }
  records.push_back(record(2, t, {{"world", 2, 4, {}, plus(done(7), {{7, "broadcast", "failed", 10, 0}})}}));
  EXPECT_EQ(root_cause(records, {}, -1, false),
            "rank 2 called broadcast #7 on group 'world' where ranks 0, 1 and 3 called all_reduce #7 (mismatched "
            "collectives)");
  // Same operation, another size.
  records[3] = record(2, t, {{"world", 2, 4, {}, plus(done(7), {{7, "all_reduce", "failed", 10, 0, 16}})}});
  EXPECT_EQ(root_cause(records, {}, -1, false),
            "rank 2 called all_reduce #7 on group 'world' with 16 bytes where ranks 0, 1 and 3 called it with 8 bytes");
}

TEST(RootCause, EveryRankInTheCallAndOneLostItsNetwork) {
  const double t = 1e6;
  std::vector<FlightRecord> records;
  for (int r : {0, 1}) {
    records.push_back(record(r, t, {{"world", r, 3, {}, plus(done(4), {{4, "all_reduce", "failed", 1500, 0}})}}));
  }
  records.push_back(record(2, t, {{"world", 2, 3, {}, plus(done(4), {{4, "all_reduce", "failed", 1500, 0}})}},
                           "heartbeat: rank 2 cannot reach the rendezvous store: connection reset"));
  EXPECT_EQ(root_cause(records, {}, -1, false),
            "rank 2 lost its network (it cannot reach the rendezvous store) while every rank was in all_reduce #4 on "
            "group 'world'");
}

// Seen on a loaded machine: the rank that lost its sockets still entered the next intra-host call
// (which needs none) before the others, so they look as if they never called it. The network is the cause.
TEST(RootCause, TheRankThatLostItsNetworkIsTheCauseEvenOneCallAhead) {
  const double t = 1e6;
  std::vector<FlightRecord> records;
  for (int r : {0, 1}) {
    records.push_back(record(r, t, {{"world/split0/color0", r, 3, {0, 1, 2}, done(22)}}));
  }
  records.push_back(record(
      2, t, {{"world/split0/color0", 2, 3, {0, 1, 2}, plus(done(22), {{22, "all_reduce_shared", "failed", 0, 0}})}},
      "heartbeat: rank 2 cannot reach the rendezvous store: connection reset"));
  EXPECT_EQ(root_cause(records, {}, -1, false),
            "rank 2 lost its network (it cannot reach the rendezvous store) while in all_reduce_shared #22 on group "
            "'world/split0/color0', which ranks 0 and 1 had not reached yet");
  // Without the heartbeat's finding it is what the records say: the others never called it.
  records[2] = record(
      2, t, {{"world/split0/color0", 2, 3, {0, 1, 2}, plus(done(22), {{22, "all_reduce_shared", "failed", 0, 0}})}});
  EXPECT_TRUE(root_cause(records, {}, -1, false).starts_with("ranks 0 and 1 never called all_reduce_shared #22"));
}

// Seen in CI: the rank that lost its network failed between calls, and the job was stopped just
// as rank 0 entered the next one, so ranks 1 and 2 both look as if they never called it.
TEST(RootCause, TheRankThatLostItsNetworkIsTheCauseAmongSeveralThatNeverArrived) {
  const double t = 1e6;
  const std::vector<int> members = {0, 1, 2};
  std::vector<FlightRecord> records;
  records.push_back(record(
      0, t, {{"world/split0/color0", 0, 3, members, plus(done(99), {{99, "all_reduce_shared", "failed", 0, 0}})}}));
  records.push_back(record(1, t, {{"world/split0/color0", 1, 3, members, done(99)}}));
  records.push_back(record(2, t, {{"world/split0/color0", 2, 3, members, done(99)}},
                           "heartbeat: rank 2 cannot reach the rendezvous store: connection reset"));
  EXPECT_EQ(root_cause(records, {}, -1, false),
            "rank 2 lost its network (it cannot reach the rendezvous store) before it reached all_reduce_shared #99 "
            "on group 'world/split0/color0', which rank 0 had entered and rank 1 had not reached yet");
  // Without the heartbeat's finding it is what the records say.
  records[2] = record(2, t, {{"world/split0/color0", 2, 3, members, done(99)}});
  EXPECT_TRUE(root_cause(records, {}, -1, false).starts_with("ranks 1 and 2 never called all_reduce_shared #99"));
}

TEST(RootCause, UnreadableRecordsSayNothingRatherThanCrash) {
  const std::vector<FlightRecord> records = {{"/f/rank-0.json", "{\"rank\":\"0\",\"groups\":[{\"group\":"},
                                             {"/f/rank-1.json", "[]"},
                                             {"/f/rank-pid7.json", "{\"rank\":\"pid7\",\"groups\":[]}"}};
  EXPECT_EQ(root_cause(records, {}, -1, false), "");
  EXPECT_EQ(root_cause({}, {}, -1, false), "");
}

// End to end: eight ways for rank 2 of 3 to fail a real data-parallel job. The launcher's first
// report line names rank 2 and the operation the others were left in (or that it got wrong).
class RootCauseJobs : public CliTest {};

TEST_F(RootCauseJobs, EightInjectedFailuresNameTheRightRankAndOperation) {
  const std::string job =
      "train --model mlp --hidden 128 --dp 3 --batch-size 48 --steps 3000 --log-every 2 --progress=false --timeout 4 "
      "--heartbeat-timeout 2 --checkpoint-every 4";
  struct Case {
    const char* name;
    std::string fault;
    std::string op;  // named in the cause
  };
  const std::vector<Case> cases = {
      {"kill", "kill:rank=2:step=5", "all_reduce"},
      {"stop", "stop:rank=2:step=5", "all_reduce"},
      // Every rank was in some call when rank 2 lost the store (which one depends on the timing).
      {"dropped network", "drop:rank=2:step=5", ""},
      {"a different collective", "mismatch:rank=2:step=4", "broadcast"},
      {"a skipped collective", "skip:rank=2:step=4", "all_reduce"},
      {"one extra collective", "extra:rank=2:step=4", "all_reduce"},
      {"slow beyond the timeout", "delay:rank=2:step=5:ms=9000", "all_reduce"},
      {"a crash during a checkpoint", "kill:rank=2:step=8:phase=checkpoint", "all_gather"}};
  for (size_t i = 0; i < cases.size(); ++i) {
    ::setenv("DTRAIN_FAULT", cases[i].fault.c_str(), 1);
    const auto t0 = std::chrono::steady_clock::now();
    ProcessResult r = dtrain(job + " --checkpoint-dir " + path("ckpt" + std::to_string(i)), 120);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ::unsetenv("DTRAIN_FAULT");
    EXPECT_NE(r.code, 0) << cases[i].name << ": " << r.output;
    const size_t at = r.output.find("root cause: ");
    ASSERT_NE(at, std::string::npos) << cases[i].name << ": " << r.output;
    const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
    std::printf("%-28s %5.1f s  %s\n", cases[i].name, s, line.c_str());
    EXPECT_TRUE(line.starts_with("root cause: rank 2 ")) << cases[i].name << ": " << line;
    EXPECT_TRUE(std::regex_search(line, std::regex(" " + cases[i].op + "\\w* #\\d+ on group '")))
        << cases[i].name << ": " << line;
    // The cause comes before the details (who exited how, the flight records).
    const size_t details = r.output.find("flight records (");
    if (details != std::string::npos) {
      EXPECT_LT(at, details) << cases[i].name;
    }
  }
}

}  // namespace
