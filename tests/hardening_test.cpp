// What a careless user or a hostile local user could do to a run, and what dtrain does about
// it: launched worlds of the wrong size, two writers of one file, symlinks planted at output
// names, ranks that hang or leave early, ranks started with different options, orphaned
// workers, outputs that cannot be written, workers that flood the launcher.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "cli_util.h"
#include "dtrain/core/error.h"
#include "dtrain/core/file.h"

namespace {

using Clock = std::chrono::steady_clock;

class Hardening : public CliTest {
 protected:
  // Every line of a JSON-lines file parses (two writers interleaving would break lines).
  bool all_lines_json(const std::string& name) const {
    std::ifstream in(path(name));
    std::string line;
    int lines = 0;
    while (std::getline(in, line)) {
      if (nlohmann::json::parse(line, nullptr, false).is_discarded()) return false;
      ++lines;
    }
    return lines > 0;
  }
  double seconds(Clock::time_point since) const { return std::chrono::duration<double>(Clock::now() - since).count(); }
};

const std::string kMlp = "train --model mlp --hidden 32 --progress=false";

// Worker pids of a launcher (its children), from /proc.
std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> out;
  std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
  pid_t c = 0;
  while (in >> c) out.push_back(c);
  return out;
}

// Alive and not a zombie.
bool running(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return false;
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

// Polls until none of `pids` runs (true) or `limit` passed.
bool all_gone(const std::vector<pid_t>& pids, std::chrono::seconds limit) {
  const auto until = Clock::now() + limit;
  while (Clock::now() < until) {
    bool any = false;
    for (pid_t p : pids) any = any || running(p);
    if (!any) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// 1. `dtrain launch -n 2 -- dtrain train ...` once ran two independent trainings writing the
// same files. Without --dp the workers are the replicas; with another --dp it is refused.
TEST_F(Hardening, ALaunchedWorldOfAnotherSizeBecomesTheReplicasOrIsRefused) {
  const std::string job = kMlp + " --steps 10";
  ProcessResult ref = dtrain(job + " --dp 2 --metrics " + path("ref.jsonl"));
  ASSERT_EQ(ref.code, 0) << ref.output;
  ProcessResult adopted =
      dtrain("launch -n 2 -- " + std::string(DTRAIN_BINARY) + " " + job + " --metrics " + path("m.jsonl"));
  ASSERT_EQ(adopted.code, 0) << adopted.output;
  EXPECT_NE(adopted.output.find("2 workers started by the launcher: --dp 2"), std::string::npos) << adopted.output;
  EXPECT_TRUE(all_lines_json("m.jsonl"));
  EXPECT_EQ(final_record("m.jsonl")["dp"], 2);
  EXPECT_EQ(final_record("m.jsonl")["params_digest"], final_record("ref.jsonl")["params_digest"]);

  ProcessResult refused =
      dtrain("launch -n 2 -- " + std::string(DTRAIN_BINARY) + " " + job + " --dp 1 --metrics " + path("x.jsonl"));
  EXPECT_NE(refused.code, 0) << refused.output;
  EXPECT_NE(refused.output.find("the launcher started 2 workers (WORLD_SIZE=2) but --dp 1 x --pp 1 x --tp 1 = 1"),
            std::string::npos)
      << refused.output;
  EXPECT_EQ(refused.output.find("step 5"), std::string::npos) << "it trained: " << refused.output;
}

// 1. Two runs given the same --metrics: the second is refused while the first writes it.
TEST_F(Hardening, TwoRunsNeverWriteOneMetricsFile) {
  const pid_t first =
      dtrain_background(kMlp + " --steps 100000 --log-every 1 --metrics " + path("m.jsonl"), path("first.log"), 120);
  ASSERT_TRUE(wait_for_text(path("m.jsonl"), "\"event\":\"log\"", std::chrono::seconds(60)))
      << slurp(path("first.log"));
  ProcessResult second = dtrain(kMlp + " --steps 5 --metrics " + path("m.jsonl"));
  ::kill(first, SIGTERM);
  wait_code(first);
  EXPECT_NE(second.code, 0) << second.output;
  EXPECT_NE(second.output.find("--metrics " + path("m.jsonl") + ": another process is writing this file"),
            std::string::npos)
      << second.output;
  EXPECT_TRUE(all_lines_json("m.jsonl"));
}

// 2. A local user who can write the output directory plants symlinks at the output's name and
// at the names the writers used to use (NAME.tmp.PID, NAME.tmp): nothing is written through them.
TEST_F(Hardening, NoWriterFollowsASymlinkPlantedAtItsName) {
  write("victim", "precious\n");
  const std::string victim = path("victim");
  ASSERT_EQ(::symlink(victim.c_str(), path("m.dtm").c_str()), 0);
  ASSERT_EQ(::symlink(victim.c_str(), path("t.json").c_str()), 0);
  for (int pid = 1; pid < 4096; ++pid) {  // the old predictable temporary names
    (void)::symlink(victim.c_str(), path("m.dtm.tmp." + std::to_string(pid)).c_str());
  }
  ProcessResult r = dtrain(kMlp + " --steps 4 --save " + path("m.dtm") + " --trace " + path("t.json"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(slurp(victim), "precious\n");
  struct stat st {};
  ASSERT_EQ(::lstat(path("m.dtm").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "--save wrote through the symlink instead of replacing it";
  ASSERT_EQ(::lstat(path("t.json").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_FALSE(nlohmann::json::parse(slurp(path("t.json")), nullptr, false).is_discarded());
  // A stream (the metrics) is not replaced but refused.
  ASSERT_EQ(::symlink(victim.c_str(), path("m.jsonl").c_str()), 0);
  ProcessResult metrics = dtrain(kMlp + " --steps 4 --metrics " + path("m.jsonl"));
  EXPECT_NE(metrics.code, 0) << metrics.output;
  EXPECT_NE(metrics.output.find(path("m.jsonl") + ": is a symbolic link; refusing to write through it"),
            std::string::npos)
      << metrics.output;
  EXPECT_EQ(slurp(victim), "precious\n");
}

TEST(AtomicFile, ReplacesASymlinkAndLeavesNoTemporaryBehind) {
  char tmpl[] = "/tmp/dtrain-atomic-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::ofstream(dir + "/victim") << "precious";
  ASSERT_EQ(::symlink((dir + "/victim").c_str(), (dir + "/out").c_str()), 0);
  dtrain::write_file_atomic(dir + "/out", "new bytes");
  EXPECT_EQ(slurp(dir + "/victim"), "precious");
  EXPECT_EQ(slurp(dir + "/out"), "new bytes");
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir)) entries += e.path().filename().string().starts_with(".") ? 100 : 1;
  EXPECT_EQ(entries, 2) << "a temporary file was left behind";
  // A directory that cannot take files: the error names the path.
  try {
    dtrain::write_file_atomic("/proc/dtrain-nope/out", "x", "test");
    ADD_FAILURE() << "no error";
  } catch (const dtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/proc/dtrain-nope/out: cannot create a file in /proc/dtrain-nope"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

// 4. A rank whose main thread hangs while its heartbeat thread beats on: reported within the
// heartbeat timeout plus a few seconds, naming the rank and what it was doing.
TEST_F(Hardening, ARankWhoseLoopHangsIsNamedWithinTheHeartbeatTimeout) {
  ::setenv("DTRAIN_FAULT", "hang:rank=1:step=4", 1);
  const auto t0 = Clock::now();
  ProcessResult r = dtrain(kMlp + " --dp 2 --steps 50 --heartbeat-timeout 2", 120);
  const double took = seconds(t0);
  ::unsetenv("DTRAIN_FAULT");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_LT(took, 2 + 6) << r.output;
  EXPECT_NE(r.output.find("rank 1 made no progress (heartbeat timeout 2000 ms): its main work is stuck in 'reading "
                          "its data (DTRAIN_FAULT hang)' at step 4"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("rank 1 made no progress (hung): it is the failed worker"), std::string::npos) << r.output;
}

// 4. A worker that exits 0 before the rendezvous, or in the middle of the job, is a failure
// reported at once, not a success that leaves rank 0 waiting for the whole --timeout.
TEST_F(Hardening, ARankThatEndsBeforeTheJobIsAFailureReportedAtOnce) {
  const std::string train = std::string(DTRAIN_BINARY) + " " + kMlp + " --dp 2 --steps 50";
  auto t0 = Clock::now();
  ProcessResult before = dtrain("launch -n 2 -- sh -c 'if [ $RANK = 1 ]; then exit 0; fi; exec " + train + "'", 120);
  double took = seconds(t0);
  EXPECT_NE(before.code, 0) << before.output;
  EXPECT_LT(took, 20) << before.output;
  EXPECT_NE(before.output.find("exited with code 0 before joining the job, while rank 0 joined and waits for it"),
            std::string::npos)
      << before.output;

  ::setenv("DTRAIN_FAULT", "exit:rank=1:step=3", 1);
  t0 = Clock::now();
  ProcessResult during = dtrain(kMlp + " --dp 2 --steps 50 --heartbeat-timeout 0", 120);
  took = seconds(t0);
  ::unsetenv("DTRAIN_FAULT");
  EXPECT_NE(during.code, 0) << during.output;
  EXPECT_LT(took, 20) << during.output;
  EXPECT_NE(during.output.find("exited with code 0 before the job ended: it joined the job's world but never left it"),
            std::string::npos)
      << during.output;

  // A plain program that never joins a world still ends well.
  ProcessResult plain = dtrain("launch -n 2 -- true");
  EXPECT_EQ(plain.code, 0) << plain.output;
}

// 4. Ranks started with different options are refused before the first step, naming the rank
// and each option that differs.
TEST_F(Hardening, RanksWithDifferentOptionsAreRefusedAtStart) {
  const std::string train = std::string(DTRAIN_BINARY) + " " + kMlp + " --dp 2";
  struct Case {
    std::string per_rank;  // options that depend on $RANK
    std::string says;
  };
  const std::vector<Case> cases = {
      {"--steps $((20 + RANK))", "rank 1 has --steps 21 but rank 0 has 20"},
      {"--steps 20 --lr 0.00$((1 + RANK))", "rank 1 has --lr"},
      {"--steps 20 --batch-size $((32 + 32 * RANK))", "rank 1 has --batch-size 64 but rank 0 has 32"},
      {"--steps 20 --seed $RANK", "rank 1 has --seed 1 but rank 0 has 0"},
      {"--steps 20 --optimizer $([ $RANK = 0 ] && echo sgd || echo adamw)", "rank 1 has --optimizer \"adamw\""},
  };
  for (const Case& c : cases) {
    const auto t0 = Clock::now();
    ProcessResult r = dtrain("launch -n 2 -- sh -c '" + train + " " + c.per_rank + "'", 120);
    EXPECT_NE(r.code, 0) << c.per_rank << ": " << r.output;
    EXPECT_LT(seconds(t0), 30) << c.per_rank;
    EXPECT_NE(r.output.find("the ranks were started with different options"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.per_rank << ": " << r.output;
    EXPECT_EQ(r.output.find("step 5/"), std::string::npos) << c.per_rank << ": it trained: " << r.output;
  }
}

// 5. Workers never outlive their launcher: killed with it even with heartbeats off.
TEST_F(Hardening, WorkersStopWhenTheirLauncherIsKilled) {
  const pid_t launcher = ::fork();
  if (launcher == 0) {
    const int fd = ::open(path("run.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    // Quiet workers: one that prints would die of SIGPIPE once the launcher is gone anyway.
    const std::string args = kMlp + " --dp 2 --steps 1000000 --log-every 1000000 --heartbeat-timeout 0";
    ::execl("/bin/sh", "sh", "-c", ("exec " + std::string(DTRAIN_BINARY) + " " + args).c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_TRUE(wait_for_text(path("run.log"), "[rank 0] [", std::chrono::seconds(60))) << slurp(path("run.log"));
  const std::vector<pid_t> workers = children_of(launcher);
  ASSERT_EQ(workers.size(), 2u) << slurp(path("run.log"));
  ::kill(launcher, SIGKILL);
  wait_code(launcher);
  EXPECT_TRUE(all_gone(workers, std::chrono::seconds(10))) << "workers outlived their launcher";
  for (pid_t w : workers) ::kill(w, SIGKILL);  // whatever happened, leave nothing behind
}

// 5. A launcher that cannot start every worker (out of file descriptors) stops those it started.
TEST_F(Hardening, ALauncherThatFailsWhileStartingWorkersStopsThem) {
  const std::string marker = "--seed 918273";  // finds this test's processes (pgrep: [-]-seed, not itself)
  ProcessResult r = run_shell("ulimit -n 16; timeout -k 5 60 " + std::string(DTRAIN_BINARY) + " " + kMlp +
                              " --dp 8 --steps 100000 " + marker + " 2>&1");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("Too many open files (while starting worker"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("already started were stopped"), std::string::npos) << r.output;
  ProcessResult left = run_shell("pgrep -f -- '[-]-seed 918273' | wc -l");
  EXPECT_EQ(std::stoi(left.output), 0) << "workers left running";
}

// 6. An output that cannot be written fails the run at start, naming the path.
TEST_F(Hardening, AnOutputThatCannotBeWrittenFailsAtStartNamingIt) {
  for (const std::string flag : {"--trace", "--save", "--metrics"}) {
    ProcessResult r = dtrain(kMlp + " --steps 20 " + flag + " /nonexistent/out.file");
    EXPECT_NE(r.code, 0) << flag << ": " << r.output;
    EXPECT_NE(r.output.find(flag + " /nonexistent/out.file: cannot write in /nonexistent"), std::string::npos)
        << flag << ": " << r.output;
    EXPECT_EQ(r.output.find("step 5"), std::string::npos) << flag << ": it trained first: " << r.output;
  }
  fs::create_directory(path("adir"));
  ProcessResult dir = dtrain(kMlp + " --steps 20 --save " + path("adir"));
  EXPECT_NE(dir.code, 0) << dir.output;
  EXPECT_NE(dir.output.find("--save " + path("adir") + ": is a directory"), std::string::npos) << dir.output;
}

// 6. A worker printing without newlines: its output comes through in bounded pieces, said once.
TEST_F(Hardening, TheLaunchersLineBufferIsBounded) {
  ProcessResult r = dtrain("launch -n 1 -- sh -c \"head -c 1000000 /dev/zero | tr '\\\\0' x; echo; echo end\"");
  ASSERT_EQ(r.code, 0) << r.output.substr(0, 500);
  std::istringstream lines(r.output);
  std::string line;
  size_t longest = 0, xs = 0;
  int notes = 0;
  while (std::getline(lines, line)) {
    longest = std::max(longest, line.size());
    xs += static_cast<size_t>(std::count(line.begin(), line.end(), 'x'));
    notes += line.find("lines longer than 65536 bytes; they are split") != std::string::npos ? 1 : 0;
  }
  EXPECT_EQ(xs, 1000000u);  // nothing lost
  EXPECT_LE(longest, 65536u + 16u);
  EXPECT_EQ(notes, 1);
  EXPECT_NE(r.output.find("[rank 0] end"), std::string::npos);
}

}  // namespace

namespace {

// Resuming a checkpoint past the run's end once printed a summary with loss 0.0000.
TEST_F(Hardening, ACheckpointPastTheRunsEndIsRefused) {
  const std::string job = kMlp + " --checkpoint-dir " + path("ck") + " --checkpoint-every 10";
  ASSERT_EQ(dtrain(job + " --steps 30").code, 0);
  ProcessResult shorter = dtrain(job + " --steps 20");
  EXPECT_NE(shorter.code, 0) << shorter.output;
  EXPECT_NE(shorter.output.find("its newest checkpoint is at step 30, past the end of this run (20 steps)"),
            std::string::npos)
      << shorter.output;
  ProcessResult same = dtrain(job + " --steps 30");
  EXPECT_EQ(same.code, 0) << same.output;
  EXPECT_NE(same.output.find("all 30 steps were done already"), std::string::npos) << same.output;
  EXPECT_EQ(same.output.find("train loss 0.0000"), std::string::npos) << same.output;
}

}  // namespace
