// A discrete-event simulation of one training step of a pipeline of stages: the order of
// forwards and backwards of parallel::pipeline_schedule (gpipe or 1f1b), activations and
// gradients travelling between stages, tensor-parallel all-reduces after each forward and
// backward, data-parallel gradient buckets that start during the step's last backward and
// overlap it, the optimizer and (ZeRO) the parameter all-gather.
//
// Vocabulary: a stage is one pipeline stage as executed by its tp x dp ranks, which run in
// lockstep (they are symmetric, so one is simulated and `demand` counts them all). Compute is
// work in core-seconds; when the computing ranks of all stages want more cores than there are
// (`cores`), they share them equally (processor sharing), which is how 8 processes on 2 cores
// behave. A stage has two lanes: the main lane runs its program; the dp lane runs the gradient
// buckets one after another, concurrently with the main lane. Time on the main lane is
// accounted as compute, tensor-parallel communication, pipeline wait (the bubble: waiting for a
// neighbour's activation or gradient, transfers included), data-parallel wait (buckets still
// running after backward), or the ZeRO all-gather. A communication waits its latency, then its
// wire time (on host links shared by the flows running at once) and its cpu work (on the shared
// cores) run together.
#pragma once

#include <vector>

#include "dtrain/parallel/pipeline.h"
#include "dtrain/plan/cost.h"

namespace dtrain::plan {

struct SimStage {
  double forward = 0.0;              // core-seconds of one micro-batch's forward (recompute: without the graph)
  double backward = 0.0;             // and of its backward (recompute: the forward again included)
  Cost forward_comm, backward_comm;  // per micro-batch, after its compute (tensor parallelism)
  Cost send_forward;                 // one activation to the next stage
  Cost send_backward;                // one gradient to the previous stage
  /// The step's last backward in parts (blocks, in backward order; fractions of `backward`
  /// summing to 1). Empty: one part.
  std::vector<double> backward_parts;
  /// Data-parallel gradient buckets in launch order: bucket k starts once part `ready_after[k]`
  /// of the last backward is done.
  std::vector<Cost> buckets;
  std::vector<int> ready_after;
  double bucket_copy = 0.0;  // core-seconds the synchronising backward spends copying gradients into buckets
  double optimizer = 0.0;    // core-seconds of the optimizer step (and gradient bookkeeping)
  Cost after_optimizer;      // ZeRO: all-gather of the updated parameters
  double demand = 1.0;       // cores the stage's ranks want while computing (tp x dp x threads)
  /// Per host, how many flows over its link the stage's data-parallel (buckets, all-gather) and
  /// tensor-parallel communication puts there at once (all replicas and shards of the stage).
  /// Concurrent flows share a link: an activity's wire time runs at 1 / the most flows on a link
  /// it uses. Empty or zero: no shared link (within a host).
  std::vector<int> dp_flows, tp_flows;
};

struct SimConfig {
  std::vector<SimStage> stages;
  int micro_batches = 1;
  int accumulate = 1;  // pipeline flushes per step; gradients synchronise in the last
  parallel::Schedule schedule = parallel::Schedule::one_f_one_b;
  double cores = 0.0;  // cores shared by all ranks; 0: every rank has its own
};

struct SimStageResult {
  double end_s = 0.0;            // when the stage finished its step
  double compute_s = 0.0;        // in forward, backward and optimizer compute (slowed by sharing)
  double tp_comm_s = 0.0;        // in tensor-parallel all-reduces
  double pipeline_wait_s = 0.0;  // waiting for a neighbour (bubble and transfers)
  double dp_wait_s = 0.0;        // waiting for gradient buckets after backward
  double gather_s = 0.0;         // ZeRO parameter all-gather
  double busy_s = 0.0;           // forward and backward only: the pipeline bench's busy time
};

struct SimResult {
  double step_s = 0.0;  // the last stage to finish
  int critical = 0;     // which stage that is
  std::vector<SimStageResult> stages;
};

/// Simulates one step. Throws dtrain::Error on an empty or inconsistent configuration.
SimResult simulate_step(const SimConfig& config);

}  // namespace dtrain::plan
