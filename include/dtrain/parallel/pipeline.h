// Pipeline parallelism: a model cut into stages of consecutive blocks, one stage per rank of a
// pipeline group, micro-batches flowing forward through the stages and gradients flowing back.
//
// How a step goes on stage s of P (the trainer, or your own loop):
//   Pipeline pipe(stage_model, pp_group, {schedule, M});
//   double loss = pipe.train_step(micro_batch, 1.0 / M, before_backward, &stats);
//   optimizer.step(); zero the gradients
// The stage runs the forwards F(m) and backwards B(m) of the M micro-batches in the order of
// pipeline_schedule(): gpipe (all forwards, then all backwards) or 1f1b (P - s - 1 warm-up
// forwards, then alternately one forward and one backward, then the remaining backwards: at most
// P - s micro-batches of activations alive). Stage 0 reads each micro-batch's inputs, the last
// stage its targets and computes the loss (times loss_scale); the gradients a stage accumulates
// over the M backwards are those of the single process on the whole batch.
//
// Messages: the first training activation between two stages goes as a shape header and the
// data, which fixes the shape for the run (a later activation of another shape is an error);
// after it, activations go as data only, and a gradient always does (it has the shape agreed
// for the activation it belongs to). forward_only (evaluation) sends a header every time. Sends are
// asynchronous (completed before train_step returns); receives block with the group's timeout.
// Between two stages the messages of one direction arrive in micro-batch order, so no tags
// beyond the kind are needed.
//
// Recompute (options.recompute): a forward keeps only its input; the backward runs the forward
// again with the graph, then the backward (activation memory of one micro-batch per stage).
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/group.h"
#include "dtrain/nn/models.h"

namespace dtrain::parallel {

enum class Schedule { gpipe, one_f_one_b };
/// "gpipe" or "1f1b"; anything else is an error naming the value.
Schedule parse_schedule(const std::string& name);
const char* schedule_name(Schedule schedule);

struct PipeOp {
  bool forward = true;
  int micro = 0;
};
/// The order stage `stage` of `stages` runs the forwards and backwards of `micro` micro-batches.
std::vector<PipeOp> pipeline_schedule(Schedule schedule, int stages, int stage, int micro);

/// Contiguous stages over blocks with the given forward FLOPs and parameter counts: the cut that
/// minimises the largest stage's FLOPs and, among cuts within 1% of that, the largest stage's
/// parameters. Error when stages > blocks.
std::vector<nn::BlockRange> balance_stages(const std::vector<double>& flops, const std::vector<int64_t>& params,
                                           int stages);
/// Stages by hand, "0-3,4-7" (inclusive block indices; "5" is one block): must cover all
/// `blocks` blocks in order, one range per stage.
std::vector<nn::BlockRange> parse_stages(const std::string& spec, size_t blocks, int stages);

struct PipelineOptions {
  Schedule schedule = Schedule::one_f_one_b;
  int micro_batches = 1;
  bool recompute = false;
};

/// One forward or backward of one micro-batch, for traces.
struct PipeSpan {
  bool forward = true;
  int micro = 0;
  comm::Clock::time_point start, end;
};

/// What one train_step did on this stage.
struct StageStats {
  double step_s = 0.0;                // wall time of the forwards and backwards, receives and sends
  double busy_s = 0.0;                // in forward and backward compute
  double bubble = 0.0;                // 1 - busy / step: the stage's idle fraction
  int max_in_flight = 0;              // most micro-batches whose activations were alive at once
  int64_t activation_peak_bytes = 0;  // most bytes held by in-flight micro-batches at once
  int64_t peak_bytes = 0;             // the allocator's peak during the step above its start
  std::vector<PipeSpan> spans;
};

class Pipeline {
 public:
  /// `stage` holds this rank's blocks; the rank's place in `pp` is its stage index.
  Pipeline(nn::Model& stage, comm::Group pp, PipelineOptions options);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  int stage() const { return pp_.rank(); }
  int stages() const { return pp_.size(); }
  bool first() const { return stage() == 0; }
  bool last() const { return stage() + 1 == stages(); }
  const PipelineOptions& options() const { return options_; }

  /// One step's forwards and backwards. micro_batch(m) returns micro-batch m's (inputs, targets):
  /// the first stage uses the inputs, the last the targets. before_backward(last) runs before each
  /// backward, `last` true for the step's final one (data parallelism syncs there). Returns the
  /// sum over micro-batches of the unscaled losses on the last stage, 0 on the others.
  /// after_backward(m), when given, runs after micro-batch m's backward on this stage (exact
  /// gradient sums take each micro-batch's gradients there).
  double train_step(const std::function<std::pair<Tensor, Tensor>(int)>& micro_batch, float loss_scale,
                    const std::function<void(bool)>& before_backward, StageStats* stats = nullptr,
                    const std::function<void(int)>& after_backward = {});

  /// Forward only, no graph (evaluation): stage 0 takes `x`, the others receive. Returns the
  /// model's output on the last stage, an undefined tensor on the others.
  Tensor forward_only(const Tensor& x);

 private:
  struct InFlight;
  struct Pending;
  // `agreed`, the link's shape: empty: a shape header goes first and fills it; set: data only,
  // of that shape (a send of another shape is an error). Gradients use the activation's link.
  Tensor recv_tensor(int peer, const char* what, Shape* agreed);
  void send_tensor(const Tensor& t, int peer, Shape* agreed);
  void drain_sends();

  nn::Model& model_;
  comm::Group pp_;
  PipelineOptions options_;
  std::vector<Pending> sends_;
  Shape shape_in_, shape_out_;  // training activations' shapes, agreed at the first micro-batch
};

}  // namespace dtrain::parallel
