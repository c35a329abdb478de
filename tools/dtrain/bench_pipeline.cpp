// dtrain bench pipeline: the pipeline engine's bubble with exactly balanced stages whose compute
// runs on an emulated device.
//
// Each stage is a chain of blocks whose forward and backward hold the stage for a fixed time
// (the host waiting for an accelerator's kernel), so a stage's cost is exact and the P stage
// processes need no CPU while they "compute": P stages behave as on P devices even on a host
// with fewer cores. Everything else is the real engine: the schedule, the activation and
// gradient messages (--payload floats per micro-batch through the real transport), the
// bookkeeping. The measured bubble is 1 - compute / step time per stage (the metric `dtrain
// train` reports), printed next to the ideal (P-1)/(M+P-1).
#include <sys/prctl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <thread>

#include "commands.h"
#include "dtrain/comm/group.h"
#include "dtrain/core/error.h"
#include "dtrain/parallel/mesh.h"
#include "dtrain/parallel/pipeline.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/ops.h"

namespace dtrain::tools {

namespace {

using std::chrono::microseconds;

// Holds the thread for `us`: the host waiting on a device. A timed sleep (so that P stages on
// fewer cores do not compete for them; the worker sets a 1 ns timer slack) to shortly before
// the deadline, then yielding until it, so that a late wake-up does not stretch the stage.
void device_wait(int64_t us) {
  const auto deadline = std::chrono::steady_clock::now() + microseconds(us);
  std::this_thread::sleep_until(deadline - microseconds(std::min<int64_t>(us, 150)));
  while (std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
}

class DeviceWaitNode : public Node {
 public:
  explicit DeviceWaitNode(int64_t us) : us_(us) {}
  std::vector<Tensor> apply(const Tensor& grad_output) override {
    device_wait(us_);
    return {grad_output};
  }
  const char* name() const override { return "DeviceWait"; }

 private:
  int64_t us_;
};

// out = x * w, then the device time; backward: the device time, then the product's gradient.
class EmulatedBlock : public nn::Module {
 public:
  EmulatedBlock(int64_t forward_us, int64_t backward_us) : forward_us_(forward_us), backward_us_(backward_us) {
    w_ = register_parameter("w", Tensor::ones({1}));
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = ops::mul(x, w_);
    device_wait(forward_us_);
    Tensor out = y.detach().clone();
    if (autograd::needs_grad({&y})) autograd::attach(out, std::make_shared<DeviceWaitNode>(backward_us_), {&y});
    return out;
  }

 private:
  int64_t forward_us_, backward_us_;
  Tensor w_;
};

class EmulatedModel : public nn::Model {
 public:
  EmulatedModel(int blocks, int64_t forward_us, int64_t backward_us) : blocks_(blocks) {
    for (int i = 0; i < blocks; ++i)
      add("b" + std::to_string(i), std::make_shared<EmulatedBlock>(forward_us, backward_us));
  }
  Tensor loss(const Tensor& output, const Tensor& /*targets*/) const override { return ops::mean(output); }
  std::string kind() const override { return "emulated"; }
  double flops_per_sample() const override { return 0.0; }
  std::vector<double> block_flops() const override { return std::vector<double>(static_cast<size_t>(blocks_), 1.0); }
  std::vector<int64_t> block_params() const override { return std::vector<int64_t>(static_cast<size_t>(blocks_), 1); }

 private:
  int blocks_;
};

int worker(const PipeBenchOptions& o) {
  ::prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
  // The pipeline group as dtrain train makes it (the mesh's pp axis, with its wait policy).
  comm::Group world = comm::Group::from_env();
  const int P = world.size();
  parallel::Mesh mesh(world, parallel::MeshShape{1, P, 1});
  comm::Group& pp = mesh.pp();
  parallel::PipelineOptions po;
  po.schedule = parallel::parse_schedule(o.schedule);
  po.micro_batches = o.micro_batches;
  EmulatedModel stage(o.blocks_per_stage, o.forward_us / o.blocks_per_stage, o.backward_us / o.blocks_per_stage);
  parallel::Pipeline pipe(stage, pp, po);
  auto micro = [&](int) { return std::make_pair(Tensor::ones({o.payload}), Tensor()); };
  double step = 0.0, busy = 0.0;
  parallel::StageStats st;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    pipe.train_step(micro, 1.0f / static_cast<float>(o.micro_batches), nullptr, &st);
    stage.zero_grad();
    if (s >= o.warmup) {
      step += st.step_s;
      busy += st.busy_s;
    }
  }
  std::vector<double> mine{step, busy}, all(2 * static_cast<size_t>(P));
  pp.all_gather(mine.data(), all.data(), 2, comm::DataType::f64);
  // Hand-off latency in the last step: from the end of an op on one stage to the start of the
  // op it feeds on the neighbour (F(m) on s -> F(m) on s+1, B(m) on s+1 -> B(m) on s), counted
  // only where the neighbour was idle waiting for it. Clocks: CLOCK_MONOTONIC, one per host.
  const size_t n_ops = 2 * static_cast<size_t>(o.micro_batches);
  std::vector<double> spans(4 * n_ops), all_spans(4 * n_ops * static_cast<size_t>(P));
  for (size_t i = 0; i < st.spans.size() && i < n_ops; ++i) {
    const auto& sp = st.spans[i];
    spans[4 * i] = sp.forward ? 1.0 : 0.0;
    spans[4 * i + 1] = sp.micro;
    spans[4 * i + 2] = std::chrono::duration<double>(sp.start.time_since_epoch()).count();
    spans[4 * i + 3] = std::chrono::duration<double>(sp.end.time_since_epoch()).count();
  }
  pp.all_gather(spans.data(), all_spans.data(), spans.size(), comm::DataType::f64);
  std::vector<double> handoff;
  auto op_of = [&](int rank, bool fwd, int m, double* start, double* end, double* prev_end) {
    for (size_t i = 0; i < n_ops; ++i) {
      const double* e = &all_spans[(static_cast<size_t>(rank) * n_ops + i) * 4];
      if ((e[0] == 1.0) == fwd && static_cast<int>(e[1]) == m) {
        *start = e[2];
        *end = e[3];
        *prev_end = i > 0 ? e[-1] : 0.0;
        return;
      }
    }
  };
  for (int r = 0; r + 1 < P; ++r) {
    for (int m = 0; m < o.micro_batches; ++m) {
      double s0 = 0, e0 = 0, p0 = 0, s1 = 0, e1 = 0, p1 = 0;
      op_of(r, true, m, &s0, &e0, &p0);
      op_of(r + 1, true, m, &s1, &e1, &p1);
      if (p1 < e0) handoff.push_back(s1 - e0);
      op_of(r + 1, false, m, &s1, &e1, &p1);
      op_of(r, false, m, &s0, &e0, &p0);
      if (p0 < e1) handoff.push_back(s0 - e1);
    }
  }
  std::sort(handoff.begin(), handoff.end());
  const double handoff_us = handoff.empty() ? 0.0 : handoff[handoff.size() / 2] * 1e6;
  if (pp.rank() == 0) {
    const double M = o.micro_batches;
    const double theory = (P - 1) / (M + P - 1);
    nlohmann::json doc{{"stages", P},
                       {"micro_batches", o.micro_batches},
                       {"schedule", o.schedule},
                       {"forward_us", o.forward_us},
                       {"backward_us", o.backward_us},
                       {"payload", o.payload},
                       {"theory", theory}};
    double mean = 0.0;
    std::printf(
        "# %d stages, %d micro-batches, %s, stage forward %ld us + backward %ld us (emulated device), %ld "
        "floats per message, %d steps\n",
        P, o.micro_batches, o.schedule.c_str(), static_cast<long>(o.forward_us), static_cast<long>(o.backward_us),
        static_cast<long>(o.payload), o.steps);
    std::printf("%6s %12s %12s %8s\n", "stage", "step_ms", "compute_ms", "bubble");
    for (int r = 0; r < P; ++r) {
      const double st = all[2 * static_cast<size_t>(r)] / o.steps, bu = all[2 * static_cast<size_t>(r) + 1] / o.steps;
      const double bubble = 1.0 - bu / st;
      mean += bubble / P;
      doc["stage_bubble"].push_back(bubble);
      doc["step_ms"].push_back(st * 1e3);
      std::printf("%6d %12.3f %12.3f %8.4f\n", r, st * 1e3, bu * 1e3, bubble);
    }
    doc["mean_bubble"] = mean;
    doc["handoff_us_p50"] = handoff_us;
    std::printf("# hand-off latency (op end -> dependent op start on a waiting neighbour), median of %zu: %.1f us\n",
                handoff.size(), handoff_us);
    std::printf("# mean bubble %.4f, ideal (P-1)/(M+P-1) = %.4f, %+.1f%%\n", mean, theory,
                100.0 * (mean - theory) / theory);
    if (o.json) std::printf("%s\n", doc.dump().c_str());
  }
  pp.barrier();
  return 0;
}

}  // namespace

int run_bench_pipeline(const PipeBenchOptions& o, const std::vector<std::string>& argv) {
  DT_CHECK(o.stages >= 1 && o.stages <= 64, "bench", "--stages {}: expected 1..64", o.stages);
  DT_CHECK(o.micro_batches >= 1 && o.steps >= 1 && o.warmup >= 0, "bench",
           "--micro-batches, --steps must be at least 1 and --warmup at least 0");
  DT_CHECK(o.blocks_per_stage >= 1 && o.forward_us >= 0 && o.backward_us >= 0 && o.payload >= 1, "bench",
           "--blocks, --forward-us, --backward-us and --payload must be positive");
  if (std::getenv("RANK") != nullptr) return worker(o);
  return launch_self(o.stages, argv, false);
}

}  // namespace dtrain::tools
