// dtrain sweep end to end: tiny MLP trials as real processes, the sweep killed with SIGKILL and
// resumed, a trial killed and restarted, and bad input refused before any trial starts.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>

#include <set>
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

}  // namespace
