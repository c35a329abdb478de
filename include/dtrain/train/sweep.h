// dtrain sweep: a hyperparameter search over `dtrain train` options. This header holds the parts
// that start no process: the search (space, strategy, metric) read from TOML and flags and checked
// against the train option table before any trial starts, the trials it generates, the decisions
// of successive halving on recorded results, and the sweep directory's records and results. The
// command that runs trials as `dtrain train` processes is tools/dtrain/sweep_command.cpp.
//
// Vocabulary: a *trial* is one configuration (an index and one value per axis). A *rung* is a step
// budget: grid and random have one rung (the trial's own --steps or --epochs), asha has several
// (min_steps x eta^k, up to max_steps). A *job* trains one trial to one rung, continuing from the
// checkpoint its previous rung left. A trial's *outcome* at a rung is its metric there, or failed.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::train {

/// Options as (name, flag text) pairs: `--NAME=TEXT` for `dtrain train`.
using OptionValues = std::vector<std::pair<std::string, std::string>>;

/// One axis of the space: a `dtrain train` option and the values it takes.
struct SweepAxis {
  std::string name;                 // the option as a flag without dashes: "weight-decay"
  std::vector<std::string> values;  // a list of values (flag text each); empty for a range
  double min = 0.0, max = 0.0;      // a range [min, max], sampled uniformly, or log-uniformly (log)
  bool log = false;
  int64_t points = 0;    // > 0: the range is that many evenly (log: geometrically) spaced values, ends included
  bool integer = false;  // the option takes integers: a range's values are rounded (set by plan_sweep)
  bool discrete() const { return !values.empty() || points > 0; }
};

enum class SweepStrategy { grid, random, asha };

/// The search: what decides which trials run and how they are judged. Two sweeps whose specs
/// give the same JSON (sweep_spec_json) are the same search.
struct SweepSpec {
  SweepStrategy strategy = SweepStrategy::grid;
  std::vector<SweepAxis> space;
  OptionValues train;     // options every trial gets, in the train option table's order
  int64_t trials = 0;     // random, asha: how many (0: every point of a discrete space)
  uint64_t seed = 0;      // the sampling seed (the trials' own --seed is an option like any other)
  std::string metric;     // a figure of the trials' final metrics record; empty: the model's
  std::string mode;       // min | max; empty: the metric's own direction
  int64_t min_steps = 0;  // asha: the first rung's budget (0: the largest divisor of max_steps up to max_steps / eta^3)
  int64_t max_steps = 0;  // asha: the last rung's budget (0: the train options' --steps)
  int64_t eta = 3;        // asha: the best 1/eta of a rung's trials go on to the next rung
  int64_t checkpoint_every = 0;  // steps between a trial's checkpoints (0: asha the rungs' common
                                 // divisor; grid, random a quarter of the trial's --steps)
};

/// One configuration to train.
struct SweepTrial {
  int64_t index = 0;
  OptionValues params;  // one value per axis, in the space's order
};

/// A search checked and expanded: defaults filled, every trial generated, rungs fixed.
struct SweepPlan {
  SweepSpec spec;
  std::vector<SweepTrial> trials;
  std::vector<int64_t> rungs;  // asha: each rung's --steps; grid, random: {0} (the trial's own length)
  bool maximize = false;
};

/// `NAME=SPEC` of --param: `NAME=V1,V2,...` a list (for an option that takes a list, such as
/// --hidden, the values are separated by '/': `hidden=64/128/64,64`), `NAME=range:MIN:MAX[:N]`
/// uniform, `NAME=log:MIN:MAX[:N]` log-uniform (N: that many evenly spaced points instead).
SweepAxis parse_sweep_axis(const std::string& text);

/// Reads a sweep's TOML file into `spec`: top-level keys strategy, trials, seed, metric, mode,
/// min_steps, max_steps, eta, checkpoint_every (each unless its name is in `given`: a flag set
/// it), a [space] table (NAME = [values...] or NAME = {min, max, log, points}) whose axes replace
/// those of the same name, and a [train] table of `dtrain train` options (keys as in its config
/// files) that replaces spec.train. Unknown keys and wrong types are errors naming file and key.
void read_sweep_file(const std::string& path, SweepSpec& spec, const std::set<std::string>& given);

/// `dtrain train` flags (the words after `--`, including a --config FILE of train options) as
/// option values, parsed and checked by train's own option table.
OptionValues parse_train_flags(const std::vector<std::string>& args);
/// `over` wins: options of `base` that `over` sets too are replaced. Table order.
OptionValues merge_options(const OptionValues& base, const OptionValues& over);

/// Checks the whole search before any trial starts and expands it: axis names are train options
/// (not those the sweep sets itself), values fit the option, ranges are not empty, every trial's
/// options pass `dtrain train`'s own checks, the metric is one every trial reports, asha has a
/// step budget. Throws dtrain::Error ([sweep]) naming the input and what was expected.
SweepPlan plan_sweep(SweepSpec spec);

/// The `dtrain train` flags of a trial: the fixed options, then the trial's values, then (steps
/// > 0) --steps=STEPS in place of any fixed one. What the sweep adds to run it (metrics file,
/// checkpoints, threads) is not in it.
std::vector<std::string> trial_flags(const SweepPlan& plan, const SweepTrial& trial, int64_t steps);
/// The command that reproduces a trial's last rung: `dtrain train --lr 0.001 ...`, shell quoted.
std::string trial_command(const SweepPlan& plan, const SweepTrial& trial);
/// Steps between a trial's checkpoints (0: none), and so between its log records.
int64_t trial_checkpoint_every(const SweepPlan& plan, const SweepTrial& trial);

/// asha's rung budgets: min, min x eta, min x eta^2, ... while below max, then max.
std::vector<int64_t> asha_rungs(int64_t min_steps, int64_t max_steps, int64_t eta);

/// What a trial did at one rung.
struct RungOutcome {
  enum class State { pending, done, failed };
  State state = State::pending;
  double metric = 0.0;
  int64_t steps = 0;    // the trial's steps when it ended this rung (its final record's)
  double time_s = 0.0;  // wall time of the job
};

/// Successive halving's decisions on the outcomes so far: ladder[k] are the trials that go to
/// rung k, in the order they were promoted (ladder[0]: every trial in index order).
///
/// ASHA promotes a trial from rung k as soon as it is in the best floor(m / eta) of the m results
/// rung k has so far. Taken in the order jobs finish, that depends on timing; here the results of
/// rung k are taken in ladder order: its first m entries count once all m have an outcome. The
/// decisions then depend only on the trials' metrics, not on --parallel or on when a process ended,
/// and a resumed sweep makes the same ones. Failed trials are never promoted. Ties: lower index.
struct SweepLadder {
  std::vector<std::vector<int64_t>> rungs;
  bool finished = false;  // every trial on the ladder has its outcome at its rung: nothing to run
};
/// `outcomes[t][k]`: trial t at rung k (one row per trial, one column per rung).
SweepLadder successive_halving(const std::vector<std::vector<RungOutcome>>& outcomes, int64_t eta, bool maximize);

/// A job: train `trial` to rung `rung`.
struct SweepJob {
  int64_t trial = 0;
  int64_t rung = 0;
  bool operator==(const SweepJob&) const = default;
};
/// The jobs the ladder wants whose outcome is pending, highest rung first, then ladder order.
std::vector<SweepJob> pending_jobs(const SweepLadder& ladder, const std::vector<std::vector<RungOutcome>>& outcomes);

/// A trial's record in the sweep directory (trial-NNNN/status.json).
struct TrialRecord {
  int64_t trial = 0;
  std::vector<RungOutcome> rungs;  // one per rung of the plan
  int64_t running = -1;            // the rung of a job started and not ended (a sweep killed meanwhile)
  std::string error;               // why it failed
};
nlohmann::json trial_record_json(const SweepPlan& plan, const TrialRecord& record);
/// Reads a record written by trial_record_json for `plan`; throws naming `where` when it is not one.
TrialRecord trial_record_from_json(const SweepPlan& plan, const nlohmann::json& j, const std::string& where);

/// The manifest's "search": the spec as JSON (the search's identity), and back.
nlohmann::json sweep_spec_json(const SweepSpec& spec);
SweepSpec sweep_spec_from_json(const nlohmann::json& j);
/// What differs between two searches' JSON, one "KEY: A vs B" per key; empty when the same.
std::vector<std::string> sweep_differences(const nlohmann::json& a, const nlohmann::json& b);

/// The results, best first: trials that reached a higher rung before the others, then by the
/// metric at their last rung, failed trials last; one JSON object per trial (rank, trial, params,
/// metric, value, steps, rung, status, time_s, error, command).
std::vector<nlohmann::json> sweep_results(const SweepPlan& plan, const std::vector<TrialRecord>& records);
/// The results as a table, and the best trial's `dtrain train` command under it.
std::string sweep_table(const SweepPlan& plan, const std::vector<nlohmann::json>& results);
/// Steps trained over every trial (each rung's budget once: what the search cost).
int64_t sweep_total_steps(const std::vector<TrialRecord>& records);

const char* strategy_name(SweepStrategy s);
/// grid | random | asha; `where` names the input in the error.
SweepStrategy parse_strategy(const std::string& text, const std::string& where);

}  // namespace dtrain::train
