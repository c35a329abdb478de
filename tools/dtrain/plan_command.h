// dtrain plan: the cost model's command line (plan_command.cpp).
#pragma once

#include <string>
#include <vector>

#include "dtrain/train/config.h"

namespace CLI {
class App;
}

namespace dtrain::tools {

struct PlanOptions {
  train::TrainConfig train;  // the model and layout, with dtrain train's flags and defaults
  double params = 0;         // > 0: a GPT of about this many parameters (mixed precision)
  int64_t vocab = 0;         // 0: 256 for dtrain's GPT, 50304 with --params
  int devices = 0;           // > 0 without --dp/--pp/--tp: search the layouts of this many devices
  double device_flops = 0;   // > 0: devices of this rate instead of this machine's kernels
  double flops_efficiency = 1.0;
  double cores = -1;  // < 0: this machine's (calibrated) or one per rank (--device-flops)
  int hosts = 0;      // 0: from --devices-per-host, else one (this machine) or one per device
  int devices_per_host = 0;
  double link_gbps = 0;  // host link; 0: not limited (TCP as measured) or 400 (--device-flops)
  double link_latency_us = -1;
  double link_efficiency = 1448.0 / 1514.0;
  double link_cpu_ns_per_byte = -1;  // < 0: TCP's as measured on loopback (calibrated)
  double intra_gbps = 7200;          // --device-flops: within a host (NVLink-class)
  double intra_latency_us = 3;
  double memory = 0;      // bytes per device; 0: no limit
  std::string precision;  // f32 | mixed, from dtrain train's --precision (bf16: mixed); empty: f32, mixed with --params
  bool calibrate = false;
  std::string calibration;  // calibration JSON to read (and, with --calibrate, to write)
  bool json = false;
  int top = 10;
  std::string kernel_probe;    // internal: measure the layout's kernels into this file and exit
  double kernel_probe_at = 0;  // internal: start then (seconds since the epoch)
};

/// Registers the plan flags (dtrain train's model and layout flags included) on `app`.
void add_plan_options(CLI::App& app, PlanOptions& opts);
/// Runs dtrain plan; `app` is the plan subcommand after parsing, `argv` the whole command line
/// (calibration runs copies of it).
int run_plan(CLI::App& app, PlanOptions& opts, const std::vector<std::string>& argv);

}  // namespace dtrain::tools
