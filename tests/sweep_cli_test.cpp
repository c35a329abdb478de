// dtrain sweep end to end: tiny MLP trials as real processes, the sweep killed with SIGKILL and
// resumed, a trial killed and restarted, and bad input refused before any trial starts.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>

#include <set>
#include <sstream>
#include <vector>

#include "cli_util.h"

namespace {

// Each trial a few dozen steps of a 784-16-10 MLP: well under a second.
const char* kTiny = "-- --hidden 16 --batch-size 32";

std::vector<nlohmann::json> results(const std::string& file) {
  std::vector<nlohmann::json> out;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The results without the wall times (which no two runs share).
std::string without_times(std::vector<nlohmann::json> rows) {
  std::string out;
  for (auto& r : rows) {
    r.erase("time_s");
    out += r.dump() + "\n";
  }
  return out;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Polls the sweep's output until it reported `jobs` finished jobs; false after `limit`.
bool wait_for_jobs(const std::string& log, size_t jobs, std::chrono::seconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    if (count(slurp(log), " steps (") >= jobs) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

class SweepCliTest : public CliTest {};

TEST_F(SweepCliTest, GridFromTomlOrFlagsRecordsAFailureAndIsTheSameOnOneOrTwoWorkers) {
  write("s.toml",
        "[space]\nlr = [0.003, 1e30]\nweight_decay = [0.0, 0.01]\n"
        "[train]\nhidden = [16]\nbatch_size = 32\nsteps = 20\n");
  const ProcessResult two = dtrain("sweep --dir " + path("two") + " --config " + path("s.toml") + " --parallel 2");
  ASSERT_EQ(two.code, 0) << two.output;
  const std::vector<nlohmann::json> rows = results(path("two/results.jsonl"));
  ASSERT_EQ(rows.size(), 4u) << two.output;
  // The diverging trials are recorded with their error; the sweep went on.
  EXPECT_EQ(rows[0]["status"], "done");
  EXPECT_EQ(rows[1]["status"], "done");
  EXPECT_GE(rows[0]["value"].get<double>(), rows[1]["value"].get<double>());
  for (size_t i = 2; i < 4; ++i) {
    EXPECT_EQ(rows[i]["status"], "failed") << rows[i].dump();
    EXPECT_EQ(rows[i]["params"]["lr"], "1e+30");
    EXPECT_NE(rows[i]["error"].get<std::string>().find("training diverged"), std::string::npos) << rows[i].dump();
  }
  EXPECT_NE(two.output.find("best: trial"), std::string::npos) << two.output;
  EXPECT_EQ(rows[0]["steps"], 20);

  // The same search from flags is the same search (manifest) with the same results, one at a time.
  const ProcessResult one =
      dtrain("sweep --dir " + path("one") + " --param lr=0.003,1e30 --param weight-decay=0,0.01 --parallel 1 " + kTiny +
             " --steps 20");
  ASSERT_EQ(one.code, 0) << one.output;
  nlohmann::json search_one = nlohmann::json::parse(slurp(path("one/sweep.json")));
  nlohmann::json search_two = nlohmann::json::parse(slurp(path("two/sweep.json")));
  EXPECT_EQ(search_one["run"]["parallel"], 1);
  EXPECT_EQ(search_two["run"]["parallel"], 2);
  search_one.erase("run");
  search_two.erase("run");
  EXPECT_EQ(search_one, search_two);
  EXPECT_EQ(without_times(results(path("one/results.jsonl"))), without_times(rows));

  // The best trial's command reproduces its metric bit for bit.
  std::string command = rows[0]["command"].get<std::string>();
  ASSERT_EQ(command.rfind("dtrain train ", 0), 0u) << command;
  const ProcessResult again = dtrain(command.substr(7) + " --progress=false --metrics " + path("best.jsonl"));
  ASSERT_EQ(again.code, 0) << again.output;
  EXPECT_EQ(final_record("best.jsonl")["test_accuracy"].get<double>(), rows[0]["value"].get<double>());
  EXPECT_FALSE(fs::exists(path("two/trial-0000/checkpoints")));  // removed at the end
}

TEST_F(SweepCliTest, AshaKilledThreeTimesOrWithAKilledTrialResumesToTheSameResults) {
  const std::string search =
      "sweep --strategy asha --param lr=0.0003,0.001,0.003,0.01 --param weight-decay=0,0.001 --trials 8 --eta 2 "
      "--min-steps 10 --max-steps 40 --parallel 2 ";
  const ProcessResult ref = dtrain(search + "--dir " + path("ref") + " " + kTiny);
  ASSERT_EQ(ref.code, 0) << ref.output;
  const std::vector<nlohmann::json> want = results(path("ref/results.jsonl"));
  ASSERT_EQ(want.size(), 8u);
  std::set<std::string> statuses;
  int64_t steps = 0;
  for (const auto& r : want) {
    statuses.insert(r["status"].get<std::string>());
    steps += r["steps"].get<int64_t>();
  }
  EXPECT_EQ(statuses, (std::set<std::string>{"done", "stopped"}));  // early stopping happened
  EXPECT_EQ(want[0]["status"], "done");
  EXPECT_EQ(want[0]["steps"], 40);
  EXPECT_LT(steps, 8 * 40);
  EXPECT_NE(ref.output.find("steps trained: " + std::to_string(steps)), std::string::npos) << ref.output;

  // kill -9 of the sweep after 1, 3 and 2 more finished jobs, each time resumed.
  const std::string dir = path("killed");
  std::string args = search + "--dir " + dir + " " + kTiny;
  for (size_t jobs : {1, 3, 2}) {
    const std::string log = path("killed-" + std::to_string(jobs) + ".log");
    const pid_t pid = dtrain_background(args, log);
    ASSERT_TRUE(wait_for_jobs(log, jobs, std::chrono::seconds(120))) << slurp(log);
    const pid_t sweep = static_cast<pid_t>(std::stol(slurp(dir + "/.lock")));  // the sweep itself, not its wrapper
    ASSERT_EQ(::kill(sweep, SIGKILL), 0);
    EXPECT_NE(wait_code(pid), 0);
    args = "sweep --resume " + dir;
  }
  const ProcessResult resumed = dtrain(args);
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_EQ(without_times(results(dir + "/results.jsonl")), without_times(want)) << resumed.output;

  // A trial killed (SIGKILL at step 15, on each job's first start): restarted from its checkpoint.
  ::setenv("DTRAIN_FAULT", "kill:rank=0:step=15", 1);
  const ProcessResult killed_trials = dtrain(search + "--dir " + path("trials") + " " + kTiny);
  ::unsetenv("DTRAIN_FAULT");
  ASSERT_EQ(killed_trials.code, 0) << killed_trials.output;
  EXPECT_NE(killed_trials.output.find("was killed by signal 9"), std::string::npos) << killed_trials.output;
  EXPECT_NE(killed_trials.output.find("restarting it from its checkpoint"), std::string::npos);
  EXPECT_EQ(without_times(results(path("trials/results.jsonl"))), without_times(want));
}

TEST_F(SweepCliTest, BadInputGetsAClearErrorBeforeAnyTrialStarts) {
  const std::string dir = path("s");
  struct Case {
    std::string args, message;
  };
  const std::vector<Case> cases = {
      {"--param lrate=0.1,0.2", "'lrate' is not a dtrain train option"},
      {"--param lr=range:0.1:0.01", "the range [0.1, 0.01] is empty"},
      {"--param lr=0.1,0.2 --metric val_loss", "whose final metrics record has test_accuracy"},
      {"--param lr=0.1,0.2 --strategy asha", "asha needs a step budget"},
      {"--param metrics=a,b", "set by the sweep"},
  };
  for (const Case& c : cases) {
    const ProcessResult r = dtrain("sweep --dir " + dir + " " + c.args + " " + kTiny);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_FALSE(fs::exists(dir)) << c.args;  // nothing created, nothing started
  }
  const ProcessResult typo = dtrain("sweep --dir " + dir + " --param lr=0.1 -- --hiden 16");
  EXPECT_EQ(typo.code, 2);
  EXPECT_NE(typo.output.find("--hiden"), std::string::npos) << typo.output;

  // A sweep directory belongs to its search.
  const std::string tiny = std::string(" --param lr=0.01 ") + "-- --hidden 8 --batch-size 16 --steps 2";
  ASSERT_EQ(dtrain("sweep --dir " + dir + tiny).code, 0);
  const ProcessResult other = dtrain("sweep --resume " + dir + " --param lr=0.02");
  EXPECT_EQ(other.code, 2);
  EXPECT_NE(other.output.find("the sweep there is another search"), std::string::npos) << other.output;
  EXPECT_NE(other.output.find("space: "), std::string::npos) << other.output;
  const ProcessResult seed = dtrain("sweep --resume " + dir + " --seed 4");
  EXPECT_NE(seed.output.find("seed: 0 vs 4"), std::string::npos) << seed.output;
  const ProcessResult again = dtrain("sweep --dir " + dir + tiny);
  EXPECT_EQ(again.code, 2);
  EXPECT_NE(again.output.find("holds a sweep already: continue it with --resume"), std::string::npos) << again.output;
  const ProcessResult same = dtrain("sweep --resume " + dir + tiny);  // the same search: its results again
  EXPECT_EQ(same.code, 0) << same.output;
  EXPECT_NE(same.output.find("best: trial 0"), std::string::npos) << same.output;
  // Two sweeps never share a directory.
  const int fd = ::open((dir + "/.lock").c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  const ProcessResult busy = dtrain("sweep --resume " + dir);
  ::close(fd);
  EXPECT_EQ(busy.code, 2);
  EXPECT_NE(busy.output.find("is in use by another dtrain sweep"), std::string::npos) << busy.output;
}

// Starts the dtrain binary with `env` added, its output going to `log`; returns its pid. With a
// limit, under timeout; without, the binary itself (so that a SIGKILL reaches it).
pid_t dtrain_direct(const std::vector<std::string>& args, const std::vector<std::string>& env, const std::string& log,
                    int limit_s = 0) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    for (const std::string& e : env) ::putenv(const_cast<char*>(e.c_str()));
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, STDOUT_FILENO);
    ::dup2(fd, STDERR_FILENO);
    const std::string limit = std::to_string(limit_s);
    std::vector<char*> argv;
    if (limit_s > 0) {
      for (const char* w : {"timeout", "-k", "5"}) argv.push_back(const_cast<char*>(w));
      argv.push_back(const_cast<char*>(limit.c_str()));
    }
    argv.push_back(const_cast<char*>(DTRAIN_BINARY));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

std::vector<std::string> words(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// Across hosts: `dtrain launch -n 2 -- dtrain sweep` (rank 0 coordinates, both ranks run trials)
// gives the one-host sweep's results bit for bit; a worker host killed mid-trial is lost, its
// trial runs again on the other host from its checkpoint, and the results are still the same.
TEST_F(SweepCliTest, TwoHostsGiveTheResultsOfOneAndSurviveALostHost) {
  const std::string search =
      "sweep --strategy asha --param lr=0.0003,0.001,0.003,0.01 --param weight-decay=0,0.001 --trials 4 --eta 2 "
      "--min-steps 10 --max-steps 40 ";
  const ProcessResult ref = dtrain(search + "--parallel 2 --dir " + path("ref") + " " + kTiny);
  ASSERT_EQ(ref.code, 0) << ref.output;
  const std::string want = without_times(results(path("ref/results.jsonl")));

  const ProcessResult two =
      run_shell("timeout -k 5 240 " + std::string(DTRAIN_BINARY) + " launch -n 2 -- " + DTRAIN_BINARY + " " + search +
                "--parallel 1 --dir " + path("two") + " " + kTiny + " 2>&1");
  ASSERT_EQ(two.code, 0) << two.output;
  EXPECT_EQ(without_times(results(path("two/results.jsonl"))), want) << two.output;
  const nlohmann::json hosts = nlohmann::json::parse(slurp(path("two/hosts.json")));
  ASSERT_EQ(hosts.size(), 2u) << hosts.dump();
  int64_t jobs = 0;
  for (const auto& h : hosts) {
    EXPECT_GT(h["jobs"].get<int64_t>(), 0) << hosts.dump();  // both hosts ran trials
    EXPECT_FALSE(h.contains("lost")) << hosts.dump();
    jobs += h["jobs"].get<int64_t>();
  }
  EXPECT_EQ(static_cast<size_t>(jobs), count(two.output, " steps ("));  // every job reported once
#ifdef DTRAIN_MPIRUN
  // Under mpirun: the store's address goes through MPI.
  const ProcessResult mpi = run_shell("timeout -k 5 240 " + std::string(DTRAIN_MPIRUN) + " -n 2 " + DTRAIN_BINARY +
                                      " " + search + "--parallel 1 --dir " + path("mpi") + " " + kTiny + " 2>&1");
  ASSERT_EQ(mpi.code, 0) << mpi.output;
  EXPECT_EQ(without_times(results(path("mpi/results.jsonl"))), want) << mpi.output;
  EXPECT_EQ(nlohmann::json::parse(slurp(path("mpi/hosts.json"))).size(), 2u);
#endif

  // Two "hosts" started by hand (as srun would, with the store's address): the worker is killed
  // with SIGKILL while it trains (its trial dies with it); after --host-timeout it is lost.
  const std::vector<std::string> common{
      "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(free_port()), "WORLD_SIZE=2",
      "DTRAIN_SECRET=5f0c6e1a9b3d47f28e61c0b4a7d93e25f1c8b06a4e2d97f3b5a1c6e08d4f7b29"};
  std::vector<std::string> args = words(search + "--parallel 1 --host-timeout 2 --dir " + path("lost") + " " + kTiny);
  std::vector<std::string> env0 = common, env1 = common;
  env0.push_back("RANK=0");
  env1.push_back("RANK=1");
  const std::string log0 = path("lost-0.log"), log1 = path("lost-1.log");
  const pid_t coordinator = dtrain_direct(args, env0, log0, 240);
  const pid_t worker = dtrain_direct(args, env1, log1);
  const bool started = wait_for_text(log0, "started on rank 1", std::chrono::seconds(60));
  ::kill(worker, SIGKILL);
  EXPECT_EQ(wait_code(worker), 128 + SIGKILL);
  ASSERT_TRUE(started) << slurp(log0) << slurp(log1);
  EXPECT_EQ(wait_code(coordinator), 0) << slurp(log0);
  const std::string out = slurp(log0);
  EXPECT_NE(out.find("was lost (no heartbeat for 2 s"), std::string::npos) << out;
  EXPECT_EQ(without_times(results(path("lost/results.jsonl"))), want) << out;
  const nlohmann::json lost = nlohmann::json::parse(slurp(path("lost/hosts.json")));
  ASSERT_EQ(lost.size(), 2u);
  EXPECT_TRUE(lost[1].contains("lost")) << lost.dump();
}

}  // namespace
