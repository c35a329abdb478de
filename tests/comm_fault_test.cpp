// Failures through the whole Group path with real processes: kill -9 of one rank while the
// others are inside an all_reduce makes every survivor raise CommError naming the dead rank,
// well within the timeout, and leaves nothing in /dev/shm. Also: a rank that calls a different
// collective is reported with both calls instead of corrupting data.
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "comm_test_util.h"
#include "dtrain/comm/group.h"
#include "dtrain/comm/shared.h"

namespace dtrain::comm {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

std::vector<std::string> shm_entries(const std::string& needle) {
  std::vector<std::string> found;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(dir)) {
      if (std::strstr(e->d_name, needle.c_str()) != nullptr) found.emplace_back(e->d_name);
    }
    ::closedir(dir);
  }
  return found;
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Job {
  fs::path dir;
  std::string name;
  Job() {
    name = fmt::format("fault{}x{}", ::getpid(), counter()++);
    dir = fs::temp_directory_path() / ("dtrain-" + name);
    fs::remove_all(dir);
    fs::create_directories(dir / "store");
  }
  ~Job() { fs::remove_all(dir); }
  static int& counter() {
    static int c = 0;
    return c;
  }
};

// Child body: join the group through a file store, run `body`, write the outcome to
// dir/result<rank> ("ok" or the error text) and exit.
template <typename Body>
pid_t spawn_rank(const Job& job, int rank, int size, GroupOptions opts, Body body) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  std::string outcome;
  try {
    Group g = Group::create(make_file_store((job.dir / "store").string()), rank, size, opts, job.name);
    body(g);
    outcome = "ok";
  } catch (const std::exception& e) {
    outcome = e.what();
  }
  std::ofstream(job.dir / fmt::format("result{}", rank)) << outcome;
  ::_exit(0);
}

template <typename Body>
pid_t spawn_rank(const Job& job, int rank, int size, Duration timeout, Body body) {
  GroupOptions opts;
  opts.timeout = timeout;
  return spawn_rank(job, rank, size, opts, body);
}

int wait_exit(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

// (ranks, floats per all_reduce, in shared memory): 4 MiB takes several staging chunks per
// call; 8 floats go in one flagged line; shared: all_reduce_shared on allocate_shared memory.
class KillDuringAllReduce : public ::testing::TestWithParam<std::tuple<int, size_t, bool>> {};

TEST_P(KillDuringAllReduce, SurvivorsRaiseNamingTheDeadRankWithinTheTimeout) {
  const int size = std::get<0>(GetParam());
  const size_t count = std::get<1>(GetParam());
  const bool shared = std::get<2>(GetParam());
  const int victim = size / 2;
  const Duration timeout = 20s;  // detection must come from the liveness check, far sooner
  Job job;
  int ready[2];
  ASSERT_EQ(0, ::pipe(ready));
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    pids.push_back(spawn_rank(job, r, size, timeout, [&](Group& g) {
      std::vector<float> x(count, 1.0f);
      SharedMemory m;
      if (shared) m = allocate_shared(g, count * 4 * static_cast<size_t>(size));
      auto all_reduce = [&] {
        if (shared) {
          all_reduce_shared(g, m, 0, count * 4, count, DataType::f32, ReduceOp::sum);
        } else {
          g.all_reduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum);
        }
      };
      if (g.rank() == victim) {
        all_reduce();
        const char one = 1;
        (void)!::write(ready[1], &one, 1);
        ::pause();  // killed here, while the others are inside the next all_reduce
      }
      for (int k = 0; k < 1000000; ++k) all_reduce();
    }));
  }
  // Kill the victim once it finished its first all_reduce (the others then block on it).
  ::close(ready[1]);
  pollfd pfd{ready[0], POLLIN, 0};
  const bool victim_ready = ::poll(&pfd, 1, 60000) == 1 && (pfd.revents & POLLIN) != 0;
  ::close(ready[0]);
  if (!victim_ready) {
    for (pid_t p : pids) ::kill(p, SIGKILL);
    for (pid_t p : pids) wait_exit(p);
    FAIL() << "the ranks never completed their first all_reduce";
  }
  const auto killed_at = std::chrono::steady_clock::now();
  ::kill(pids[static_cast<size_t>(victim)], SIGKILL);
  for (int r = 0; r < size; ++r) wait_exit(pids[static_cast<size_t>(r)]);
  const auto detected = std::chrono::steady_clock::now() - killed_at;
  EXPECT_LT(detected, timeout / 2) << "survivors took too long to notice the dead rank";
  for (int r = 0; r < size; ++r) {
    if (r == victim) continue;
    const std::string res = read_file(job.dir / fmt::format("result{}", r));
    EXPECT_NE(res, "ok") << "rank " << r;
    EXPECT_NE(res.find("all_reduce"), std::string::npos) << "rank " << r << ": " << res;
    EXPECT_NE(res.find(fmt::format("rank {} (pid {}) died", victim, pids[static_cast<size_t>(victim)])),
              std::string::npos)
        << "rank " << r << " does not name the dead rank: " << res;
  }
  EXPECT_TRUE(shm_entries(job.name).empty()) << "segments left in /dev/shm";
}

INSTANTIATE_TEST_SUITE_P(Ranks, KillDuringAllReduce,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Values(size_t{1} << 20, size_t{8}),
                                            ::testing::Values(false)));
INSTANTIATE_TEST_SUITE_P(SharedMemory, KillDuringAllReduce,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Values(size_t{1} << 20),
                                            ::testing::Values(true)));

TEST(CollectiveMismatch, RanksCallingDifferentCollectivesAreNamed) {
  Job job;
  std::vector<pid_t> pids;
  for (int r = 0; r < 2; ++r) {
    pids.push_back(spawn_rank(job, r, 2, 20s, [](Group& g) {
      std::vector<float> x(4096, 1.0f);
      if (g.rank() == 0) {
        g.all_reduce(x.data(), x.data(), 4096, DataType::f32, ReduceOp::sum);
      } else {
        g.broadcast(x.data(), 100, DataType::f32, 0);
      }
    }));
  }
  for (pid_t p : pids) wait_exit(p);
  const std::string r0 = read_file(job.dir / "result0");
  const std::string r1 = read_file(job.dir / "result1");
  EXPECT_NE(r0.find("rank 1 called broadcast(f32, 100, root 0) but rank 0 called all_reduce(f32, 4096, sum)"),
            std::string::npos)
      << r0;
  EXPECT_NE(r1.find("rank 0 called all_reduce(f32, 4096, sum) but rank 1 called broadcast(f32, 100, root 0)"),
            std::string::npos)
      << r1;
}

// The smallest all_reduces travel in flagged cache lines instead of the staging slots (see
// shm_collectives.cpp); a rank that called something else is named there too: another
// collective, another count (fewer lines than the peer waits for), or the same lines of another op.
TEST(CollectiveMismatch, RanksCallingDifferentSmallCollectivesAreNamed) {
  struct Case {
    std::function<void(Group&)> rank1;
    std::string rank1_called;
  };
  const std::vector<Case> cases = {
      {[](Group& g) {
         std::vector<float> x(100, 1.0f);
         g.broadcast(x.data(), 100, DataType::f32, 0);
       },
       "broadcast(f32, 100, root 0)"},
      {[](Group& g) {
         std::vector<float> x(40, 1.0f);
         g.all_reduce(x.data(), x.data(), 40, DataType::f32, ReduceOp::sum);
       },
       "all_reduce(f32, 40, sum)"},
      {[](Group& g) {
         std::vector<float> x(8, 1.0f);
         g.all_reduce(x.data(), x.data(), 8, DataType::f32, ReduceOp::max);
       },
       "all_reduce(f32, 8, max)"},
  };
  for (const Case& c : cases) {
    Job job;
    std::vector<pid_t> pids;
    for (int r = 0; r < 2; ++r) {
      pids.push_back(spawn_rank(job, r, 2, 20s, [&](Group& g) {
        if (g.rank() == 0) {
          std::vector<float> x(8, 1.0f);
          g.all_reduce(x.data(), x.data(), 8, DataType::f32, ReduceOp::sum);
        } else {
          c.rank1(g);
        }
      }));
    }
    for (pid_t p : pids) wait_exit(p);
    const std::string r0 = read_file(job.dir / "result0");
    const std::string r1 = read_file(job.dir / "result1");
    EXPECT_NE(r0.find(fmt::format("rank 1 called {} but rank 0 called all_reduce(f32, 8, sum)", c.rank1_called)),
              std::string::npos)
        << r0;
    EXPECT_NE(r1.find(fmt::format("rank 0 called all_reduce(f32, 8, sum) but rank 1 called {}", c.rank1_called)),
              std::string::npos)
        << r1;
  }
}

// A rank that stops (SIGSTOP: a hung process, no crash for anyone to see) while its peers are
// in a collective: its heartbeats stop, the rank watching it notices within the heartbeat
// timeout, and every other rank raises too, naming it, long before the collective's timeout.
TEST(Heartbeat, AStoppedRankIsReportedByEveryOtherRankWithinTheHeartbeatTimeout) {
  const int size = 3, victim = 1;
  GroupOptions opts;
  opts.timeout = 60s;  // the collective alone would wait this long
  opts.heartbeat_timeout = 1s;
  opts.heartbeat_interval = 100ms;
  Job job;
  int ready[2];
  ASSERT_EQ(0, ::pipe(ready));
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    pids.push_back(spawn_rank(job, r, size, opts, [&](Group& g) {
      std::vector<float> x(1024, 1.0f);
      g.all_reduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum);
      if (g.rank() == victim) {
        const char one = 1;
        (void)!::write(ready[1], &one, 1);
        ::raise(SIGSTOP);
      }
      for (int k = 0; k < 1000000; ++k) g.all_reduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum);
    }));
  }
  ::close(ready[1]);
  pollfd pfd{ready[0], POLLIN, 0};
  const bool victim_ready = ::poll(&pfd, 1, 60000) == 1 && (pfd.revents & POLLIN) != 0;
  ::close(ready[0]);
  const auto stopped_at = std::chrono::steady_clock::now();
  ASSERT_TRUE(victim_ready) << "the ranks never completed their first all_reduce";
  for (int r = 0; r < size; ++r) {
    if (r != victim) wait_exit(pids[static_cast<size_t>(r)]);
  }
  const auto detected = std::chrono::steady_clock::now() - stopped_at;
  ::kill(pids[static_cast<size_t>(victim)], SIGKILL);
  wait_exit(pids[static_cast<size_t>(victim)]);
  EXPECT_LT(detected, 10s) << "the survivors took too long to notice the stopped rank";
  // The watcher's last seen beat may precede the stop by an interval plus a store round trip.
  EXPECT_GE(detected, 700ms) << "detected well before the heartbeat timeout: a false alarm?";
  for (int r = 0; r < size; ++r) {
    if (r == victim) continue;
    const std::string res = read_file(job.dir / fmt::format("result{}", r));
    EXPECT_NE(res.find("all_reduce"), std::string::npos) << "rank " << r << ": " << res;
    EXPECT_NE(res.find(fmt::format("rank {} sent no heartbeat", victim)), std::string::npos)
        << "rank " << r << " does not name the stopped rank: " << res;
  }
}

// A rank that leaves cleanly is not a failure: the others go on past the heartbeat timeout.
TEST(Heartbeat, ARankThatLeftCleanlyIsNotReported) {
  GroupOptions opts = test_util::quick_options();
  opts.heartbeat_timeout = 300ms;
  opts.heartbeat_interval = 50ms;
  test_util::run_ranks(
      3,
      [](Group& world) {
        Group rest = world.split(world.rank() == 1 ? -1 : 0, world.rank());
        if (world.rank() == 1) return;  // leaves: its heartbeat says so
        std::vector<float> x(16, 1.0f);
        const auto until = std::chrono::steady_clock::now() + 1s;  // several heartbeat timeouts
        int rounds = 0;
        for (int go = 1; go != 0; ++rounds) {
          go = std::chrono::steady_clock::now() < until ? 1 : 0;
          rest.all_reduce(&go, &go, 1, DataType::i32, ReduceOp::min);  // both stop on the same round
          rest.all_reduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum);
        }
        EXPECT_GT(rounds, 1);
      },
      opts);
}

// The flight record keeps the last operations, in order, with their size and how they ended.
TEST(FlightRecord, KeepsTheLastOperationsInOrderWithTheirOutcome) {
  GroupOptions opts = test_util::quick_options();
  opts.flight_record_size = 4;
  test_util::run_ranks(
      2,
      [](Group& g) {
        std::vector<float> x(100, 1.0f);
        g.broadcast(x.data(), 10, DataType::f32, 1);
        for (int i = 0; i < 3; ++i) g.all_reduce(x.data(), x.data(), 100, DataType::f32, ReduceOp::sum);
        if (g.rank() == 0) {
          g.send(x.data(), 7, DataType::f32, 1, 3);
        } else {
          g.recv(x.data(), 7, DataType::f32, 0, 3);
        }
        const std::vector<FlightEntry> rec = g.flight_record();
        ASSERT_EQ(rec.size(), 4u);  // the broadcast fell out of the ring
        for (int i = 0; i < 3; ++i) {
          EXPECT_EQ(rec[static_cast<size_t>(i)].op, "all_reduce");
          EXPECT_TRUE(rec[static_cast<size_t>(i)].collective);
          EXPECT_EQ(rec[static_cast<size_t>(i)].bytes, 400u);
          EXPECT_EQ(rec[static_cast<size_t>(i)].state, FlightEntry::State::done);
          EXPECT_LE(rec[static_cast<size_t>(i)].started_at, rec[static_cast<size_t>(i)].finished_at);
        }
        // Collective sequence numbers (the group's own all_gather at creation may come first).
        EXPECT_EQ(rec[1].seq, rec[0].seq + 1);
        EXPECT_EQ(rec[2].seq, rec[1].seq + 1);
        EXPECT_EQ(rec[3].op, g.rank() == 0 ? "send" : "recv");
        EXPECT_FALSE(rec[3].collective);
        EXPECT_EQ(rec[3].peer, 1 - g.rank());
        EXPECT_EQ(rec[3].bytes, 28u);
        EXPECT_EQ(rec[3].state, FlightEntry::State::done);
      },
      opts);
}

TEST(FlightRecord, AFailedOperationIsRecordedWithItsError) {
  GroupOptions opts = test_util::quick_options();
  test_util::run_ranks(
      2,
      [](Group& g) {
        std::vector<float> x(8, 1.0f);
        if (g.rank() == 0) {
          EXPECT_THROW(g.recv(x.data(), 8, DataType::f32, 1, 9), CommError);  // rank 1 never sends (and leaves)
          const std::vector<FlightEntry> rec = g.flight_record();
          ASSERT_FALSE(rec.empty());
          EXPECT_EQ(rec.back().op, "recv");
          EXPECT_EQ(rec.back().state, FlightEntry::State::failed);
          EXPECT_NE(rec.back().error.find("recv #0"), std::string::npos) << rec.back().error;
        }
      },
      opts);
}

}  // namespace
}  // namespace dtrain::comm
