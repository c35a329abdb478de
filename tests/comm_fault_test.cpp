// Failures through the whole Group path with real processes: kill -9 of one rank while the
// others are inside an all_reduce makes every survivor raise CommError naming the dead rank,
// well within the timeout, and leaves nothing in /dev/shm. Also: a rank that calls a different
// collective is reported with both calls instead of corrupting data.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "dtrain/comm/group.h"

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
pid_t spawn_rank(const Job& job, int rank, int size, Duration timeout, Body body) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  std::string outcome;
  try {
    GroupOptions opts;
    opts.timeout = timeout;
    Group g = Group::create(make_file_store((job.dir / "store").string()), rank, size, opts, job.name);
    body(g);
    outcome = "ok";
  } catch (const std::exception& e) {
    outcome = e.what();
  }
  std::ofstream(job.dir / fmt::format("result{}", rank)) << outcome;
  ::_exit(0);
}

int wait_exit(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

class KillDuringAllReduce : public ::testing::TestWithParam<int> {};

TEST_P(KillDuringAllReduce, SurvivorsRaiseNamingTheDeadRankWithinTheTimeout) {
  const int size = GetParam();
  const int victim = size / 2;
  const Duration timeout = 20s;  // detection must come from the liveness check, far sooner
  Job job;
  int ready[2];
  ASSERT_EQ(0, ::pipe(ready));
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    pids.push_back(spawn_rank(job, r, size, timeout, [&](Group& g) {
      std::vector<float> x(size_t{1} << 20, 1.0f);  // 4 MiB: several staging chunks per call
      if (g.rank() == victim) {
        g.all_reduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum);
        const char one = 1;
        (void)!::write(ready[1], &one, 1);
        ::pause();  // killed here, while the others are inside the next all_reduce
      }
      for (int k = 0; k < 1000000; ++k) g.all_reduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum);
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
    EXPECT_NE(res.find(fmt::format("rank {} (pid {}) died", victim, pids[static_cast<size_t>(victim)])), std::string::npos)
        << "rank " << r << " does not name the dead rank: " << res;
  }
  EXPECT_TRUE(shm_entries(job.name).empty()) << "segments left in /dev/shm";
}

INSTANTIATE_TEST_SUITE_P(Ranks, KillDuringAllReduce, ::testing::Values(2, 4));

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

}  // namespace
}  // namespace dtrain::comm
