// dtrain plan: predicts a training step's time, the memory per device and the scaling
// efficiency of a parallel layout (data x pipeline x tensor parallelism, ZeRO, micro-batches,
// schedule) from a model's shape and a machine's figures, and recommends the fastest layout
// that fits a memory limit.
//
// How a prediction is made:
//   ModelSpec m = gpt_spec(...);                 // blocks: FLOPs, parameters, activation bytes
//   Hardware hw = ...;                           // compute rate, cores, links, memory
//   Prediction p = predict(m, hw, layout, batch); // builds the stages and simulates the step
// The pipeline stages are cut as the trainer cuts them (parallel::balance_stages); each stage's
// forward and backward take their blocks' FLOPs over the device's rate, or the measured kernel
// times (calibrate.h); tensor parallelism adds Megatron's all-reduces of the activations (two per
// block forward, two backward); data parallelism adds the gradient buckets (all_reduce, or under
// ZeRO reduce_scatter + all_gather); then simulate_step (simulate.h) plays the schedule.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/nn/models.h"
#include "dtrain/parallel/pipeline.h"
#include "dtrain/plan/cost.h"
#include "dtrain/plan/simulate.h"

namespace dtrain::plan {

/// One block of a model (the unit pipeline stages are cut between). Per sample.
struct BlockSpec {
  std::string name;
  double flops = 0.0;     // forward FLOPs
  double tp_flops = 0.0;  // of which tensor parallelism splits over its ranks
  int64_t params = 0;
  int64_t tp_params = 0;      // of which tensor parallelism shards
  double act_bytes = 0.0;     // activation bytes kept for backward, replicated over tp ranks
  double tp_act_bytes = 0.0;  // and sharded over them
  double out_bytes = 0.0;     // the output (an activation sent to the next stage)
  int tp_all_reduces = 0;     // all-reduces of the output size per forward (as many backward)
};

/// Bytes per parameter and per element by precision.
struct Precision {
  std::string name = "f32";
  double param_bytes = 4;   // a parameter as the model holds it
  double grad_bytes = 4;    // a gradient (and what data parallelism sends)
  double master_bytes = 0;  // an f32 copy of the parameters kept with the optimizer state
  double act_bytes = 4;     // an activation element
};
Precision f32_precision();
/// bf16 parameters, gradients and activations; f32 master weights and optimizer state.
Precision mixed_precision();

struct ModelSpec {
  std::string kind;  // mlp | gpt
  std::string description;
  std::vector<BlockSpec> blocks;
  int64_t tokens_per_sample = 0;  // 0: not text
  int64_t heads = 0;              // 0: no tensor parallelism possible
  int64_t width = 0;              // tensor parallelism also splits this (and 4 x this)
  Precision precision;
  int64_t params() const;
  /// Forward FLOPs per sample of the whole model.
  double flops_per_sample() const;
  std::vector<double> block_flops() const;
  std::vector<int64_t> block_params() const;
};

/// dtrain's MLP exactly as nn::Mlp builds it: in -> hidden... -> classes (f32).
ModelSpec mlp_spec(int64_t in, const std::vector<int64_t>& hidden, int64_t classes);
/// dtrain's GPT exactly as nn::Gpt builds it (f32, byte vocabulary of 256 by default):
/// embedding, `layers` pre-LayerNorm blocks, head. Activation bytes count what its autograd
/// keeps (see model.cpp).
ModelSpec gpt_spec(int64_t layers, int64_t width, int64_t heads, int64_t seq_len, int64_t vocab = 256);
/// A GPT of about `params` parameters in mixed precision, shaped like the published models
/// (width about 128 x layers, 128-wide heads); activations as in Korthikanti et al. 2022.
/// `layers`/`width`/`heads` > 0 override the derived shape.
ModelSpec gpt_by_params(double params, int64_t seq_len, int64_t vocab, int64_t layers = 0, int64_t width = 0,
                        int64_t heads = 0);

struct Hardware {
  double device_flops = 0.0;  // FLOP/s a device's kernels achieve (when no kernel times are given)
  double cores = 0.0;         // devices the ranks share (0: one each); each rank wants `threads` of them
  int threads = 1;
  int ranks_per_host = 1;              // ranks 0..G-1 on host 0, G..2G-1 on host 1, ...
  LinkCost intra;                      // between ranks of one host
  LinkCost inter;                      // between hosts: beta_wire is the host link's, shared by its flows
  double memory = 0.0;                 // bytes per device; 0: no limit
  double optimizer_s_per_param = 0.0;  // optimizer step and zeroing the gradients, per parameter
  double copy_s_per_byte = 0.0;        // a local memcpy (data parallelism copies gradients into buckets)
};

struct Layout {
  int dp = 1, pp = 1, tp = 1;
  int zero = 0;  // 0, 1 (optimizer state sharded), 2 (also gradients), 3 (also parameters, gathered per block)
  int64_t micro_batches = 1;
  int64_t accumulate = 1;
  parallel::Schedule schedule = parallel::Schedule::one_f_one_b;
  bool recompute = false;
  std::vector<nn::BlockRange> stages;  // empty: balanced like the trainer
  double bucket_bytes = 25.0 * (1 << 20);
  std::string optimizer = "adamw";      // adamw | sgd (momentum) | sgd0 (no momentum)
  std::string optimizer_state = "f32";  // AdamW's moments: f32 | int8 (block-wise 8-bit; ZeRO 0 only)
  int world() const { return dp * pp * tp; }
  std::string str() const;  // "dp 2 x pp 2 x tp 1, zero 1, 1f1b x 8"
};

/// Measured seconds of one micro-batch's forward and backward of every block on one rank, at the
/// layout's micro-batch size and tensor-parallel shard (calibrate.h); empty: from FLOPs.
struct KernelTimes {
  std::vector<double> forward, backward;
  bool empty() const { return forward.empty(); }
};

struct Memory {
  double params = 0, grads = 0, optimizer = 0, activations = 0;
  double total() const { return params + grads + optimizer + activations; }
};

struct StagePrediction {
  nn::BlockRange blocks;
  Memory memory;
  int in_flight = 0;  // micro-batches whose activations are alive at once
  SimStageResult sim;
};

struct Prediction {
  Layout layout;
  int64_t batch = 0;  // global batch, samples
  double step_s = 0.0;
  // The step as the busiest stage spends it: compute + exposed_comm + bubble = step_s (the bubble
  // includes waiting for transfers and, after the stage finished, for the other stages).
  double compute_s = 0.0, exposed_comm_s = 0.0, bubble_s = 0.0;
  double bubble_theory = 0.0;    // (p-1)/(m+p-1)
  Memory memory;                 // the largest stage's, per device
  bool fits = true;              // memory within Hardware::memory
  double single_device_s = 0.0;  // T(1): the whole step's model FLOPs (or kernels) on one device
  double efficiency = 0.0;       // E = T(1) / (n T(n))
  double samples_per_s = 0.0;
  std::vector<StagePrediction> stages;
};

/// Checks a layout against a model and batch (world, divisibility, heads, blocks); throws
/// dtrain::Error naming the flag and the values.
void check_layout(const ModelSpec& model, const Layout& layout, int64_t batch);
/// Predicts one step (see above). `kernels` (optional) replaces FLOP-based compute times;
/// `single` (optional) are the kernel times of one process on the whole batch, for T(1).
Prediction predict(const ModelSpec& model, const Hardware& hw, const Layout& layout, int64_t batch,
                   const KernelTimes* kernels = nullptr, const KernelTimes* single = nullptr);
/// predict() without the simulation when the memory does not fit (then fits is false, step_s 0).
Prediction predict_if_fits(const ModelSpec& model, const Hardware& hw, const Layout& layout, int64_t batch);

struct SearchOptions {
  int devices = 1;
  std::vector<int> zero = {0, 1, 2, 3};
  bool try_recompute = true;
  bool try_gpipe = false;
  int max_micro_batches = 64;
};

struct SearchResult {
  std::vector<Prediction> ranked;  // feasible layouts, fastest first
  int considered = 0;              // valid layouts simulated
  int too_big = 0;                 // of which over the memory limit
};
/// Every valid layout of `devices` (dp x pp x tp = devices, ZeRO stages, micro-batch counts,
/// recompute), ranked by step time among those that fit the memory limit.
SearchResult search(const ModelSpec& model, const Hardware& hw, int64_t batch, const Layout& base,
                    const SearchOptions& options);

}  // namespace dtrain::plan
