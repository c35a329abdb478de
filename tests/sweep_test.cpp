// dtrain sweep without processes: the space from flags and TOML, the trials of grid and random,
// successive halving's decisions on synthetic metrics, records, results, and the errors bad input
// gets before any trial could start.
#include "dtrain/train/sweep.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "dtrain/core/error.h"

namespace dtrain::train {
namespace {

using State = RungOutcome::State;

// The message of the dtrain::Error `f` throws ("" when it throws none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

SweepSpec grid_spec(std::vector<std::string> params, std::vector<std::string> train = {"--hidden=8", "--steps=4"}) {
  SweepSpec s;
  for (const auto& p : params) s.space.push_back(parse_sweep_axis(p));
  s.train = parse_train_flags(train);
  return s;
}

std::string value(const SweepTrial& t, const std::string& name) {
  for (const auto& [n, v] : t.params) {
    if (n == name) return v;
  }
  return "?";
}

TEST(SweepSpace, ParsesListsRangesAndLogRanges) {
  SweepAxis list = parse_sweep_axis("lr=1e-3,0.01");
  EXPECT_EQ(list.name, "lr");
  EXPECT_EQ(list.values, (std::vector<std::string>{"1e-3", "0.01"}));
  SweepAxis wd = parse_sweep_axis("weight_decay=range:0:0.1:5");  // '_' for '-' as in TOML keys
  EXPECT_EQ(wd.name, "weight-decay");
  EXPECT_TRUE(wd.values.empty());
  EXPECT_EQ(wd.min, 0.0);
  EXPECT_EQ(wd.max, 0.1);
  EXPECT_EQ(wd.points, 5);
  EXPECT_FALSE(wd.log);
  SweepAxis lr = parse_sweep_axis("lr=log:1e-4:1e-1");
  EXPECT_TRUE(lr.log);
  EXPECT_EQ(lr.points, 0);
  EXPECT_FALSE(lr.discrete());
  SweepAxis hidden = parse_sweep_axis("hidden=64/128/64,64");
  EXPECT_EQ(hidden.values, (std::vector<std::string>{"64", "128", "64,64"}));
}

TEST(SweepSpace, BadAxesAreErrorsNamingThem) {
  EXPECT_NE(error_of([] { parse_sweep_axis("lrate=1,2"); }).find("'lrate' is not a dtrain train option"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_sweep_axis("lr="); }).find("no values"), std::string::npos);
  EXPECT_NE(error_of([] { parse_sweep_axis("lr=0.1,,0.2"); }).find("an empty value"), std::string::npos);
  EXPECT_NE(error_of([] { parse_sweep_axis("lr"); }).find("expected NAME=V1,V2"), std::string::npos);
  EXPECT_NE(error_of([] { parse_sweep_axis("lr=range:0.1:0.01"); }).find("is empty"), std::string::npos);
  EXPECT_NE(error_of([] { parse_sweep_axis("lr=range:0.1:0.1"); }).find("is empty"), std::string::npos);
  EXPECT_NE(error_of([] { parse_sweep_axis("lr=log:0:1"); }).find("a log range needs MIN > 0"), std::string::npos);
  EXPECT_NE(error_of([] { parse_sweep_axis("lr=range:x:1"); }).find("'x' is not a finite number"), std::string::npos);
  EXPECT_NE(error_of([] { parse_sweep_axis("lr=range:0:1:1"); }).find("expected at least 2"), std::string::npos);
  EXPECT_NE(error_of([] { parse_sweep_axis("model=range:1:2"); }).find("a range needs a numeric option"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_sweep_axis("batch-size=range:1.5:8"); }).find("takes integers"), std::string::npos);
}

TEST(SweepSpace, ReadsTomlAndFlagsWin) {
  char tmpl[] = "/tmp/dtrain-sweep-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string file = std::string(tmpl) + "/s.toml";
  std::ofstream(file) << "strategy = \"random\"\ntrials = 5\nseed = 7\n"
                         "[space]\nlr = { min = 1e-4, max = 1e-1, log = true }\nweight_decay = [0, 1e-4]\n"
                         "hidden = [[16], [16, 16]]\n"
                         "[train]\nmodel = \"mlp\"\nsteps = 3\nbatch_size = 16\n";
  SweepSpec s;
  read_sweep_file(file, s, {"seed"});  // --seed was given as a flag
  EXPECT_EQ(s.strategy, SweepStrategy::random);
  EXPECT_EQ(s.trials, 5);
  EXPECT_EQ(s.seed, 0u);
  ASSERT_EQ(s.space.size(), 3u);
  EXPECT_EQ(s.space[0].name, "lr");
  EXPECT_TRUE(s.space[0].log);
  EXPECT_EQ(s.space[0].min, 1e-4);
  EXPECT_EQ(s.space[1].name, "weight-decay");
  EXPECT_EQ(s.space[1].values, (std::vector<std::string>{"0", "0.0001"}));
  EXPECT_EQ(s.space[2].values, (std::vector<std::string>{"16", "16,16"}));
  EXPECT_EQ(s.train, (OptionValues{{"model", "mlp"}, {"steps", "3"}, {"batch-size", "16"}}));
  // Flags after -- win over [train].
  s.train = merge_options(s.train, parse_train_flags({"--steps", "9", "--lr=0.5"}));
  EXPECT_EQ(s.train, (OptionValues{{"model", "mlp"}, {"steps", "9"}, {"batch-size", "16"}, {"lr", "0.5"}}));

  std::ofstream(file) << "strategy = \"grid\"\nwidth_of_grid = 3\n";
  EXPECT_NE(error_of([&] { read_sweep_file(file, s, {}); }).find("key 'width_of_grid': unknown key"),
            std::string::npos);
  std::ofstream(file) << "[space]\nlr = { min = 1, maximum = 2 }\n";
  EXPECT_NE(error_of([&] { read_sweep_file(file, s, {}); }).find("unknown key 'maximum'"), std::string::npos);
  std::ofstream(file) << "[space]\nlearning_rate = [1, 2]\n";
  EXPECT_NE(error_of([&] { read_sweep_file(file, s, {}); }).find("'learning-rate' is not a dtrain train option"),
            std::string::npos);
  std::ofstream(file) << "[space]\nlr = []\n";
  EXPECT_NE(error_of([&] { read_sweep_file(file, s, {}); }).find("an empty list"), std::string::npos);
  std::ofstream(file) << "[train]\nlr = \"fast\"\n";
  EXPECT_NE(error_of([&] { read_sweep_file(file, s, {}); }).find("--lr"), std::string::npos);
  std::filesystem::remove_all(tmpl);
}

TEST(SweepTrials, GridIsEveryPointInOrderWithCanonicalValues) {
  SweepPlan p = plan_sweep(grid_spec({"lr=1e-3,1e-2", "weight-decay=range:0:0.1:3"}));
  ASSERT_EQ(p.trials.size(), 6u);
  EXPECT_EQ(p.rungs, (std::vector<int64_t>{0}));
  EXPECT_EQ(p.spec.metric, "test_accuracy");  // the MLP's
  EXPECT_EQ(p.spec.mode, "max");
  EXPECT_TRUE(p.maximize);
  // The last axis varies fastest; values as dtrain train gives them back.
  EXPECT_EQ(p.trials[0].params, (OptionValues{{"lr", "0.001"}, {"weight-decay", "0"}}));
  EXPECT_EQ(p.trials[1].params, (OptionValues{{"lr", "0.001"}, {"weight-decay", "0.05"}}));
  EXPECT_EQ(p.trials[5].params, (OptionValues{{"lr", "0.01"}, {"weight-decay", "0.1"}}));
  EXPECT_EQ(trial_flags(p, p.trials[5], 0),
            (std::vector<std::string>{"--hidden=8", "--steps=4", "--lr=0.01", "--weight-decay=0.1"}));
  EXPECT_EQ(trial_command(p, p.trials[5]), "dtrain train --hidden 8 --steps 4 --lr 0.01 --weight-decay 0.1");
  EXPECT_EQ(trial_checkpoint_every(p, p.trials[0]), 1);  // a quarter of --steps 4

  SweepPlan logs = plan_sweep(grid_spec({"lr=log:1e-4:1e-1:4", "batch-size=log:16:256:5"}));
  std::set<std::string> lrs, batches;
  for (const auto& t : logs.trials) {
    lrs.insert(value(t, "lr"));
    batches.insert(value(t, "batch-size"));
  }
  EXPECT_EQ(lrs, (std::set<std::string>{"0.0001", "0.001", "0.01", "0.1"}));
  EXPECT_EQ(batches, (std::set<std::string>{"16", "32", "64", "128", "256"}));
}

TEST(SweepTrials, RandomIsSeededAndDistinctOnADiscreteSpace) {
  SweepSpec s = grid_spec({"lr=1e-4,1e-3,1e-2,1e-1", "weight-decay=0,1e-4,1e-3,1e-2"});
  s.strategy = SweepStrategy::random;
  const SweepPlan all = plan_sweep(s);
  ASSERT_EQ(all.trials.size(), 16u);  // --trials defaults to every point
  std::set<OptionValues> seen;
  for (const auto& t : all.trials) seen.insert(t.params);
  EXPECT_EQ(seen.size(), 16u);  // each point once
  s.trials = 5;
  const SweepPlan a = plan_sweep(s), b = plan_sweep(s);
  ASSERT_EQ(a.trials.size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(a.trials[i].params, b.trials[i].params);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(a.trials[i].params, all.trials[i].params);  // a prefix of the order
  s.seed = 1;
  const SweepPlan c = plan_sweep(s);
  bool differs = false;
  for (size_t i = 0; i < 5; ++i) differs = differs || c.trials[i].params != a.trials[i].params;
  EXPECT_TRUE(differs);
  s.trials = 17;
  EXPECT_NE(error_of([&] { plan_sweep(s); }).find("--trials 17 is more than the 16 points"), std::string::npos);
}

TEST(SweepTrials, RandomSamplesContinuousRangesInsideThem) {
  SweepSpec s = grid_spec({"lr=log:1e-4:1e-1", "warmup=range:0:10", "dropout=0,0.1"}, {"--model=gpt", "--steps=4"});
  s.strategy = SweepStrategy::random;
  EXPECT_NE(error_of([&] { plan_sweep(s); }).find("needs --trials N"), std::string::npos);
  s.trials = 200;
  const SweepPlan p = plan_sweep(s);
  EXPECT_EQ(p.spec.metric, "val_loss");  // the GPT's
  EXPECT_FALSE(p.maximize);
  double lo = 1, hi = 0;
  std::set<std::string> warmups;
  int small = 0;
  for (const auto& t : p.trials) {
    const double lr = std::stod(value(t, "lr"));
    lo = std::min(lo, lr);
    hi = std::max(hi, lr);
    small += lr < 1e-2 ? 1 : 0;
    warmups.insert(value(t, "warmup"));
    EXPECT_EQ(value(t, "warmup").find('.'), std::string::npos);  // an integer option: integers
  }
  EXPECT_GE(lo, 1e-4);
  EXPECT_LE(hi, 1e-1);
  EXPECT_GT(small, 100);           // log-uniform: two thirds of the decades lie below 1e-2
  EXPECT_EQ(warmups.size(), 11u);  // every integer of [0, 10] drawn
  // Trial t's values depend on the seed and t only.
  s.trials = 3;
  const SweepPlan q = plan_sweep(s);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(q.trials[i].params, p.trials[i].params);
}

TEST(SweepPlanChecks, BadInputIsRefusedBeforeAnyTrial) {
  EXPECT_NE(error_of([] { plan_sweep(SweepSpec{}); }).find("the search space is empty"), std::string::npos);
  EXPECT_NE(error_of([] { plan_sweep(grid_spec({"lr=1e-3,0.001"})); }).find("the value 0.001 comes twice"),
            std::string::npos);
  EXPECT_NE(error_of([] { plan_sweep(grid_spec({"lr=0.1,fast"})); }).find("value 'fast'"), std::string::npos);
  EXPECT_NE(error_of([] { plan_sweep(grid_spec({"lr=0.1"}, {"--metrics=m.jsonl"})); }).find("set by the sweep"),
            std::string::npos);
  EXPECT_NE(error_of([] { plan_sweep(grid_spec({"checkpoint-dir=a,b"})); }).find("set by the sweep"),
            std::string::npos);
  EXPECT_NE(error_of([] { plan_sweep(grid_spec({"lr=0.1,0.2"}, {"--lr=0.1"})); }).find("both an axis and a fixed"),
            std::string::npos);
  // dtrain train's own checks, for each trial, naming it.
  const std::string batch = error_of([] { plan_sweep(grid_spec({"batch-size=8,7"}, {"--dp=2", "--steps=4"})); });
  EXPECT_NE(batch.find("trial 1 (batch-size=7)"), std::string::npos) << batch;
  EXPECT_NE(batch.find("--batch-size 7 is not divisible by --dp 2"), std::string::npos) << batch;
  EXPECT_NE(error_of([] { plan_sweep(grid_spec({"lr=-1,0.1"})); }).find("--lr must be non-negative"),
            std::string::npos);
  // A metric no trial reports.
  SweepSpec s = grid_spec({"lr=0.1,0.2"});
  s.metric = "val_loss";
  EXPECT_NE(error_of([&] { plan_sweep(s); }).find("trains --model mlp, whose final metrics record has test_accuracy"),
            std::string::npos);
  s.metric = "accuracy";
  EXPECT_NE(error_of([&] { plan_sweep(s); }).find("--metric 'accuracy': no trial reports it"), std::string::npos);
  s.metric = "";
  s.mode = "up";
  EXPECT_NE(error_of([&] { plan_sweep(s); }).find("--mode 'up'"), std::string::npos);
  s.mode = "";
  s.trials = 3;
  EXPECT_NE(error_of([&] { plan_sweep(s); }).find("grid runs every one of the 2 points"), std::string::npos);
  s.trials = -1;
  EXPECT_NE(error_of([&] { plan_sweep(s); }).find("expected non-negative numbers"), std::string::npos);
  s.trials = 0;
  SweepSpec cont = grid_spec({"lr=log:1e-4:1e-1"});
  EXPECT_NE(error_of([&] { plan_sweep(cont); }).find("grid needs a value list"), std::string::npos);
}

TEST(SweepAsha, RungsAndChecks) {
  EXPECT_EQ(asha_rungs(50, 800, 2), (std::vector<int64_t>{50, 100, 200, 400, 800}));
  EXPECT_EQ(asha_rungs(10, 100, 3), (std::vector<int64_t>{10, 30, 90, 100}));
  EXPECT_EQ(asha_rungs(5, 5, 3), (std::vector<int64_t>{5}));
  SweepSpec s = grid_spec({"lr=1e-3,1e-2"}, {"--hidden=8"});
  s.strategy = SweepStrategy::asha;
  EXPECT_NE(error_of([&] { plan_sweep(s); }).find("asha needs a step budget"), std::string::npos);
  s.train = parse_train_flags({"--hidden=8", "--steps=270"});
  const SweepPlan p = plan_sweep(s);
  EXPECT_EQ(p.rungs, (std::vector<int64_t>{10, 30, 90, 270}));  // min = max / eta^3
  EXPECT_EQ(p.spec.max_steps, 270);
  EXPECT_EQ(p.spec.checkpoint_every, 10);  // every rung ends on a checkpoint
  EXPECT_EQ(trial_flags(p, p.trials[0], 30).back(), "--steps=30");
  s.train = parse_train_flags({"--hidden=8", "--steps=800"});  // 800 / 27 = 29: the divisor 25 instead
  EXPECT_EQ(plan_sweep(s).rungs, (std::vector<int64_t>{25, 75, 225, 675, 800}));
  EXPECT_EQ(plan_sweep(s).spec.checkpoint_every, 25);
  s.train = parse_train_flags({"--hidden=8", "--steps=270"});
  EXPECT_NE(trial_command(p, p.trials[0]).find("--steps 270"), std::string::npos);
  s.checkpoint_every = 4;
  EXPECT_NE(error_of([&] { plan_sweep(s); }).find("--checkpoint-every 4 must divide every rung's budget"),
            std::string::npos);
  s.checkpoint_every = 0;
  s.train = parse_train_flags({"--hidden=8", "--steps=270", "--lr-schedule=cosine"});
  EXPECT_NE(error_of([&] { plan_sweep(s); }).find("--lr-schedule cosine"), std::string::npos);
  s.train = parse_train_flags({"--hidden=8", "--epochs=2"});
  EXPECT_NE(error_of([&] { plan_sweep(s); }).find("--epochs cannot be a train option"), std::string::npos);
  s.train = parse_train_flags({"--hidden=8"});
  s.space.push_back(parse_sweep_axis("steps=10,20"));
  EXPECT_NE(error_of([&] { plan_sweep(s); }).find("asha sets each trial's --steps"), std::string::npos);
}

RungOutcome done(double metric, int64_t steps = 0) { return {State::done, metric, steps, 0.0}; }

TEST(SweepAsha, PromotesTheBestOfEachPrefix) {
  // 4 trials, 2 rungs, eta 2, maximize.
  std::vector<std::vector<RungOutcome>> o(4, std::vector<RungOutcome>(2));
  SweepLadder l = successive_halving(o, 2, true);
  EXPECT_EQ(l.rungs[0], (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_TRUE(l.rungs[1].empty());
  EXPECT_FALSE(l.finished);
  EXPECT_EQ(pending_jobs(l, o), (std::vector<SweepJob>{{0, 0}, {1, 0}, {2, 0}, {3, 0}}));
  // Trial 1 finished first: nothing is decided while trial 0 is pending (ladder order, not timing).
  o[1][0] = done(0.4);
  EXPECT_TRUE(successive_halving(o, 2, true).rungs[1].empty());
  o[0][0] = done(0.1);  // prefix {0, 1}: the best 1 goes on
  l = successive_halving(o, 2, true);
  EXPECT_EQ(l.rungs[1], (std::vector<int64_t>{1}));
  EXPECT_EQ(pending_jobs(l, o), (std::vector<SweepJob>{{1, 1}, {2, 0}, {3, 0}}));  // the higher rung first
  o[3][0] = done(0.9);  // after a pending trial 2: not counted yet
  EXPECT_EQ(successive_halving(o, 2, true).rungs[1], (std::vector<int64_t>{1}));
  o[2][0] = done(0.3);  // prefix of 4: the best 2 are 3 and 1; 3 is new
  l = successive_halving(o, 2, true);
  EXPECT_EQ(l.rungs[1], (std::vector<int64_t>{1, 3}));
  o[1][1] = done(0.5);
  o[3][1] = done(0.95);
  l = successive_halving(o, 2, true);
  EXPECT_TRUE(l.finished);
  EXPECT_TRUE(pending_jobs(l, o).empty());
  // Minimizing reverses the ranking; failed trials are never promoted.
  // Prefix {0, 1} promotes 1; prefix {0, 1, 2} still has a quota of 1, its best is 2 (ASHA goes on
  // with both: a promotion is never taken back).
  std::vector<std::vector<RungOutcome>> m(3, std::vector<RungOutcome>(2));
  m[0][0] = done(3.0);
  m[1][0] = done(2.0);
  m[2][0] = done(1.0);
  EXPECT_EQ(successive_halving(m, 2, false).rungs[1], (std::vector<int64_t>{1, 2}));
  m.resize(2);
  m[0][0] = {State::failed, 0.0, 0, 0.0};  // its 0.0 would be the best loss
  EXPECT_EQ(successive_halving(m, 2, false).rungs[1], (std::vector<int64_t>{1}));
  // Ties go to the lower index.
  std::vector<std::vector<RungOutcome>> t(2, std::vector<RungOutcome>(2));
  t[0][0] = done(1.0);
  t[1][0] = done(1.0);
  EXPECT_EQ(successive_halving(t, 2, true).rungs[1], (std::vector<int64_t>{0}));
}

// Synthetic trials: a quality q per trial; the metric at rung k is q plus noise that shrinks with
// the budget. Outcomes arrive in a random order; the decisions must not depend on it, must only
// grow, and must spend well under the grid's budget while finding a trial near the best.
TEST(SweepAsha, DecisionsDoNotDependOnArrivalOrderAndSaveSteps) {
  const std::vector<int64_t> rungs = asha_rungs(50, 800, 2);
  const size_t n = 16, k_max = rungs.size();
  uint64_t state = 12345;
  auto unit = [&] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<double>(state >> 11) * 0x1.0p-53;
  };
  std::vector<double> quality(n);
  for (auto& q : quality) q = 0.7 + 0.2 * unit();
  std::vector<std::vector<double>> metric(n, std::vector<double>(k_max));
  for (size_t t = 0; t < n; ++t) {
    for (size_t k = 0; k < k_max; ++k) metric[t][k] = quality[t] - 0.05 * (unit() - 0.5) / static_cast<double>(k + 1);
  }
  auto run = [&](uint64_t seed, std::vector<std::vector<int64_t>>* ladder) {
    std::vector<std::vector<RungOutcome>> o(n, std::vector<RungOutcome>(k_max));
    uint64_t s = seed;
    std::vector<std::vector<int64_t>> previous(k_max);
    for (;;) {
      const SweepLadder l = successive_halving(o, 2, true);
      for (size_t k = 0; k < k_max; ++k) {  // promotions are never taken back
        EXPECT_TRUE(std::equal(previous[k].begin(), previous[k].end(), l.rungs[k].begin()));
        previous[k] = l.rungs[k];
      }
      const std::vector<SweepJob> jobs = pending_jobs(l, o);
      if (jobs.empty()) {
        EXPECT_TRUE(l.finished);
        break;
      }
      // Any of the first few pending jobs finishes next, as with several trials at once.
      s = s * 6364136223846793005ULL + 1442695040888963407ULL;
      const SweepJob j = jobs[(s >> 33) % std::min<size_t>(jobs.size(), 4)];
      o[static_cast<size_t>(j.trial)][static_cast<size_t>(j.rung)] =
          done(metric[static_cast<size_t>(j.trial)][static_cast<size_t>(j.rung)], rungs[static_cast<size_t>(j.rung)]);
    }
    *ladder = previous;
    int64_t steps = 0;
    for (size_t t = 0; t < n; ++t) {
      for (size_t k = 0; k < k_max; ++k) {
        if (o[t][k].state == State::done) steps = steps - (k > 0 ? rungs[k - 1] : 0) + rungs[k];
      }
    }
    return steps;
  };
  std::vector<std::vector<int64_t>> first, second;
  const int64_t steps = run(1, &first);
  EXPECT_EQ(run(99, &second), steps);
  EXPECT_EQ(first, second);
  const int64_t grid = static_cast<int64_t>(n) * rungs.back();
  EXPECT_LT(steps, grid * 4 / 10) << steps << " of " << grid;
  ASSERT_FALSE(first.back().empty());
  const double best = *std::max_element(quality.begin(), quality.end());
  double found = 0.0;
  for (int64_t t : first.back()) found = std::max(found, quality[static_cast<size_t>(t)]);
  EXPECT_GT(found, best - 0.02);
}

TEST(SweepRecords, RoundTripAndRefuseAnotherSearch) {
  SweepSpec s = grid_spec({"lr=1e-3,1e-2"}, {"--hidden=8", "--steps=40"});
  s.strategy = SweepStrategy::asha;
  s.eta = 2;
  s.min_steps = 10;
  const SweepPlan p = plan_sweep(s);
  ASSERT_EQ(p.rungs, (std::vector<int64_t>{10, 20, 40}));
  TrialRecord r;
  r.trial = 1;
  r.rungs = {done(0.8125, 10), {State::failed, 0.0, 0, 1.5}, {}};
  r.error = "exit code 2: dtrain: error: [train] loss is nan";
  r.running = 2;
  const nlohmann::json j = trial_record_json(p, r);
  const TrialRecord back = trial_record_from_json(p, nlohmann::json::parse(j.dump()), "status.json");
  EXPECT_EQ(back.trial, 1);
  EXPECT_EQ(back.rungs[0].state, State::done);
  EXPECT_EQ(back.rungs[0].metric, 0.8125);
  EXPECT_EQ(back.rungs[0].steps, 10);
  EXPECT_EQ(back.rungs[1].state, State::failed);
  EXPECT_EQ(back.rungs[2].state, State::pending);
  EXPECT_EQ(back.running, 2);
  EXPECT_EQ(back.error, r.error);
  nlohmann::json other = j;
  other["params"][0][1] = "0.5";
  EXPECT_NE(error_of([&] { trial_record_from_json(p, other, "status.json"); }).find("has other values"),
            std::string::npos);

  const nlohmann::json spec = sweep_spec_json(p.spec);
  EXPECT_EQ(sweep_spec_json(sweep_spec_from_json(nlohmann::json::parse(spec.dump()))), spec);
  EXPECT_EQ(sweep_spec_json(plan_sweep(sweep_spec_from_json(spec)).spec), spec);  // a stored search plans alike
  SweepSpec changed = p.spec;
  changed.seed = 5;
  const std::vector<std::string> diff = sweep_differences(spec, sweep_spec_json(changed));
  ASSERT_EQ(diff.size(), 1u);
  EXPECT_EQ(diff[0], "seed: 0 vs 5");
}

TEST(SweepResults, SortedByRungThenMetricFailedLast) {
  SweepSpec s = grid_spec({"lr=0.1,0.2,0.3,0.4"}, {"--hidden=8", "--steps=20"});
  s.strategy = SweepStrategy::asha;
  s.eta = 2;
  s.min_steps = 10;
  const SweepPlan p = plan_sweep(s);
  std::vector<TrialRecord> records(4);
  for (int64_t t = 0; t < 4; ++t) {
    records[static_cast<size_t>(t)].trial = t;
    records[static_cast<size_t>(t)].rungs.assign(2, RungOutcome{});
  }
  records[0].rungs[0] = done(0.9, 10);  // best at rung 0 but stopped there
  records[1].rungs[0] = done(0.5, 10);
  records[1].rungs[1] = done(0.6, 20);
  records[2].rungs[0] = {State::failed, 0.0, 0, 0.0};
  records[2].error = "exit code 2: diverged";
  records[3].rungs[0] = done(0.7, 10);
  records[3].rungs[1] = done(0.8, 20);
  const std::vector<nlohmann::json> res = sweep_results(p, records);
  ASSERT_EQ(res.size(), 4u);
  EXPECT_EQ(res[0]["trial"], 3);
  EXPECT_EQ(res[0]["status"], "done");
  EXPECT_EQ(res[0]["value"], 0.8);
  EXPECT_EQ(res[0]["steps"], 20);
  EXPECT_EQ(res[1]["trial"], 1);
  EXPECT_EQ(res[2]["trial"], 0);
  EXPECT_EQ(res[2]["status"], "stopped");
  EXPECT_EQ(res[3]["trial"], 2);
  EXPECT_EQ(res[3]["status"], "failed");
  EXPECT_EQ(res[3]["error"], "exit code 2: diverged");
  EXPECT_EQ(sweep_total_steps(records), 10 + 20 + 0 + 20);
  const std::string table = sweep_table(p, res);
  EXPECT_NE(table.find("rank  trial  lr   test_accuracy  steps  time_s  status"), std::string::npos) << table;
  // asha takes the points of a discrete space in a seeded order: trial 3 is one of them.
  EXPECT_NE(table.find("best: trial 3, test_accuracy 0.8 after 20 steps\n  dtrain train --hidden 8 --lr " +
                       value(p.trials[3], "lr") + " --steps 20"),
            std::string::npos)
      << table;
}

}  // namespace
}  // namespace dtrain::train
