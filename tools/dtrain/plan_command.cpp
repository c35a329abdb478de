// dtrain plan: predicts step time, memory per device and scaling efficiency of a layout, or
// searches the layouts of --devices for the fastest that fits --memory (src/plan).
//
//   dtrain plan --model gpt --params 7e9 --devices 1024 --device-flops 9.9e14 --link-gbps 400 --memory 80e9
//   dtrain plan --model gpt --dp 2 --pp 2 --micro-batches 4 --hosts 2 --link-gbps 1 --calibrate
//
// Without --device-flops the machine is this one: its cores, its kernels' times for the model
// (measured in this process), and alpha/beta of shared memory and TCP measured by `dtrain bench
// collectives --model` in two local processes; --calibrate measures them, --calibration FILE
// keeps them.
#include "plan_command.h"

#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "dtrain/core/error.h"
#include "dtrain/core/file.h"
#include "dtrain/plan/calibrate.h"
#include "dtrain/plan/plan.h"
#include "dtrain/train/trainer.h"

namespace dtrain::tools {

namespace {

constexpr double kMiB = 1 << 20;
// --device-flops: the optimizer streams about 28 bytes per parameter (mixed precision AdamW:
// bf16 gradient and parameter, f32 master weight and two moments) at this memory bandwidth.
constexpr double kDeviceMemoryBandwidth = 2e12;
constexpr double kOptimizerBytesPerParam = 28;
constexpr double kDefaultLinkGbps = 400;
constexpr double kDefaultLinkLatencyUs = 5;

std::string self_path() {
  char self[4096] = {};
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  DT_CHECK(len > 0, "plan", "cannot find this program's path (/proc/self/exe)");
  return std::string(self, static_cast<size_t>(len));
}

// alpha and beta of `transport` between two local processes, with the reduction and memcpy
// figures, from `dtrain bench collectives --model` (its ping-pong and fits).
nlohmann::json bench_link(const std::string& transport) {
  char path[] = "/tmp/dtrain-plan-XXXXXX";
  const int fd = ::mkstemp(path);
  DT_CHECK(fd >= 0, "plan", "cannot create a temporary file in /tmp");
  ::close(fd);
  const std::string cmd = fmt::format(
      "'{}' bench collectives -n 2 --op allreduce --counts 1 -i 1 -w 0 --model --transport {} --json '{}' "
      ">/dev/null 2>&1",
      self_path(), transport, path);
  const int rc = std::system(cmd.c_str());
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  std::remove(path);
  DT_CHECK(rc == 0 && j.is_object() && j.contains("alpha_us"), "plan",
           "calibration: `dtrain bench collectives --model --transport {}` failed (exit status {})", transport, rc);
  return j;
}

double epoch_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// What one probe process measured: the layout's kernels and the optimizer.
nlohmann::json probe_kernels(const train::TrainConfig& cfg, int64_t rows, int tp, double at) {
  std::this_thread::sleep_for(std::chrono::duration<double>(std::max(0.0, at - epoch_seconds())));
  const plan::KernelEntry e = plan::measure_kernels(cfg, rows, tp);
  const plan::ModelSpec spec = plan::model_of(cfg);
  return {{"forward_s", e.times.forward},
          {"backward_s", e.times.backward},
          {"act_bytes", e.act_bytes},
          {"optimizer_s_per_param", plan::measure_optimizer(cfg, std::max<int64_t>(spec.params(), 1 << 20))}};
}

std::string quoted(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// alpha and beta of shared memory and TCP, the reduction and copy rates, the cores.
void calibrate_links(plan::Calibration& cal) {
  const nlohmann::json shm = bench_link("shm");
  const nlohmann::json tcp = bench_link("tcp");
  cal.shm = {shm.at("alpha_us").get<double>() * 1e-6, shm.at("beta_ns_per_byte").get<double>() * 1e-9};
  cal.tcp = {tcp.at("alpha_us").get<double>() * 1e-6, tcp.at("beta_ns_per_byte").get<double>() * 1e-9};
  cal.gamma_s_per_byte = shm.at("gamma_ns_per_byte").get<double>() * 1e-9;
  cal.copy_s_per_byte = 1e-9 / shm.at("memcpy_GBs").get<double>();
  cal.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// What `k` processes measuring the layout's kernels at once saw (this one first): k - 1 copies
// of this command (--kernel-probe) and this process, all starting at the same moment.
std::vector<nlohmann::json> probe_concurrently(const train::TrainConfig& cfg, const std::vector<std::string>& argv,
                                               int k, int64_t rows, int tp) {
  const double at = epoch_seconds() + 0.5;
  std::vector<std::string> files;
  std::string cmd;
  for (int i = 1; i < k; ++i) {
    char path[] = "/tmp/dtrain-probe-XXXXXX";
    const int fd = ::mkstemp(path);
    DT_CHECK(fd >= 0, "plan", "cannot create a temporary file in /tmp");
    ::close(fd);
    files.emplace_back(path);
    cmd += quoted(self_path());
    for (size_t a = 1; a < argv.size(); ++a) cmd += " " + quoted(argv[a]);
    cmd += fmt::format(" --kernel-probe {} --kernel-probe-at {:.3f} >/dev/null 2>&1 & ", path, at);
  }
  int rc = 0;
  std::thread others([&] {
    if (!cmd.empty()) rc = std::system((cmd + "wait").c_str());
  });
  nlohmann::json mine;
  try {
    mine = probe_kernels(cfg, rows, tp, at);
  } catch (...) {
    others.join();
    throw;
  }
  others.join();
  std::vector<nlohmann::json> probes{mine};
  for (const std::string& f : files) {
    std::ifstream in(f);
    probes.push_back(nlohmann::json::parse(in, nullptr, false));
    std::remove(f.c_str());
    DT_CHECK(rc == 0 && probes.back().is_object(), "plan", "calibration: a kernel probe process failed ({})", rc);
  }
  return probes;
}

plan::Calibration calibrate(const train::TrainConfig& cfg, const plan::Layout& l, int64_t batch,
                            const std::vector<std::string>& argv, plan::Calibration cal) {
  std::fprintf(stderr, "dtrain plan: calibrating: ping-pong over shared memory and TCP, kernels of the model...\n");
  calibrate_links(cal);
  // One process alone on the whole batch: T(1), and the FLOP rate for shapes not measured.
  plan::KernelEntry single = plan::measure_kernels(cfg, batch, 1);
  const plan::ModelSpec spec = plan::model_of(cfg);
  double t = 0;
  for (size_t i = 0; i < single.times.forward.size(); ++i) t += single.times.forward[i] + single.times.backward[i];
  cal.flops_per_s = 3.0 * spec.flops_per_sample() * static_cast<double>(batch) / t;
  // The layout's kernels as its ranks see them: as many processes measuring at once as the run
  // keeps cores busy (they share caches and memory bandwidth; beyond the cores the simulation
  // shares the cores themselves).
  const int threads = std::max(1, cfg.threads);
  const int k = std::max(1, std::min(cal.cores, l.world() * threads) / threads);
  const int64_t rows = batch / (l.dp * l.accumulate * l.micro_batches);
  const std::vector<nlohmann::json> probes = probe_concurrently(cfg, argv, k, rows, l.tp);
  const nlohmann::json& mine = probes.front();
  plan::KernelEntry e;
  e.model = train::model_metadata(cfg);
  e.rows = rows;
  e.tp = l.tp;
  e.threads = threads;
  e.concurrency = k;
  const size_t n = mine["forward_s"].size();
  e.times.forward.assign(n, 0.0);
  e.times.backward.assign(n, 0.0);
  e.act_bytes = mine["act_bytes"].get<std::vector<double>>();
  cal.optimizer_s_per_param = 0;
  for (const nlohmann::json& p : probes) {
    for (size_t i = 0; i < n; ++i) {
      e.times.forward[i] += p["forward_s"][i].get<double>() / static_cast<double>(probes.size());
      e.times.backward[i] += p["backward_s"][i].get<double>() / static_cast<double>(probes.size());
    }
    cal.optimizer_s_per_param += p["optimizer_s_per_param"].get<double>() / static_cast<double>(probes.size());
  }
  cal.put(std::move(single));
  cal.put(std::move(e));
  return cal;
}

std::string bytes_str(double b) {
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  return fmt::format("{:.1f} MB", b / 1e6);
}

std::string time_str(double s) {
  if (s >= 10) return fmt::format("{:.2f} s", s);
  return fmt::format("{:.1f} ms", s * 1e3);
}

std::string ranges(const std::vector<plan::StagePrediction>& stages) {
  std::vector<std::string> r;
  r.reserve(stages.size());
  for (const auto& s : stages) r.push_back(fmt::format("{}-{}", s.blocks.begin, s.blocks.end - 1));
  return fmt::format("{}", fmt::join(r, ","));
}

nlohmann::json memory_json(const plan::Memory& m) {
  return {{"params", m.params},
          {"grads", m.grads},
          {"optimizer", m.optimizer},
          {"activations", m.activations},
          {"total", m.total()}};
}

nlohmann::json prediction_json(const plan::Prediction& p, const plan::ModelSpec& m) {
  nlohmann::json j{{"layout", p.layout.str()},
                   {"dp", p.layout.dp},
                   {"pp", p.layout.pp},
                   {"tp", p.layout.tp},
                   {"zero", p.layout.zero},
                   {"micro_batches", p.layout.micro_batches},
                   {"accumulate", p.layout.accumulate},
                   {"schedule", parallel::schedule_name(p.layout.schedule)},
                   {"recompute", p.layout.recompute},
                   {"batch", p.batch},
                   {"step_ms", p.step_s * 1e3},
                   {"compute_ms", p.compute_s * 1e3},
                   {"exposed_comm_ms", p.exposed_comm_s * 1e3},
                   {"bubble_ms", p.bubble_s * 1e3},
                   {"bubble_theory", p.bubble_theory},
                   {"memory", memory_json(p.memory)},
                   {"fits", p.fits},
                   {"single_device_ms", p.single_device_s * 1e3},
                   {"efficiency", p.efficiency},
                   {"samples_per_s", p.samples_per_s},
                   {"stages", nlohmann::json::array()}};
  if (m.tokens_per_sample > 0) j["tokens_per_s"] = p.samples_per_s * static_cast<double>(m.tokens_per_sample);
  for (const auto& s : p.stages) {
    j["stages"].push_back({{"blocks", {s.blocks.begin, s.blocks.end}},
                           {"compute_ms", s.sim.compute_s * 1e3},
                           {"tp_comm_ms", s.sim.tp_comm_s * 1e3},
                           {"pipeline_wait_ms", s.sim.pipeline_wait_s * 1e3},
                           {"dp_wait_ms", s.sim.dp_wait_s * 1e3},
                           {"gather_ms", s.sim.gather_s * 1e3},
                           {"end_ms", s.sim.end_s * 1e3},
                           {"in_flight", s.in_flight},
                           {"memory", memory_json(s.memory)}});
  }
  return j;
}

void print_prediction(const plan::Prediction& p, const plan::ModelSpec& m, const plan::Hardware& hw) {
  const plan::Layout& l = p.layout;
  const int64_t rows = p.batch / (l.dp * l.accumulate * l.micro_batches);
  std::printf("layout: %s; batch %ld (%ld per micro-batch per replica); stages %s\n", l.str().c_str(),
              static_cast<long>(p.batch), static_cast<long>(rows), ranges(p.stages).c_str());
  std::printf("step %s = compute %s + exposed comm %s + bubble %s (busiest stage)\n", time_str(p.step_s).c_str(),
              time_str(p.compute_s).c_str(), time_str(p.exposed_comm_s).c_str(), time_str(p.bubble_s).c_str());
  if (l.pp > 1) std::printf("bubble theory (p-1)/(m+p-1) = %.3f\n", p.bubble_theory);
  std::printf("%5s %7s %11s %11s %11s %11s %11s %10s %9s %12s\n", "stage", "blocks", "compute_ms", "tp_comm_ms",
              "bubble_ms", "dp_wait_ms", "gather_ms", "end_ms", "in_flight", "memory");
  for (size_t s = 0; s < p.stages.size(); ++s) {
    const auto& st = p.stages[s];
    std::printf("%5zu %3zu-%-3zu %11.2f %11.2f %11.2f %11.2f %11.2f %10.2f %9d %12s\n", s, st.blocks.begin,
                st.blocks.end - 1, st.sim.compute_s * 1e3, st.sim.tp_comm_s * 1e3, st.sim.pipeline_wait_s * 1e3,
                st.sim.dp_wait_s * 1e3, st.sim.gather_s * 1e3, st.sim.end_s * 1e3, st.in_flight,
                bytes_str(st.memory.total()).c_str());
  }
  const plan::Memory& mem = p.memory;
  std::printf(
      "memory per device: params %s + grads %s + optimizer %s + activations %s = %s%s\n", bytes_str(mem.params).c_str(),
      bytes_str(mem.grads).c_str(), bytes_str(mem.optimizer).c_str(), bytes_str(mem.activations).c_str(),
      bytes_str(mem.total()).c_str(),
      hw.memory > 0 ? fmt::format(" (limit {}{})", bytes_str(hw.memory), p.fits ? "" : ": DOES NOT FIT").c_str() : "");
  std::string rate = fmt::format("{:.1f} samples/s", p.samples_per_s);
  if (m.tokens_per_sample > 0) rate += fmt::format(" ({:.0f} tokens/s)", p.samples_per_s * m.tokens_per_sample);
  std::printf("throughput %s; E = T(1) / (n T(n)) = %.3f with n = %d, T(1) = %s\n", rate.c_str(), p.efficiency,
              l.world(), time_str(p.single_device_s).c_str());
}

// The ranking's first --top layouts, and the flags of the best.
void print_ranking(const PlanOptions& o, const plan::SearchResult& r) {
  std::printf("%4s  %-44s %10s %10s %10s %10s %7s\n", "rank", "layout", "step", "compute", "comm", "bubble", "E");
  for (size_t i = 0; i < r.ranked.size() && i < static_cast<size_t>(o.top); ++i) {
    const plan::Prediction& p = r.ranked[i];
    std::printf("%4zu  %-44s %10s %10s %10s %10s %7.3f  %s\n", i + 1, p.layout.str().c_str(),
                time_str(p.step_s).c_str(), time_str(p.compute_s).c_str(), time_str(p.exposed_comm_s).c_str(),
                time_str(p.bubble_s).c_str(), p.efficiency, bytes_str(p.memory.total()).c_str());
  }
  const plan::Prediction& best = r.ranked.front();
  std::printf("\nrecommended: --dp %d --pp %d --tp %d --zero %d --micro-batches %ld --accumulate %ld --schedule %s%s\n",
              best.layout.dp, best.layout.pp, best.layout.tp, best.layout.zero,
              static_cast<long>(best.layout.micro_batches), static_cast<long>(best.layout.accumulate),
              parallel::schedule_name(best.layout.schedule), best.layout.recompute ? " --recompute" : "");
}

// A GPT by parameter count (--params) rather than one of dtrain's models.
bool by_params(const PlanOptions& o) { return o.params > 0; }

// The options dtrain train does not check.
void check_plan_options(const PlanOptions& o) {
  DT_CHECK(o.params >= 0, "plan", "--params {} must be positive", o.params);
  DT_CHECK(o.top >= 1, "plan", "--top {} must be at least 1", o.top);
  DT_CHECK(o.flops_efficiency > 0 && o.flops_efficiency <= 1, "plan", "--flops-efficiency {} not in (0, 1]",
           o.flops_efficiency);
  DT_CHECK(o.link_efficiency > 0 && o.link_efficiency <= 1, "plan", "--link-efficiency {} not in (0, 1]",
           o.link_efficiency);
  DT_CHECK(o.device_flops >= 0 && o.link_gbps >= 0 && o.memory >= 0 && o.devices >= 0 && o.hosts >= 0 &&
               o.devices_per_host >= 0 && o.intra_gbps > 0,
           "plan",
           "--device-flops, --link-gbps, --memory, --devices, --hosts, --devices-per-host must not be "
           "negative and --intra-gbps must be positive");
  DT_CHECK(o.hosts == 0 || o.devices_per_host == 0, "plan", "give --hosts or --devices-per-host, not both");
  DT_CHECK(o.train.precision == "f32" || o.train.precision == "bf16", "plan", "--precision '{}': expected f32 or bf16",
           o.train.precision);
}

// The model: dtrain's (checked as dtrain train checks it) or a GPT by parameter count. Fills in
// the defaults of o.train that depend on which.
plan::ModelSpec plan_model(PlanOptions& o) {
  train::TrainConfig& cfg = o.train;
  const auto given = [&](const char* flag) { return cfg.given.count(flag) > 0; };
  plan::ModelSpec model;
  if (by_params(o)) {
    DT_CHECK(!given("model") || cfg.model == "gpt", "plan", "--params plans a GPT; --model {} has no such shape",
             cfg.model);
    cfg.model = "gpt";
    if (!given("seq-len")) cfg.seq_len = 2048;
    if (!given("batch-size")) cfg.batch_size = 1024;
    model = plan::gpt_by_params(o.params, cfg.seq_len, o.vocab > 0 ? o.vocab : 50304, given("layers") ? cfg.layers : 0,
                                given("width") ? cfg.width : 0, given("heads") ? cfg.heads : 0);
  } else {
    DT_CHECK(o.vocab == 0 || o.vocab == 256 || cfg.model != "gpt", "plan",
             "--vocab {}: dtrain's GPT reads bytes (vocab 256); other vocabularies go with --params", o.vocab);
    DT_CHECK(o.vocab == 0 || cfg.model == "gpt", "plan", "--vocab applies to --model gpt");
    train::TrainConfig probe = cfg;  // the model and run flags, checked by the trainer's rules
    probe.dp = probe.pp = probe.tp = 1;
    probe.zero = 0;
    probe.micro_batches = probe.accumulate = 1;
    probe.stages.clear();
    probe.min_workers = probe.max_restarts = 0;
    train::finalize(probe);
    cfg.batch_size = probe.batch_size;
    model = plan::model_of(cfg);
  }
  if (o.precision == "mixed" && !by_params(o)) {
    model.precision = plan::mixed_precision();
  } else if (o.precision == "f32" && by_params(o)) {
    model.precision = plan::f32_precision();
  }
  return model;
}

// The layout of dtrain train's flags.
plan::Layout layout_of(const train::TrainConfig& cfg) {
  plan::Layout layout;
  layout.dp = cfg.dp;
  layout.pp = cfg.pp;
  layout.tp = cfg.tp;
  layout.zero = cfg.zero;
  layout.micro_batches = cfg.micro_batches;
  layout.accumulate = cfg.accumulate;
  layout.schedule = parallel::parse_schedule(cfg.schedule);
  layout.recompute = cfg.recompute;
  layout.bucket_bytes = cfg.bucket_mb * kMiB;
  layout.optimizer = cfg.optimizer == "adamw" ? "adamw" : (cfg.momentum != 0.0f ? "sgd" : "sgd0");
  layout.optimizer_state = cfg.optimizer == "adamw" ? cfg.optimizer_state : "f32";
  return layout;
}

// The machine a plan is for: its figures, a line describing it, and (calibrated kernels) the
// measured block times of the layout and of one process alone (pointing into the calibration).
struct Target {
  plan::Hardware hw;
  std::string description;
  const plan::KernelEntry* kernels = nullptr;
  const plan::KernelEntry* single = nullptr;
};

// --device-flops: `world` devices of that rate with links of the given figures.
void describe_devices(const PlanOptions& o, int world, double gbps, Target& t) {
  plan::Hardware& hw = t.hw;
  DT_CHECK(!o.calibrate, "plan", "--calibrate measures this machine; it does not go with --device-flops");
  hw.device_flops = o.device_flops * o.flops_efficiency;
  hw.cores = o.cores < 0 ? 0.0 : o.cores;
  hw.intra = plan::LinkCost{o.intra_latency_us * 1e-6, 8.0 / (o.intra_gbps * 1e9), 0.0, 0.0, 0.0, false, true};
  const double lat = o.link_latency_us < 0 ? kDefaultLinkLatencyUs : o.link_latency_us;
  hw.inter = plan::LinkCost{lat * 1e-6, 8.0 / (gbps * 1e9 * o.link_efficiency), 0.0, 0.0, 0.0, false, true};
  hw.optimizer_s_per_param = kOptimizerBytesPerParam / kDeviceMemoryBandwidth;
  t.description = fmt::format(
      "{} devices of {:.3g} FLOP/s{}, {} per host; links {:.4g} Gbit/s ({} us) between hosts, "
      "{:.4g} Gbit/s ({} us) within",
      world, o.device_flops, o.flops_efficiency < 1 ? fmt::format(" at {:.0f}%", o.flops_efficiency * 100) : "",
      hw.ranks_per_host, gbps, lat, o.intra_gbps, o.intra_latency_us);
}

// This machine, from --calibration FILE or measured now (--calibrate, then kept in FILE).
void calibrate_machine(const PlanOptions& o, const plan::Layout& layout, bool searching,
                       const std::vector<std::string>& argv, plan::Calibration& cal) {
  if (!o.calibration.empty() && (!o.calibrate || std::ifstream(o.calibration).good())) {
    cal = plan::load_calibration(o.calibration);
  }
  DT_CHECK(o.calibrate || !o.calibration.empty(), "plan",
           "no compute rate: give --device-flops, or --calibrate to measure this machine (--calibration FILE to "
           "keep the measurements)");
  if (o.calibrate) {
    DT_CHECK(!by_params(o), "plan", "--calibrate times dtrain's own models; with --params give --device-flops");
    DT_CHECK(!searching, "plan", "--calibrate measures the kernels of one layout; give --dp/--pp/--tp");
    cal = calibrate(o.train, layout, o.train.batch_size, argv, cal);
    if (!o.calibration.empty()) plan::save_calibration(cal, o.calibration);
  }
}

// This machine as calibrated: its cores, its kernels' rate (or times for these blocks), shared
// memory within a host and TCP between hosts.
void describe_calibrated(const PlanOptions& o, const plan::Layout& layout, int world, double gbps, bool searching,
                         const plan::Calibration& cal, Target& t) {
  const train::TrainConfig& cfg = o.train;
  plan::Hardware& hw = t.hw;
  hw.device_flops = cal.flops_per_s * o.flops_efficiency;
  hw.cores = o.cores < 0 ? cal.cores : o.cores;
  hw.threads = cfg.threads;
  hw.optimizer_s_per_param = cal.optimizer_s_per_param;
  hw.copy_s_per_byte = cal.copy_s_per_byte;
  hw.intra = plan::LinkCost{
      cal.shm.alpha_s, 0.0, cal.shm.beta_s_per_byte, cal.gamma_s_per_byte, cal.copy_s_per_byte, true, false};
  const double lat = (o.link_latency_us < 0 ? 0.0 : o.link_latency_us) * 1e-6;
  const double tcp_cpu = o.link_cpu_ns_per_byte >= 0 ? o.link_cpu_ns_per_byte * 1e-9 : cal.tcp.beta_s_per_byte;
  hw.inter = plan::LinkCost{cal.tcp.alpha_s + lat,
                            gbps > 0 ? 8.0 / (gbps * 1e9 * o.link_efficiency) : 0.0,
                            tcp_cpu,
                            cal.gamma_s_per_byte,
                            cal.copy_s_per_byte,
                            false,
                            false};
  if (!by_params(o) && !searching) {
    const std::string meta = train::model_metadata(cfg);
    const int64_t rows = cfg.batch_size / (layout.dp * layout.accumulate * layout.micro_batches);
    const int threads = std::max(1, cfg.threads);
    const int concurrency = std::max(1, std::min(cal.cores, layout.world() * threads) / threads);
    t.kernels = cal.find(meta, rows, layout.tp, threads, concurrency);
    t.single = cal.find(meta, cfg.batch_size, 1, threads, 1);
  }
  t.description = fmt::format(
      "{} ranks on {:.3g} cores, {} per host; compute: {}; shared memory alpha {:.2f} us, beta {:.3f} ns/B; TCP "
      "alpha {:.1f} us, beta {:.3f} ns/B, {:.3f} ns/B of core time between hosts{}",
      world, hw.cores, hw.ranks_per_host,
      t.kernels ? "this machine's kernels for these blocks"
                : fmt::format("{:.3g} FLOP/s (calibrated)", hw.device_flops),
      cal.shm.alpha_s * 1e6, cal.shm.beta_s_per_byte * 1e9, hw.inter.alpha * 1e6, cal.tcp.beta_s_per_byte * 1e9,
      tcp_cpu * 1e9, gbps > 0 ? fmt::format(", host links {:.4g} Gbit/s", gbps) : std::string());
}

// The machine of the plan: --device-flops devices, or this one as calibrated (`cal` holds the
// calibration the target's kernel times point into).
Target target_machine(const PlanOptions& o, const plan::Layout& layout, int world, bool searching,
                      const std::vector<std::string>& argv, plan::Calibration& cal) {
  Target t;
  t.hw.memory = o.memory;
  // Default: this machine is one host; --device-flops devices each have a host (and link) of their own.
  t.hw.ranks_per_host = o.devices_per_host > 0 ? o.devices_per_host
                        : o.hosts > 0          ? world / o.hosts
                        : o.device_flops > 0   ? 1
                                               : world;
  const double gbps = o.link_gbps > 0 ? o.link_gbps : (o.device_flops > 0 ? kDefaultLinkGbps : 0.0);
  if (o.device_flops > 0) {
    describe_devices(o, world, gbps, t);
  } else {
    calibrate_machine(o, layout, searching, argv, cal);
    describe_calibrated(o, layout, world, gbps, searching, cal, t);
  }
  return t;
}

// One layout's prediction, as JSON or a table.
int print_plan(const PlanOptions& o, const plan::ModelSpec& model, const plan::Layout& layout, const Target& t) {
  const plan::Prediction p =
      plan::predict(model, t.hw, layout, o.train.batch_size, t.kernels ? &t.kernels->times : nullptr,
                    t.single ? &t.single->times : nullptr);
  if (o.json) {
    nlohmann::json j = prediction_json(p, model);
    j["model"] = model.description;
    j["params"] = model.params();
    j["machine"] = t.description;
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("dtrain plan: %s, %ld parameters, %s\n", model.description.c_str(), static_cast<long>(model.params()),
              model.precision.name.c_str());
  std::printf("machine: %s\n", t.description.c_str());
  print_prediction(p, model, t.hw);
  return 0;
}

// The search over the layouts of --devices: the ranking, as JSON or a table with the best
// layout's flags and prediction.
int print_search(const PlanOptions& o, const plan::ModelSpec& model, const plan::Layout& layout, const Target& t) {
  const int64_t batch = o.train.batch_size;
  plan::SearchOptions so;
  so.devices = o.devices;
  const plan::SearchResult r = plan::search(model, t.hw, batch, layout, so);
  if (o.json) {
    nlohmann::json j{{"model", model.description}, {"params", model.params()}, {"machine", t.description},
                     {"considered", r.considered}, {"too_big", r.too_big},     {"ranked", nlohmann::json::array()}};
    for (size_t i = 0; i < r.ranked.size() && i < static_cast<size_t>(o.top); ++i) {
      j["ranked"].push_back(prediction_json(r.ranked[i], model));
    }
    std::printf("%s\n", j.dump().c_str());
    return r.ranked.empty() ? 1 : 0;
  }
  std::printf("dtrain plan: %s, %ld parameters, %s; batch %ld\n", model.description.c_str(),
              static_cast<long>(model.params()), model.precision.name.c_str(), static_cast<long>(batch));
  std::printf("machine: %s%s\n", t.description.c_str(),
              o.memory > 0 ? fmt::format(", {} per device", bytes_str(o.memory)).c_str() : "");
  std::printf("%d layouts simulated, %d over the memory limit\n", r.considered, r.too_big);
  if (r.considered == 0) {
    std::printf(
        "no valid layout of %d devices: dp must divide --batch-size %ld, tp the heads (%ld) and width, pp at "
        "most the %zu blocks\n",
        o.devices, static_cast<long>(batch), static_cast<long>(model.heads), model.blocks.size());
    return 1;
  }
  if (r.ranked.empty()) {
    std::printf("no layout of %d devices fits %s per device\n", o.devices, bytes_str(o.memory).c_str());
    return 1;
  }
  print_ranking(o, r);
  print_prediction(r.ranked.front(), model, t.hw);
  return 0;
}

}  // namespace

void add_plan_options(CLI::App& app, PlanOptions& o) {
  train::add_train_options(app, o.train);
  app.add_option(
      "--params", o.params,
      "a GPT of about this many parameters in mixed precision (shape of the published model nearest in "
      "size unless --layers/--width/--heads; --seq-len 2048, --vocab 50304, --batch-size 1024 unless given)");
  app.add_option("--vocab", o.vocab, "GPT vocabulary (dtrain's GPT: 256 bytes; with --params: 50304)");
  app.add_option("--devices", o.devices,
                 "devices; without --dp/--pp/--tp: search their layouts for the fastest within --memory");
  app.add_option("--device-flops", o.device_flops,
                 "FLOP/s of one device (e.g. 9.9e14); without it the devices are this machine's cores, calibrated");
  app.add_option("--flops-efficiency", o.flops_efficiency, "fraction of --device-flops the kernels reach")
      ->capture_default_str();
  app.add_option("--cores", o.cores,
                 "compute units the ranks share (default: this machine's cores when calibrated, one per rank with "
                 "--device-flops)");
  app.add_option("--hosts", o.hosts, "hosts the ranks are spread over (consecutive ranks per host; default 1)");
  app.add_option("--devices-per-host", o.devices_per_host, "ranks per host (instead of --hosts)");
  app.add_option("--link-gbps", o.link_gbps,
                 "each host's link in Gbit/s (default: TCP as measured here; 400 with --device-flops)");
  app.add_option("--link-latency-us", o.link_latency_us,
                 "latency between hosts in us (default: TCP's measured here; 5 with --device-flops)");
  app.add_option("--link-efficiency", o.link_efficiency,
                 "payload fraction of the link's rate (default: TCP over Ethernet with MTU 1500, 1448/1514)")
      ->capture_default_str();
  app.add_option("--link-cpu-ns-per-byte", o.link_cpu_ns_per_byte,
                 "core time a byte sent between hosts costs, sender and receiver together (default: TCP's on "
                 "loopback, calibrated); hosts emulated on one machine share its cores with their network path");
  app.add_option("--intra-gbps", o.intra_gbps, "with --device-flops: bandwidth between devices of a host, Gbit/s")
      ->capture_default_str();
  app.add_option("--intra-latency-us", o.intra_latency_us, "with --device-flops: latency within a host, us")
      ->capture_default_str();
  app.add_option("--memory", o.memory, "bytes of memory per device (e.g. 80e9); 0: no limit")->capture_default_str();
  app.add_flag("--calibrate", o.calibrate,
               "measure this machine now: kernels of the model, optimizer, alpha/beta of shared memory and TCP");
  app.add_option("--calibration", o.calibration,
                 "calibration JSON: read it, or with --calibrate write the measurements into it");
  app.add_flag("--json", o.json, "print the prediction (or the ranking) as JSON");
  app.add_option("--top", o.top, "layouts to list when searching")->capture_default_str();
  app.add_option("--kernel-probe", o.kernel_probe)->group("");  // internal (calibrate)
  app.add_option("--kernel-probe-at", o.kernel_probe_at)->group("");
}

int run_plan(CLI::App& app, PlanOptions& o, const std::vector<std::string>& argv) {
  train::apply_config_file(app, o.train);
  check_plan_options(o);
  // dtrain train's --precision: bf16 is planned as mixed precision (bf16 products, activations and
  // gradients, f32 master weights and moments); not given: f32 for dtrain's models, mixed with --params.
  if (o.train.given.count("precision") > 0) o.precision = o.train.precision == "bf16" ? "mixed" : "f32";
  const plan::ModelSpec model = plan_model(o);
  train::TrainConfig& cfg = o.train;
  plan::Layout layout = layout_of(cfg);
  const auto given = [&](const char* flag) { return cfg.given.count(flag) > 0; };
  const bool explicit_layout = given("dp") || given("pp") || given("tp");
  const bool searching = o.devices > 0 && !explicit_layout;
  if (!searching) {
    DT_CHECK(o.devices == 0 || o.devices == layout.world(), "plan",
             "--devices {} but --dp {} x --pp {} x --tp {} = {} ranks", o.devices, layout.dp, layout.pp, layout.tp,
             layout.world());
    plan::check_layout(model, layout, cfg.batch_size);
    if (!cfg.stages.empty()) layout.stages = parallel::parse_stages(cfg.stages, model.blocks.size(), layout.pp);
  }
  if (!o.kernel_probe.empty()) {  // a copy started by calibrate()
    const int64_t rows = cfg.batch_size / (layout.dp * layout.accumulate * layout.micro_batches);
    write_file_atomic(o.kernel_probe, probe_kernels(cfg, rows, layout.tp, o.kernel_probe_at).dump() + "\n", "plan");
    return 0;
  }
  const int world = searching ? o.devices : layout.world();
  DT_CHECK(o.hosts <= world, "plan", "--hosts {} but only {} ranks", o.hosts, world);
  DT_CHECK(o.hosts == 0 || world % o.hosts == 0, "plan", "{} ranks do not split evenly over --hosts {}", world,
           o.hosts);
  plan::Calibration cal;
  const Target target = target_machine(o, layout, world, searching, argv, cal);
  return searching ? print_search(o, model, layout, target) : print_plan(o, model, layout, target);
}

}  // namespace dtrain::tools
