// dtrain status against real jobs: it finds the job on this host through the launcher's job
// file (readable only by its user), lists every rank within a second, marks a SIGSTOPped rank
// stale before the heartbeat timeout ends the job, and reaches a job by address and secret.
#include "dtrain/launch/status.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>

#include <regex>

#include "cli_util.h"

namespace {

class Status : public CliTest {
 protected:
  void SetUp() override {
    CliTest::SetUp();
    // The job files of this test only (jobs_dir() follows XDG_RUNTIME_DIR).
    ::setenv("XDG_RUNTIME_DIR", dir_.c_str(), 1);
  }
  void TearDown() override {
    ::unsetenv("XDG_RUNTIME_DIR");
    CliTest::TearDown();
  }
  // `dtrain status ARGS` until its output matches `pattern` or `limit` passes; the last output.
  ProcessResult status_until(const std::string& args, const std::regex& pattern, std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    ProcessResult r{-1, ""};
    while (std::chrono::steady_clock::now() < until) {
      r = dtrain("status " + args, 30);
      if (std::regex_search(r.output, pattern)) return r;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // polling a live job, bounded by `limit`
    }
    return r;
  }
};

// The pid in rank R's row of a status table.
int pid_of(const std::string& table, int rank) {
  std::smatch m;
  const std::regex row("\\n\\s*" + std::to_string(rank) + "\\s+(\\d+)\\s");
  return std::regex_search(table, m, row) ? std::stoi(m[1].str()) : -1;
}

TEST_F(Status, ListsEveryRankOfAFourRankJobAndMarksAStoppedOneStale) {
  const pid_t job = dtrain_background(
      "train --model mlp --hidden 32 --dp 4 --batch-size 64 --steps 100000 --log-every 1000 --progress=false "
      "--heartbeat-timeout 5",
      path("job.log"), 180);
  // Every rank has published a status after a finished step: four rows, the last with a throughput
  // (a loaded machine can show the first step still in progress, with no throughput yet).
  const std::regex four("\\n\\s*3\\s+\\d+\\s+\\d+\\s[^\\n]*samples/s");
  ProcessResult r = status_until("", four, std::chrono::seconds(90));
  ASSERT_TRUE(std::regex_search(r.output, four)) << r.output << slurp(path("job.log"));
  // One look lists every rank within a second.
  const auto t0 = std::chrono::steady_clock::now();
  r = dtrain("status", 30);
  const double look = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_LT(look, 1.0) << r.output;
  std::printf("dtrain status on a 4-rank job: %.3f s\n%s", look, r.output.c_str());
  for (int rank = 0; rank < 4; ++rank) EXPECT_GT(pid_of(r.output, rank), 0) << "rank " << rank << ":\n" << r.output;
  EXPECT_NE(r.output.find("world 'world': 4 ranks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("samples/s"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("STALE"), std::string::npos) << r.output;
  // The job file: only this user can read it.
  struct stat st {};
  const std::string dir = dtrain::launch::jobs_dir();
  ASSERT_EQ(::stat(dir.c_str(), &st), 0) << dir;
  EXPECT_EQ(st.st_mode & 077, 0u) << dir;
  const std::vector<dtrain::launch::JobInfo> jobs = dtrain::launch::find_jobs();
  ASSERT_EQ(jobs.size(), 1u);
  ASSERT_EQ(::stat(jobs[0].path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << jobs[0].path;
  // By address: the same table, with the job's secret.
  ::setenv("DTRAIN_SECRET", jobs[0].secret.c_str(), 1);
  ProcessResult by_address =
      dtrain(fmt::format("status --master-addr {} --master-port {}", jobs[0].addr, jobs[0].port));
  ::unsetenv("DTRAIN_SECRET");
  EXPECT_EQ(by_address.code, 0) << by_address.output;
  EXPECT_GT(pid_of(by_address.output, 3), 0) << by_address.output;
  // SIGSTOP rank 2: stale before the heartbeat timeout (5 s) would end the job.
  const int victim = pid_of(r.output, 2);
  ASSERT_GT(victim, 0);
  ASSERT_EQ(::kill(victim, SIGSTOP), 0);
  const auto stopped = std::chrono::steady_clock::now();
  const std::regex stale("\\n\\s*2\\s+" + std::to_string(victim) + "\\s[^\\n]*STALE");
  r = status_until("", stale, std::chrono::seconds(5));
  const double marked = std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count();
  EXPECT_TRUE(std::regex_search(r.output, stale)) << r.output;
  EXPECT_LT(marked, 5.0);
  std::printf("SIGSTOPped rank 2 marked stale after %.2f s (heartbeat timeout 5 s)\n%s", marked, r.output.c_str());
  // The other ranks are not.
  for (int rank : {0, 1, 3}) {
    const std::regex row("\\n\\s*" + std::to_string(rank) + "\\s[^\\n]*STALE");
    EXPECT_FALSE(std::regex_search(r.output, row)) << "rank " << rank << ":\n" << r.output;
  }
  ::kill(victim, SIGCONT);
  ::kill(job, SIGTERM);
  wait_code(job);
}

TEST_F(Status, WithoutJobsOrSecretItSaysSo) {
  ProcessResult none = dtrain("status");
  EXPECT_EQ(none.code, 1) << none.output;
  EXPECT_NE(none.output.find("no dtrain jobs of this user on this host"), std::string::npos) << none.output;
  ::unsetenv("DTRAIN_SECRET");
  ProcessResult no_secret = dtrain("status --master-addr 127.0.0.1 --master-port 9");
  EXPECT_EQ(no_secret.code, 2) << no_secret.output;
  EXPECT_NE(no_secret.output.find("export DTRAIN_SECRET"), std::string::npos) << no_secret.output;
  ProcessResult half = dtrain("status --master-port 9");
  EXPECT_EQ(half.code, 2) << half.output;
  EXPECT_NE(half.output.find("give both"), std::string::npos) << half.output;
}

}  // namespace
