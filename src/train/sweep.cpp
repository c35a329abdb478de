#include "dtrain/train/sweep.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <numeric>

#include "dtrain/core/error.h"
#include "dtrain/train/config.h"

namespace dtrain::train {

namespace {

constexpr int64_t kMaxTrials = 100000;
constexpr const char* kSpecFormat = "dtrain-sweep";
constexpr const char* kTrialFormat = "dtrain-sweep-trial";
constexpr int kVersion = 1;

// Options the sweep sets for every trial itself: its files live in the sweep directory.
const std::set<std::string>& reserved_options() {
  static const std::set<std::string> names{"metrics", "checkpoint-dir", "checkpoint-every", "keep",
                                           "save",    "trace",          "progress"};
  return names;
}

std::string flag_name(std::string name) {
  for (char& c : name) {
    if (c == '_') c = '-';
  }
  return name;
}

const OptionInfo* find_option(const std::vector<OptionInfo>& options, const std::string& name) {
  for (const auto& o : options) {
    if (o.name == name) return &o;
  }
  return nullptr;
}

const OptionInfo& known_option(const std::string& name, const std::string& where) {
  static const std::vector<OptionInfo> options = train_options();
  const OptionInfo* o = find_option(options, name);
  DT_CHECK(o != nullptr, "sweep", "{}: '{}' is not a dtrain train option (see dtrain train --help)", where, name);
  return *o;
}

const char* kind_name(OptionKind k) {
  switch (k) {
    case OptionKind::text:
      return "text";
    case OptionKind::integer:
      return "an integer";
    case OptionKind::number:
      return "a number";
    case OptionKind::boolean:
      return "true or false";
    case OptionKind::integer_list:
      return "a list of integers";
  }
  return "?";
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t at = s.find(sep, start);
    out.push_back(s.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (at == std::string::npos) return out;
    start = at + 1;
  }
}

double parse_number(const std::string& text, const std::string& where) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  DT_CHECK(!text.empty() && *end == '\0' && std::isfinite(v), "sweep", "{}: '{}' is not a finite number", where, text);
  return v;
}

int64_t parse_count(const std::string& text, const std::string& where) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  DT_CHECK(!text.empty() && *end == '\0' && v >= 0, "sweep", "{}: '{}' is not a non-negative integer", where, text);
  return v;
}

// A dtrain train command line parsed by train's own option table (and its --config file).
TrainConfig parse_train(const std::vector<std::string>& flags, const std::string& where) {
  TrainConfig cfg;
  CLI::App app;
  add_train_options(app, cfg);
  std::vector<std::string> reversed(flags.rbegin(), flags.rend());  // CLI11 takes them last first
  try {
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    DT_THROW("sweep", "{}: {}", where, e.what());
  }
  try {
    apply_config_file(app, cfg);
  } catch (const Error& e) {
    DT_THROW("sweep", "{}: {}", where, e.message());
  }
  return cfg;
}

std::vector<std::string> as_flags(const OptionValues& values) {
  std::vector<std::string> out;
  for (const auto& [name, text] : values) out.push_back(fmt::format("--{}={}", name, text));
  return out;
}

// A value of an axis in the form `dtrain train` gives it back (so 1e-3 and 0.001 are one value),
// checked against the option's type with the fixed options around it.
std::string canonical_value(const OptionValues& train, const std::string& name, const std::string& text,
                            const std::string& where) {
  std::vector<std::string> mine;
  for (const auto& f : as_flags(train)) {
    if (!f.starts_with("--" + name + "=")) mine.push_back(f);
  }
  mine.push_back("--" + name + "=" + text);
  const TrainConfig cfg = parse_train(mine, fmt::format("{}: value '{}'", where, text));
  return option_text(cfg, name);
}

std::string range_text(double v, bool integer) {
  if (integer) return fmt::format("{}", std::llround(v));
  return fmt::format("{:.4g}", v);  // 4 significant digits: the table stays readable, the text is the value
}

// The axis' values: the list, or the range's points (canonical; duplicates are an error).
std::vector<std::string> axis_points(const SweepAxis& a, const OptionValues& train) {
  const std::string where = "--param " + a.name;
  std::vector<std::string> out;
  if (!a.values.empty()) {
    for (const auto& v : a.values) out.push_back(canonical_value(train, a.name, v, where));
  } else {
    for (int64_t i = 0; i < a.points; ++i) {
      const double t = static_cast<double>(i) / static_cast<double>(a.points - 1);
      double v =
          a.log ? std::exp(std::log(a.min) + t * (std::log(a.max) - std::log(a.min))) : a.min + t * (a.max - a.min);
      if (i == 0) v = a.min;
      if (i == a.points - 1) v = a.max;
      out.push_back(canonical_value(train, a.name, range_text(v, a.integer), where));
    }
  }
  for (size_t i = 0; i < out.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      DT_CHECK(out[i] != out[j], "sweep", "{}: the value {} comes twice{}", where, out[i],
               a.values.empty() ? " (the range has more points than distinct values of the option)" : "");
    }
  }
  return out;
}

// splitmix64: a small portable generator (the same trials on every platform and library).
uint64_t next_random(uint64_t& state) {
  state += 0x9e3779b97f4a7c15ULL;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

double random_unit(uint64_t& state) { return static_cast<double>(next_random(state) >> 11) * 0x1.0p-53; }

// The bias of the modulo is below n / 2^64: nothing next to the sampling itself.
uint64_t random_below(uint64_t& state, uint64_t n) { return next_random(state) % n; }

std::string sample_range(const SweepAxis& a, uint64_t& state) {
  const double u = random_unit(state);
  double v = 0.0;
  if (a.log) {
    const double lo = std::log(a.integer ? a.min - 0.5 : a.min);
    const double hi = std::log(a.integer ? a.max + 0.5 : a.max);
    v = std::exp(lo + u * (hi - lo));
  } else {
    v = a.integer ? std::floor(a.min + u * (a.max - a.min + 1.0)) : a.min + u * (a.max - a.min);
  }
  v = std::clamp(v, a.min, a.max);
  return range_text(v, a.integer);
}

std::string params_text(const OptionValues& params) {
  std::vector<std::string> parts;
  for (const auto& [name, value] : params) parts.push_back(fmt::format("{}={}", name, value));
  return fmt::format("{}", fmt::join(parts, " "));
}

struct MetricInfo {
  const char* name;
  bool maximize;
  bool mlp, gpt;  // reported by the model's final record
};

constexpr MetricInfo kMetrics[] = {
    {"test_accuracy", true, true, false}, {"val_loss", false, false, true},    {"train_loss", false, true, true},
    {"samples_per_s", true, true, true},  {"tokens_per_s", true, false, true},
};

std::string model_metrics(bool gpt) {
  std::vector<std::string> names;
  for (const auto& m : kMetrics) {
    if (gpt ? m.gpt : m.mlp) names.push_back(m.name);
  }
  return fmt::format("{}", fmt::join(names, ", "));
}

std::string shell_word(const std::string& s) {
  const bool plain = !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 || std::string("._,:/=+-@%").find(c) != std::string::npos;
  });
  if (plain) return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string toml_scalar_text(const toml::node& node, const std::string& where, bool list_option) {
  if (auto v = node.value_exact<std::string>()) return *v;
  if (auto v = node.value_exact<int64_t>()) return fmt::format("{}", *v);
  if (auto v = node.value_exact<double>()) return fmt::format("{}", *v);
  if (auto v = node.value_exact<bool>()) return *v ? "true" : "false";
  if (const toml::array* arr = node.as_array(); arr != nullptr && list_option) {
    std::vector<std::string> items;
    for (size_t i = 0; i < arr->size(); ++i) {
      auto v = arr->get(i)->value_exact<int64_t>();
      DT_CHECK(v.has_value(), "sweep", "{}[{}]: expected an integer", where, i);
      items.push_back(fmt::format("{}", *v));
    }
    DT_CHECK(!items.empty(), "sweep", "{}: an empty list", where);
    return fmt::format("{}", fmt::join(items, ","));
  }
  DT_THROW("sweep", "{}: expected {}", where, list_option ? "an array of integers" : "a string, number or boolean");
}

SweepAxis axis_from_toml(const std::string& key, const toml::node& node, const std::string& where) {
  SweepAxis a;
  a.name = flag_name(key);
  const OptionInfo& o = known_option(a.name, where);
  const bool list_option = o.kind == OptionKind::integer_list;
  if (const toml::array* arr = node.as_array()) {
    for (size_t i = 0; i < arr->size(); ++i) {
      a.values.push_back(toml_scalar_text(*arr->get(i), fmt::format("{}[{}]", where, i), list_option));
    }
    DT_CHECK(!a.values.empty(), "sweep", "{}: an empty list of values", where);
    return a;
  }
  const toml::table* t = node.as_table();
  DT_CHECK(t != nullptr, "sweep",
           "{}: expected a list of values [A, B, ...] or a range {{ min = A, max = B, log = true, points = N }}",
           where);
  bool has_min = false, has_max = false;
  for (const auto& [k, v] : *t) {
    const std::string field(k.str());
    const std::string at = fmt::format("{}.{}", where, field);
    if (field == "min" || field == "max") {
      std::optional<double> x = v.value_exact<int64_t>()
                                    ? std::optional<double>(static_cast<double>(*v.value_exact<int64_t>()))
                                    : v.value_exact<double>();
      DT_CHECK(x.has_value() && std::isfinite(*x), "sweep", "{}: expected a finite number", at);
      (field == "min" ? a.min : a.max) = *x;
      (field == "min" ? has_min : has_max) = true;
    } else if (field == "log") {
      auto x = v.value_exact<bool>();
      DT_CHECK(x.has_value(), "sweep", "{}: expected true or false", at);
      a.log = *x;
    } else if (field == "points") {
      auto x = v.value_exact<int64_t>();
      DT_CHECK(x.has_value() && *x >= 2, "sweep", "{}: expected an integer of at least 2", at);
      a.points = *x;
    } else {
      DT_THROW("sweep", "{}: unknown key '{}' (a range has min, max, log, points)", where, field);
    }
  }
  DT_CHECK(has_min && has_max, "sweep", "{}: a range needs both min and max", where);
  return a;
}

int64_t toml_count(const toml::node& node, const std::string& where) {
  auto v = node.value_exact<int64_t>();
  DT_CHECK(v.has_value() && *v >= 0, "sweep", "{}: expected a non-negative integer", where);
  return *v;
}

std::string toml_string(const toml::node& node, const std::string& where) {
  auto v = node.value_exact<std::string>();
  DT_CHECK(v.has_value(), "sweep", "{}: expected a string", where);
  return *v;
}

void check_range(const SweepAxis& a, const OptionInfo& o, const std::string& where) {
  DT_CHECK(o.kind == OptionKind::integer || o.kind == OptionKind::number, "sweep",
           "{}: a range needs a numeric option, and --{} takes {}: give a list of values", where, a.name,
           kind_name(o.kind));
  DT_CHECK(a.min < a.max, "sweep", "{}: the range [{}, {}] is empty (expected MIN < MAX; a list gives fixed values)",
           where, a.min, a.max);
  DT_CHECK(!a.log || a.min > 0.0, "sweep", "{}: a log range needs MIN > 0, got {}", where, a.min);
  if (o.kind == OptionKind::integer) {
    DT_CHECK(std::floor(a.min) == a.min && std::floor(a.max) == a.max && std::fabs(a.max) < 0x1.0p53 &&
                 std::fabs(a.min) < 0x1.0p53,
             "sweep", "{}: --{} takes integers, the range [{}, {}] does not end on them", where, a.name, a.min, a.max);
  }
  DT_CHECK(a.points == 0 || a.points >= 2, "sweep", "{}: a range of {} points (expected at least 2)", where, a.points);
}

}  // namespace

const char* strategy_name(SweepStrategy s) {
  switch (s) {
    case SweepStrategy::grid:
      return "grid";
    case SweepStrategy::random:
      return "random";
    case SweepStrategy::asha:
      return "asha";
  }
  return "?";
}

SweepStrategy parse_strategy(const std::string& text, const std::string& where) {
  if (text == "grid") return SweepStrategy::grid;
  if (text == "random") return SweepStrategy::random;
  if (text == "asha") return SweepStrategy::asha;
  DT_THROW("sweep", "{} '{}': expected grid, random or asha", where, text);
}

SweepAxis parse_sweep_axis(const std::string& text) {
  const std::string usage = "expected NAME=V1,V2,... or NAME=range:MIN:MAX[:N] or NAME=log:MIN:MAX[:N]";
  const size_t eq = text.find('=');
  DT_CHECK(eq != std::string::npos && eq > 0, "sweep", "--param '{}': {}", text, usage);
  SweepAxis a;
  a.name = flag_name(text.substr(0, eq));
  if (a.name.starts_with("--")) a.name = a.name.substr(2);
  const std::string where = "--param " + a.name;
  const OptionInfo& o = known_option(a.name, "--param '" + text + "'");
  const std::string spec = text.substr(eq + 1);
  DT_CHECK(!spec.empty(), "sweep", "--param '{}': no values (an empty list); {}", text, usage);
  if (spec.starts_with("range:") || spec.starts_with("log:")) {
    a.log = spec.starts_with("log:");
    const std::vector<std::string> parts = split(spec.substr(a.log ? 4 : 6), ':');
    DT_CHECK(parts.size() == 2 || parts.size() == 3, "sweep", "--param '{}': {}", text, usage);
    a.min = parse_number(parts[0], where + " MIN");
    a.max = parse_number(parts[1], where + " MAX");
    if (parts.size() == 3) {
      a.points = parse_count(parts[2], where + " N");
      DT_CHECK(a.points >= 2, "sweep", "--param '{}': N = {} points (expected at least 2)", text, a.points);
    }
    check_range(a, o, where);
    return a;
  }
  a.values = split(spec, o.kind == OptionKind::integer_list ? '/' : ',');
  for (const auto& v : a.values) {
    DT_CHECK(!v.empty(), "sweep", "--param '{}': an empty value in the list{}", text,
             o.kind == OptionKind::integer_list ? " (--" + a.name + " values are separated by '/')" : "");
  }
  return a;
}

void read_sweep_file(const std::string& path, SweepSpec& spec, const std::set<std::string>& given) {
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    DT_THROW("sweep", "{}:{}:{}: {}", path, e.source().begin.line, e.source().begin.column, e.description());
  }
  for (const auto& [key, node] : table) {
    const std::string k(key.str());
    const std::string name = flag_name(k);
    const std::string where = fmt::format("{}: key '{}'", path, k);
    if (k == "space") {
      const toml::table* t = node.as_table();
      DT_CHECK(t != nullptr, "sweep", "{}: expected a table of axes ([space])", where);
      // Axes in the file's order (a toml++ table iterates its keys sorted).
      std::vector<std::pair<std::string, const toml::node*>> axes;
      for (const auto& [axis_key, axis_node] : *t) axes.emplace_back(std::string(axis_key.str()), &axis_node);
      std::stable_sort(axes.begin(), axes.end(), [](const auto& x, const auto& y) {
        const toml::source_position a = x.second->source().begin, b = y.second->source().begin;
        return a.line != b.line ? a.line < b.line : a.column < b.column;
      });
      for (const auto& [axis_key, axis_node] : axes) {
        SweepAxis a = axis_from_toml(axis_key, *axis_node, fmt::format("{}: space.{}", path, axis_key));
        auto same =
            std::find_if(spec.space.begin(), spec.space.end(), [&](const SweepAxis& x) { return x.name == a.name; });
        if (same != spec.space.end()) {
          *same = a;
        } else {
          spec.space.push_back(a);
        }
      }
      continue;
    }
    if (k == "train") {
      const toml::table* t = node.as_table();
      DT_CHECK(t != nullptr, "sweep", "{}: expected a table of dtrain train options ([train])", where);
      std::vector<std::string> flags;
      for (const auto& [opt_key, opt_node] : *t) {
        const std::string opt = flag_name(std::string(opt_key.str()));
        const std::string at = fmt::format("{}: train.{}", path, opt_key.str());
        const OptionInfo& o = known_option(opt, at);
        flags.push_back("--" + opt + "=" + toml_scalar_text(opt_node, at, o.kind == OptionKind::integer_list));
      }
      spec.train = parse_train_flags(flags);
      continue;
    }
    if (given.count(name) > 0) continue;  // the flag wins
    if (name == "strategy") {
      spec.strategy = parse_strategy(toml_string(node, where), where);
    } else if (name == "metric") {
      spec.metric = toml_string(node, where);
    } else if (name == "mode") {
      spec.mode = toml_string(node, where);
    } else if (name == "trials") {
      spec.trials = toml_count(node, where);
    } else if (name == "seed") {
      spec.seed = static_cast<uint64_t>(toml_count(node, where));
    } else if (name == "min-steps") {
      spec.min_steps = toml_count(node, where);
    } else if (name == "max-steps") {
      spec.max_steps = toml_count(node, where);
    } else if (name == "eta") {
      spec.eta = toml_count(node, where);
    } else if (name == "checkpoint-every") {
      spec.checkpoint_every = toml_count(node, where);
    } else {
      DT_THROW("sweep",
               "{}: unknown key (expected strategy, trials, seed, metric, mode, min_steps, max_steps, eta, "
               "checkpoint_every, [space], [train])",
               where);
    }
  }
}

OptionValues parse_train_flags(const std::vector<std::string>& args) {
  const TrainConfig cfg = parse_train(args, "dtrain train options");
  OptionValues out;
  for (const auto& o : train_options()) {
    if (cfg.given.count(o.name) > 0) out.emplace_back(o.name, option_text(cfg, o.name));
  }
  return out;
}

OptionValues merge_options(const OptionValues& base, const OptionValues& over) {
  OptionValues out;
  for (const auto& o : train_options()) {
    auto find = [&](const OptionValues& v) {
      return std::find_if(v.begin(), v.end(), [&](const auto& p) { return p.first == o.name; });
    };
    if (auto it = find(over); it != over.end()) {
      out.push_back(*it);
    } else if (auto jt = find(base); jt != base.end()) {
      out.push_back(*jt);
    }
  }
  return out;
}

std::vector<int64_t> asha_rungs(int64_t min_steps, int64_t max_steps, int64_t eta) {
  DT_CHECK(min_steps >= 1 && min_steps <= max_steps && eta >= 2, "sweep",
           "asha rungs: --min-steps {} must be in [1, --max-steps {}] and --eta {} at least 2", min_steps, max_steps,
           eta);
  std::vector<int64_t> rungs;
  for (int64_t r = min_steps; r < max_steps; r *= eta) {
    rungs.push_back(r);
    if (r > max_steps / eta) break;
  }
  rungs.push_back(max_steps);
  return rungs;
}

SweepPlan plan_sweep(SweepSpec spec) {
  const bool asha = spec.strategy == SweepStrategy::asha;
  DT_CHECK(!spec.space.empty(), "sweep", "the search space is empty: give --param NAME=VALUES or a [space] table");
  DT_CHECK(spec.trials >= 0 && spec.min_steps >= 0 && spec.max_steps >= 0 && spec.checkpoint_every >= 0, "sweep",
           "--trials {}, --min-steps {}, --max-steps {}, --checkpoint-every {}: expected non-negative numbers",
           spec.trials, spec.min_steps, spec.max_steps, spec.checkpoint_every);
  // The fixed options: none of those the sweep sets itself.
  for (const auto& [name, text] : spec.train) {
    DT_CHECK(reserved_options().count(name) == 0, "sweep",
             "dtrain train option --{} is set by the sweep for each trial (in its folder of the sweep directory)",
             name);
    DT_CHECK(!(asha && name == "epochs"), "sweep",
             "asha gives each trial --steps per rung: --epochs cannot be a train option (use --max-steps)");
  }
  std::set<std::string> names;
  for (auto& a : spec.space) {
    const std::string where = "--param " + a.name;
    const OptionInfo& o = known_option(a.name, where);
    DT_CHECK(names.insert(a.name).second, "sweep", "{}: the axis comes twice", where);
    DT_CHECK(reserved_options().count(a.name) == 0, "sweep", "{}: --{} is set by the sweep for each trial", where,
             a.name);
    DT_CHECK(!(asha && (a.name == "steps" || a.name == "epochs")), "sweep",
             "{}: asha sets each trial's --steps to its rung's budget (give --min-steps, --max-steps, --eta)", where);
    for (const auto& [name, text] : spec.train) {
      DT_CHECK(name != a.name, "sweep", "{}: --{} is both an axis and a fixed train option ({})", where, a.name, text);
    }
    a.integer = o.kind == OptionKind::integer;
    if (a.values.empty()) check_range(a, o, where);
  }
  DT_CHECK(spec.mode.empty() || spec.mode == "min" || spec.mode == "max", "sweep", "--mode '{}': expected min or max",
           spec.mode);
  SweepPlan plan;
  // Rungs.
  if (asha) {
    if (spec.max_steps == 0) {
      for (const auto& [name, text] : spec.train) {
        if (name == "steps") spec.max_steps = parse_count(text, "--steps");
      }
    }
    DT_CHECK(spec.max_steps > 0, "sweep",
             "asha needs a step budget: --max-steps N (or --steps N among the train options)");
    DT_CHECK(spec.eta >= 2, "sweep", "--eta {}: expected at least 2", spec.eta);
    if (spec.min_steps == 0) {
      // About max / eta^3 (three halvings), a divisor of max so that every rung ends on a checkpoint
      // of a coarse interval (800 steps, eta 3: rungs 25, 75, 225, 675, 800, checkpoints every 25).
      const int64_t target = std::max<int64_t>(1, spec.max_steps / (spec.eta * spec.eta * spec.eta));
      spec.min_steps = target;
      while (spec.max_steps % spec.min_steps != 0) --spec.min_steps;
    }
    DT_CHECK(spec.min_steps <= spec.max_steps, "sweep", "--min-steps {} is more than --max-steps {}", spec.min_steps,
             spec.max_steps);
    std::erase_if(spec.train, [](const auto& p) { return p.first == "steps"; });
    plan.rungs = asha_rungs(spec.min_steps, spec.max_steps, spec.eta);
    int64_t common = 0;
    for (int64_t r : plan.rungs) common = std::gcd(common, r);
    if (spec.checkpoint_every == 0) spec.checkpoint_every = common;
    DT_CHECK(common % spec.checkpoint_every == 0, "sweep",
             "--checkpoint-every {} must divide every rung's budget ({}): a promoted trial continues from the "
             "checkpoint of its last rung",
             spec.checkpoint_every, fmt::join(plan.rungs, ", "));
  } else {
    DT_CHECK(spec.min_steps == 0 && spec.max_steps == 0, "sweep",
             "--min-steps / --max-steps are asha's rungs; {} trains each trial to its own --steps",
             strategy_name(spec.strategy));
    plan.rungs = {0};
  }
  // Every axis' values, checked against the option's type with the fixed options around them.
  std::vector<std::vector<std::string>> points(spec.space.size());
  bool discrete = true;
  int64_t grid_size = 1;
  for (size_t i = 0; i < spec.space.size(); ++i) {
    SweepAxis& a = spec.space[i];
    if (a.discrete()) {
      points[i] = axis_points(a, spec.train);
      if (!a.values.empty()) a.values = points[i];  // canonical
      grid_size = std::min<int64_t>(grid_size * static_cast<int64_t>(points[i].size()), kMaxTrials + 1);
    } else {
      discrete = false;
      canonical_value(spec.train, a.name, range_text(a.min, a.integer), "--param " + a.name);
      canonical_value(spec.train, a.name, range_text(a.max, a.integer), "--param " + a.name);
    }
  }
  // The trials.
  if (spec.strategy == SweepStrategy::grid) {
    DT_CHECK(discrete, "sweep",
             "grid needs a value list or a number of points for every axis (range:MIN:MAX:N); continuous ranges "
             "are for random and asha");
    DT_CHECK(grid_size <= kMaxTrials, "sweep", "the grid has more than {} points", kMaxTrials);
    DT_CHECK(spec.trials == 0 || spec.trials == grid_size, "sweep",
             "--trials {}: grid runs every one of the {} points (random and asha take --trials)", spec.trials,
             grid_size);
    spec.trials = grid_size;
    for (int64_t t = 0; t < grid_size; ++t) {
      SweepTrial trial{t, {}};
      int64_t rest = t, stride = grid_size;
      for (size_t i = 0; i < spec.space.size(); ++i) {
        stride /= static_cast<int64_t>(points[i].size());
        trial.params.emplace_back(spec.space[i].name, points[i][static_cast<size_t>(rest / stride)]);
        rest %= stride;
      }
      plan.trials.push_back(std::move(trial));
    }
  } else if (discrete) {
    // Every axis discrete: trials are distinct points of the grid, in a seeded random order.
    DT_CHECK(grid_size <= kMaxTrials, "sweep", "the space has more than {} points", kMaxTrials);
    if (spec.trials == 0) spec.trials = grid_size;
    DT_CHECK(spec.trials <= grid_size, "sweep",
             "--trials {} is more than the {} points of the space (each trial is a different point)", spec.trials,
             grid_size);
    std::vector<int64_t> order(static_cast<size_t>(grid_size));
    std::iota(order.begin(), order.end(), 0);
    uint64_t state = spec.seed;
    for (int64_t t = 0; t < spec.trials; ++t) {
      const auto j =
          static_cast<size_t>(t + static_cast<int64_t>(random_below(state, static_cast<uint64_t>(grid_size - t))));
      std::swap(order[static_cast<size_t>(t)], order[j]);
      SweepTrial trial{t, {}};
      int64_t rest = order[static_cast<size_t>(t)], stride = grid_size;
      for (size_t i = 0; i < spec.space.size(); ++i) {
        stride /= static_cast<int64_t>(points[i].size());
        trial.params.emplace_back(spec.space[i].name, points[i][static_cast<size_t>(rest / stride)]);
        rest %= stride;
      }
      plan.trials.push_back(std::move(trial));
    }
  } else {
    DT_CHECK(spec.trials > 0, "sweep", "{} over a continuous range needs --trials N", strategy_name(spec.strategy));
    DT_CHECK(spec.trials <= kMaxTrials, "sweep", "--trials {}: at most {}", spec.trials, kMaxTrials);
    for (int64_t t = 0; t < spec.trials; ++t) {
      // Trial t's values depend only on the seed and t: more trials keep the first ones.
      uint64_t state = spec.seed ^ (0x5851f42d4c957f2dULL * static_cast<uint64_t>(t + 1));
      next_random(state);
      SweepTrial trial{t, {}};
      for (size_t i = 0; i < spec.space.size(); ++i) {
        const SweepAxis& a = spec.space[i];
        std::string v = a.discrete() ? points[i][random_below(state, points[i].size())]
                                     : canonical_value(spec.train, a.name, sample_range(a, state), "--param " + a.name);
        trial.params.emplace_back(a.name, std::move(v));
      }
      plan.trials.push_back(std::move(trial));
    }
  }
  // Every trial through dtrain train's own checks, and the metric it reports.
  const MetricInfo* metric = nullptr;
  plan.spec = spec;
  for (const SweepTrial& trial : plan.trials) {
    const std::string where = fmt::format("trial {} ({})", trial.index, params_text(trial.params));
    TrainConfig cfg = parse_train(trial_flags(plan, trial, asha ? spec.max_steps : 0), where);
    try {
      finalize(cfg);
    } catch (const Error& e) {
      DT_THROW("sweep", "{}: {}", where, e.message());
    }
    DT_CHECK(!(asha && cfg.lr_schedule == "cosine"), "sweep",
             "{}: asha continues a trial from its checkpoint at each rung, and --lr-schedule cosine decays over "
             "--steps, which differs per rung: use a constant schedule (with --warmup), or grid / random",
             where);
    const bool gpt = cfg.model == "gpt";
    if (spec.metric.empty()) spec.metric = gpt ? "val_loss" : "test_accuracy";
    metric = nullptr;
    for (const auto& m : kMetrics) {
      if (spec.metric == m.name) metric = &m;
    }
    DT_CHECK(metric != nullptr, "sweep", "--metric '{}': no trial reports it (mlp reports {}; gpt reports {})",
             spec.metric, model_metrics(false), model_metrics(true));
    DT_CHECK(gpt ? metric->gpt : metric->mlp, "sweep",
             "--metric {}: {} trains --model {}, whose final metrics record has {} but not {}", spec.metric, where,
             cfg.model, model_metrics(gpt), spec.metric);
  }
  if (spec.mode.empty()) spec.mode = metric->maximize ? "max" : "min";
  plan.maximize = spec.mode == "max";
  plan.spec = spec;
  return plan;
}

std::vector<std::string> trial_flags(const SweepPlan& plan, const SweepTrial& trial, int64_t steps) {
  std::vector<std::string> flags;
  for (const auto& [name, text] : plan.spec.train) {
    if (!(steps > 0 && name == "steps")) flags.push_back(fmt::format("--{}={}", name, text));
  }
  for (const auto& [name, text] : trial.params) flags.push_back(fmt::format("--{}={}", name, text));
  if (steps > 0) flags.push_back(fmt::format("--steps={}", steps));
  return flags;
}

std::string trial_command(const SweepPlan& plan, const SweepTrial& trial) {
  std::string out = "dtrain train";
  for (const std::string& f : trial_flags(plan, trial, plan.rungs.back())) {
    const size_t eq = f.find('=');
    out += " " + f.substr(0, eq) + " " + shell_word(f.substr(eq + 1));
  }
  return out;
}

int64_t trial_checkpoint_every(const SweepPlan& plan, const SweepTrial& trial) {
  if (plan.spec.checkpoint_every > 0) return plan.spec.checkpoint_every;
  for (const auto& list : {plan.spec.train, trial.params}) {
    for (const auto& [name, text] : list) {
      if (name == "steps") return std::max<int64_t>(1, parse_count(text, "--steps") / 4);
    }
  }
  return 0;  // trained by epochs: no checkpoints unless --checkpoint-every
}

SweepLadder successive_halving(const std::vector<std::vector<RungOutcome>>& outcomes, int64_t eta, bool maximize) {
  SweepLadder ladder;
  const size_t rungs = outcomes.empty() ? 1 : outcomes[0].size();
  ladder.rungs.assign(rungs, {});
  for (size_t t = 0; t < outcomes.size(); ++t) ladder.rungs[0].push_back(static_cast<int64_t>(t));
  ladder.finished = true;
  auto better = [&](int64_t a, int64_t b, size_t k) {
    const double ma = outcomes[static_cast<size_t>(a)][k].metric, mb = outcomes[static_cast<size_t>(b)][k].metric;
    if (ma != mb) return maximize ? ma > mb : ma < mb;
    return a < b;
  };
  for (size_t k = 0; k < rungs; ++k) {
    const std::vector<int64_t>& list = ladder.rungs[k];
    std::vector<int64_t> ranking;  // the done trials of the prefix, best first
    std::set<int64_t> promoted;
    size_t m = 0;
    for (; m < list.size(); ++m) {
      const RungOutcome& o = outcomes[static_cast<size_t>(list[m])][k];
      if (o.state == RungOutcome::State::pending) break;
      if (k + 1 == rungs) continue;
      if (o.state == RungOutcome::State::done) {
        ranking.insert(std::upper_bound(ranking.begin(), ranking.end(), list[m],
                                        [&](int64_t a, int64_t b) { return better(a, b, k); }),
                       list[m]);
      }
      const size_t quota = std::min((m + 1) / static_cast<size_t>(eta), ranking.size());
      for (size_t r = 0; r < quota; ++r) {
        if (promoted.insert(ranking[r]).second) ladder.rungs[k + 1].push_back(ranking[r]);
      }
    }
    if (m < list.size()) ladder.finished = false;
  }
  return ladder;
}

std::vector<SweepJob> pending_jobs(const SweepLadder& ladder, const std::vector<std::vector<RungOutcome>>& outcomes) {
  std::vector<SweepJob> jobs;
  for (size_t k = ladder.rungs.size(); k-- > 0;) {
    for (int64_t t : ladder.rungs[k]) {
      if (outcomes[static_cast<size_t>(t)][k].state == RungOutcome::State::pending) {
        jobs.push_back({t, static_cast<int64_t>(k)});
      }
    }
  }
  return jobs;
}

namespace {

const char* state_name(RungOutcome::State s) {
  switch (s) {
    case RungOutcome::State::pending:
      return "pending";
    case RungOutcome::State::done:
      return "done";
    case RungOutcome::State::failed:
      return "failed";
  }
  return "?";
}

nlohmann::json pairs_json(const OptionValues& values) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& [name, text] : values) j.push_back({name, text});
  return j;
}

OptionValues pairs_from_json(const nlohmann::json& j) {
  OptionValues out;
  for (const auto& p : j) out.emplace_back(p.at(0).get<std::string>(), p.at(1).get<std::string>());
  return out;
}

}  // namespace

nlohmann::json trial_record_json(const SweepPlan& plan, const TrialRecord& record) {
  nlohmann::json rungs = nlohmann::json::array();
  for (size_t k = 0; k < record.rungs.size(); ++k) {
    const RungOutcome& o = record.rungs[k];
    nlohmann::json r{{"rung", k}, {"budget", plan.rungs[k]}, {"state", state_name(o.state)}};
    if (o.state == RungOutcome::State::done) {
      r["metric"] = o.metric;
      r["steps"] = o.steps;
    }
    if (o.state != RungOutcome::State::pending) r["time_s"] = o.time_s;
    rungs.push_back(r);
  }
  return {
      {"format", kTrialFormat}, {"version", kVersion},
      {"trial", record.trial},  {"params", pairs_json(plan.trials[static_cast<size_t>(record.trial)].params)},
      {"rungs", rungs},         {"running", record.running >= 0 ? nlohmann::json(record.running) : nlohmann::json()},
      {"error", record.error}};
}

TrialRecord trial_record_from_json(const SweepPlan& plan, const nlohmann::json& j, const std::string& where) {
  TrialRecord r;
  try {
    DT_CHECK(j.at("format") == kTrialFormat && j.at("version") == kVersion, "sweep",
             "{}: not a dtrain sweep trial record of version {}", where, kVersion);
    r.trial = j.at("trial").get<int64_t>();
    DT_CHECK(r.trial >= 0 && r.trial < static_cast<int64_t>(plan.trials.size()), "sweep",
             "{}: trial {} is not in this sweep", where, r.trial);
    DT_CHECK(pairs_from_json(j.at("params")) == plan.trials[static_cast<size_t>(r.trial)].params, "sweep",
             "{}: trial {} has other values ({}) than this search gives it ({})", where, r.trial, j.at("params").dump(),
             pairs_json(plan.trials[static_cast<size_t>(r.trial)].params).dump());
    const auto& rungs = j.at("rungs");
    DT_CHECK(rungs.size() == plan.rungs.size(), "sweep", "{}: {} rungs, the search has {}", where, rungs.size(),
             plan.rungs.size());
    for (const auto& x : rungs) {
      RungOutcome o;
      const std::string state = x.at("state").get<std::string>();
      if (state == "done") {
        o.state = RungOutcome::State::done;
        o.metric = x.at("metric").get<double>();
        o.steps = x.at("steps").get<int64_t>();
      } else if (state == "failed") {
        o.state = RungOutcome::State::failed;
      } else {
        DT_CHECK(state == "pending", "sweep", "{}: unknown state '{}'", where, state);
      }
      if (x.contains("time_s")) o.time_s = x.at("time_s").get<double>();
      r.rungs.push_back(o);
    }
    r.running = j.at("running").is_null() ? -1 : j.at("running").get<int64_t>();
    r.error = j.at("error").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    DT_THROW("sweep", "{}: not a valid trial record: {}", where, e.what());
  }
  return r;
}

nlohmann::json sweep_spec_json(const SweepSpec& spec) {
  nlohmann::json space = nlohmann::json::array();
  for (const SweepAxis& a : spec.space) {
    if (!a.values.empty()) {
      space.push_back({{"name", a.name}, {"values", a.values}});
    } else {
      space.push_back({{"name", a.name}, {"min", a.min}, {"max", a.max}, {"log", a.log}, {"points", a.points}});
    }
  }
  return {{"format", kSpecFormat},
          {"version", kVersion},
          {"strategy", strategy_name(spec.strategy)},
          {"space", space},
          {"train", pairs_json(spec.train)},
          {"trials", spec.trials},
          {"seed", spec.seed},
          {"metric", spec.metric},
          {"mode", spec.mode},
          {"min_steps", spec.min_steps},
          {"max_steps", spec.max_steps},
          {"eta", spec.eta},
          {"checkpoint_every", spec.checkpoint_every}};
}

SweepSpec sweep_spec_from_json(const nlohmann::json& j) {
  SweepSpec s;
  try {
    DT_CHECK(j.at("format") == kSpecFormat && j.at("version") == kVersion, "sweep",
             "not a dtrain sweep manifest of version {}", kVersion);
    s.strategy = parse_strategy(j.at("strategy").get<std::string>(), "strategy");
    for (const auto& a : j.at("space")) {
      SweepAxis x;
      x.name = a.at("name").get<std::string>();
      if (a.contains("values")) {
        x.values = a.at("values").get<std::vector<std::string>>();
      } else {
        x.min = a.at("min").get<double>();
        x.max = a.at("max").get<double>();
        x.log = a.at("log").get<bool>();
        x.points = a.at("points").get<int64_t>();
      }
      s.space.push_back(x);
    }
    s.train = pairs_from_json(j.at("train"));
    s.trials = j.at("trials").get<int64_t>();
    s.seed = j.at("seed").get<uint64_t>();
    s.metric = j.at("metric").get<std::string>();
    s.mode = j.at("mode").get<std::string>();
    s.min_steps = j.at("min_steps").get<int64_t>();
    s.max_steps = j.at("max_steps").get<int64_t>();
    s.eta = j.at("eta").get<int64_t>();
    s.checkpoint_every = j.at("checkpoint_every").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    DT_THROW("sweep", "not a valid sweep manifest: {}", e.what());
  }
  return s;
}

std::vector<std::string> sweep_differences(const nlohmann::json& a, const nlohmann::json& b) {
  std::vector<std::string> out;
  auto brief = [](const nlohmann::json& v) {
    std::string s = v.dump();
    return s.size() > 120 ? s.substr(0, 117) + "..." : s;
  };
  for (const auto& [key, value] : a.items()) {
    const nlohmann::json other = b.contains(key) ? b.at(key) : nlohmann::json();
    if (value != other) out.push_back(fmt::format("{}: {} vs {}", key, brief(value), brief(other)));
  }
  return out;
}

std::vector<nlohmann::json> sweep_results(const SweepPlan& plan, const std::vector<TrialRecord>& records) {
  struct Row {
    const TrialRecord* record;
    int64_t rung = -1;  // the last rung done
    bool failed = false;
  };
  std::vector<Row> rows;
  for (const TrialRecord& r : records) {
    Row row{&r};
    for (size_t k = 0; k < r.rungs.size(); ++k) {
      if (r.rungs[k].state == RungOutcome::State::done) row.rung = static_cast<int64_t>(k);
      if (r.rungs[k].state == RungOutcome::State::failed) row.failed = true;
    }
    rows.push_back(row);
  }
  std::stable_sort(rows.begin(), rows.end(), [&](const Row& a, const Row& b) {
    const bool ua = a.failed || a.rung < 0, ub = b.failed || b.rung < 0;
    if (ua != ub) return ub;
    if (ua) return a.record->trial < b.record->trial;
    if (a.rung != b.rung) return a.rung > b.rung;
    const double ma = a.record->rungs[static_cast<size_t>(a.rung)].metric;
    const double mb = b.record->rungs[static_cast<size_t>(b.rung)].metric;
    if (ma != mb) return plan.maximize ? ma > mb : ma < mb;
    return a.record->trial < b.record->trial;
  });
  std::vector<nlohmann::json> out;
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    const TrialRecord& r = *row.record;
    const SweepTrial& trial = plan.trials[static_cast<size_t>(r.trial)];
    nlohmann::json params = nlohmann::json::object();
    for (const auto& [name, value] : trial.params) params[name] = value;
    double time_s = 0.0;
    for (const auto& o : r.rungs) time_s += o.time_s;
    const bool last = row.rung + 1 == static_cast<int64_t>(plan.rungs.size());
    nlohmann::json j{
        {"rank", i + 1},
        {"trial", r.trial},
        {"params", params},
        {"metric", plan.spec.metric},
        {"value", row.rung >= 0 ? nlohmann::json(r.rungs[static_cast<size_t>(row.rung)].metric) : nlohmann::json()},
        {"steps", row.rung >= 0 ? r.rungs[static_cast<size_t>(row.rung)].steps : 0},
        {"rung", row.rung},
        {"status", row.failed     ? "failed"
                   : row.rung < 0 ? "pending"
                   : last         ? "done"
                                  : "stopped"},
        {"time_s", time_s},
        {"command", trial_command(plan, trial)}};
    if (!r.error.empty()) j["error"] = r.error;
    out.push_back(j);
  }
  return out;
}

std::string sweep_table(const SweepPlan& plan, const std::vector<nlohmann::json>& results) {
  std::vector<std::string> header{"rank", "trial"};
  for (const auto& a : plan.spec.space) header.push_back(a.name);
  header.insert(header.end(), {plan.spec.metric, "steps", "time_s", "status"});
  std::vector<std::vector<std::string>> cells{header};
  for (const auto& r : results) {
    std::vector<std::string> row{fmt::format("{}", r["rank"].get<int64_t>()),
                                 fmt::format("{}", r["trial"].get<int64_t>())};
    for (const auto& a : plan.spec.space) row.push_back(r["params"][a.name].get<std::string>());
    row.push_back(r["value"].is_null() ? "-" : fmt::format("{:.6g}", r["value"].get<double>()));
    row.push_back(fmt::format("{}", r["steps"].get<int64_t>()));
    row.push_back(fmt::format("{:.1f}", r["time_s"].get<double>()));
    std::string status = r["status"].get<std::string>();
    if (r.contains("error")) status += ": " + r["error"].get<std::string>();
    row.push_back(status);
    cells.push_back(row);
  }
  std::vector<size_t> width(header.size(), 0);
  for (const auto& row : cells) {
    for (size_t c = 0; c + 1 < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  for (const auto& row : cells) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      line += c + 1 < row.size() ? fmt::format("{:<{}}  ", row[c], width[c]) : row[c];
    }
    out += line + "\n";
  }
  if (!results.empty() && !results[0]["value"].is_null()) {
    out += fmt::format("best: trial {}, {} {:.6g} after {} steps\n  {}\n", results[0]["trial"].get<int64_t>(),
                       plan.spec.metric, results[0]["value"].get<double>(), results[0]["steps"].get<int64_t>(),
                       results[0]["command"].get<std::string>());
  }
  return out;
}

int64_t sweep_total_steps(const std::vector<TrialRecord>& records) {
  int64_t total = 0;
  for (const TrialRecord& r : records) {
    int64_t steps = 0;
    for (const auto& o : r.rungs) {
      if (o.state == RungOutcome::State::done) steps = std::max(steps, o.steps);
    }
    total += steps;
  }
  return total;
}

}  // namespace dtrain::train
