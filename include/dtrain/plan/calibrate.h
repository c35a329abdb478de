// Calibration of the planner on this machine: the time of dtrain's own kernels for a model's
// blocks, the optimizer's time per parameter, and (measured by `dtrain bench collectives
// --model`, see tools/dtrain/plan_command.cpp) alpha, beta and gamma of shared memory and TCP.
// Saved as JSON (format "dtrain-plan-calibration", version 1) so that a plan can reuse them.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/plan/plan.h"
#include "dtrain/train/config.h"

namespace dtrain::plan {

/// The model of a training configuration (--model mlp / gpt and their shape flags).
ModelSpec model_of(const train::TrainConfig& cfg);

/// Kernel times of one model at one micro-batch size and tensor-parallel shard.
struct KernelEntry {
  std::string model;  // train::model_metadata() of the configuration
  int64_t rows = 0;   // samples per micro-batch
  int tp = 1;
  int threads = 1;
  int concurrency = 1;  // processes that measured at once (all busy cores: their shared caches and memory)
  KernelTimes times;
  std::vector<double> act_bytes;  // per block: bytes the allocator held after its forward
};

/// Times, in this process, forward and backward of every block of cfg's model for one
/// micro-batch of `rows` samples, its transformer blocks at the shapes of one of `tp`
/// tensor-parallel shards (the collectives left out): the median of `repeats` after a warm-up.
KernelEntry measure_kernels(const train::TrainConfig& cfg, int64_t rows, int tp, int repeats = 9);
/// Seconds per parameter of cfg's optimizer step and zeroing the gradients.
double measure_optimizer(const train::TrainConfig& cfg, int64_t params);

struct LinkFigures {
  double alpha_s = 0.0, beta_s_per_byte = 0.0;
};

struct Calibration {
  int cores = 0;
  LinkFigures shm, tcp;           // ping-pong between two local processes
  double gamma_s_per_byte = 0.0;  // f32 sum
  double copy_s_per_byte = 0.0;   // memcpy, one core
  double flops_per_s = 0.0;       // forward + backward FLOPs over their time, for models without kernel times
  double optimizer_s_per_param = 0.0;
  std::vector<KernelEntry> kernels;
  /// The entry for a model, micro-batch size, shard, threads and concurrency, if measured.
  const KernelEntry* find(const std::string& model, int64_t rows, int tp, int threads, int concurrency) const;
  /// Adds or replaces the entry of the same key.
  void put(KernelEntry entry);
};

nlohmann::json to_json(const Calibration& c);
/// Throws dtrain::Error naming `where` when the format, version or a field is wrong.
Calibration calibration_from_json(const nlohmann::json& j, const std::string& where);
Calibration load_calibration(const std::string& path);
void save_calibration(const Calibration& c, const std::string& path);

}  // namespace dtrain::plan
