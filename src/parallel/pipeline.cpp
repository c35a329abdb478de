#include "dtrain/parallel/pipeline.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <map>

#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"

namespace dtrain::parallel {

namespace {

constexpr uint32_t kTagShape = 1;
constexpr uint32_t kTagData = 2;
constexpr size_t kMaxDims = 6;
constexpr int64_t kMaxElements = int64_t{1} << 34;

double seconds(comm::Clock::time_point a, comm::Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

Schedule parse_schedule(const std::string& name) {
  if (name == "gpipe") return Schedule::gpipe;
  if (name == "1f1b") return Schedule::one_f_one_b;
  DT_THROW("pipeline", "unknown schedule '{}' (expected gpipe or 1f1b)", name);
}

const char* schedule_name(Schedule schedule) { return schedule == Schedule::gpipe ? "gpipe" : "1f1b"; }

std::vector<PipeOp> pipeline_schedule(Schedule schedule, int stages, int stage, int micro) {
  DT_CHECK(stages > 0 && stage >= 0 && stage < stages && micro > 0, "pipeline",
           "schedule for stage {} of {} with {} micro-batches", stage, stages, micro);
  std::vector<PipeOp> ops;
  if (schedule == Schedule::gpipe) {
    for (int m = 0; m < micro; ++m) ops.push_back({true, m});
    for (int m = 0; m < micro; ++m) ops.push_back({false, m});
    return ops;
  }
  const int warmup = std::min(stages - stage - 1, micro);
  int f = 0, b = 0;
  for (; f < warmup; ++f) ops.push_back({true, f});
  while (f < micro) {
    ops.push_back({true, f++});
    ops.push_back({false, b++});
  }
  while (b < micro) ops.push_back({false, b++});
  return ops;
}

std::vector<nn::BlockRange> balance_stages(const std::vector<double>& flops, const std::vector<int64_t>& params,
                                           int stages) {
  const size_t n = flops.size();
  DT_CHECK(params.size() == n, "pipeline", "{} block costs but {} parameter counts", n, params.size());
  DT_CHECK(stages >= 1 && static_cast<size_t>(stages) <= n, "pipeline",
           "{} pipeline stages but the model has only {} blocks (each stage needs at least one)", stages, n);
  double total_f = 0.0, total_p = 0.0;
  for (size_t i = 0; i < n; ++i) {
    total_f += flops[i];
    total_p += static_cast<double>(params[i]);
  }
  std::vector<double> pf(n + 1, 0.0), pp(n + 1, 0.0);
  for (size_t i = 0; i < n; ++i) {
    pf[i + 1] = pf[i] + flops[i] / std::max(total_f, 1e-30);
    pp[i + 1] = pp[i] + static_cast<double>(params[i]) / std::max(total_p, 1e-30);
  }
  // Smallest largest-stage share of `share` over contiguous cuts, with every stage's compute
  // share at most `cap`; fills the cut points.
  const auto S = static_cast<size_t>(stages);
  auto solve = [&](const std::vector<double>& share, double cap, std::vector<nn::BlockRange>* out) {
    const double inf = std::numeric_limits<double>::infinity();
    // best[s][i]: the smallest largest stage of blocks [0, i) in s stages; cut[s][i] its last cut.
    std::vector<std::vector<double>> best(S + 1, std::vector<double>(n + 1, inf));
    std::vector<std::vector<size_t>> cut(S + 1, std::vector<size_t>(n + 1, 0));
    best[0][0] = 0.0;
    for (size_t s = 1; s <= S; ++s) {
      for (size_t i = s; i <= n; ++i) {
        for (size_t j = s - 1; j < i; ++j) {
          if (pf[i] - pf[j] > cap) continue;
          const double c = std::max(best[s - 1][j], share[i] - share[j]);
          // Ties go to the later cut, which leaves the last stage (which also holds the loss) lighter.
          if (c <= best[s][i]) {
            best[s][i] = c;
            cut[s][i] = j;
          }
        }
      }
    }
    if (out != nullptr) {
      out->assign(S, {});
      size_t end = n;
      for (size_t s = S; s >= 1; --s) {
        (*out)[s - 1] = {cut[s][end], end};
        end = cut[s][end];
      }
    }
    return best[S][n];
  };
  // Compute first (it sets the pipeline's pace), then, among cuts within 1% of the best
  // compute balance, the most even parameter memory.
  const double compute = solve(pf, std::numeric_limits<double>::infinity(), nullptr);
  std::vector<nn::BlockRange> out;
  solve(pp, compute * 1.01 + 1e-12, &out);
  return out;
}

std::vector<nn::BlockRange> parse_stages(const std::string& spec, size_t blocks, int stages) {
  std::vector<nn::BlockRange> out;
  size_t expect = 0;
  size_t at = 0;
  while (at <= spec.size()) {
    const size_t comma = std::min(spec.find(',', at), spec.size());
    const std::string part = spec.substr(at, comma - at);
    size_t a = 0, b = 0;
    const size_t dash = part.find('-');
    try {
      size_t used = 0;
      a = std::stoul(part.substr(0, dash), &used);
      DT_CHECK(used == (dash == std::string::npos ? part.size() : dash), "pipeline", "");
      b = a;
      if (dash != std::string::npos) {
        b = std::stoul(part.substr(dash + 1), &used);
        DT_CHECK(used == part.size() - dash - 1, "pipeline", "");
      }
    } catch (const std::exception&) {
      DT_THROW("pipeline", "--stages '{}': '{}' is not a block range like 0-3", spec, part);
    }
    DT_CHECK(a == expect && b >= a, "pipeline",
             "--stages '{}': stage {} is {}-{} but must start at block {} and not end before it", spec, out.size(), a,
             b, expect);
    out.push_back({a, b + 1});
    expect = b + 1;
    at = comma + 1;
  }
  DT_CHECK(expect == blocks, "pipeline", "--stages '{}' covers blocks 0-{} but the model has {} blocks (0-{})", spec,
           expect - 1, blocks, blocks - 1);
  DT_CHECK(out.size() == static_cast<size_t>(stages), "pipeline", "--stages '{}' has {} stages but --pp is {}", spec,
           out.size(), stages);
  return out;
}

struct Pipeline::Pending {
  comm::Work work;
  Tensor data;
  std::shared_ptr<std::array<int64_t, kMaxDims + 1>> header;
};

struct Pipeline::InFlight {
  Tensor input;   // received activation (a leaf that requires grad) or stage 0's inputs
  Tensor output;  // the stage's output (or the scaled loss on the last stage), with its graph
  Tensor targets;
  int64_t bytes = 0;
};

Pipeline::Pipeline(nn::Model& stage, comm::Group pp, PipelineOptions options)
    : model_(stage), pp_(std::move(pp)), options_(options) {
  DT_CHECK(options_.micro_batches >= 1, "pipeline", "--micro-batches {} must be at least 1", options_.micro_batches);
}

Pipeline::~Pipeline() {
  try {
    drain_sends();
  } catch (...) {
  }
}

void Pipeline::send_tensor(const Tensor& t, int peer, Shape* agreed) {
  Pending p;
  p.data = t.is_contiguous() ? t.detach() : t.detach().contiguous();
  const Shape& shape = p.data.shape();
  DT_CHECK(shape.size() <= kMaxDims, "pipeline", "stage {}: cannot send a {}-dimensional activation (at most {})",
           stage(), shape.size(), kMaxDims);
  if (!agreed->empty()) {
    DT_CHECK(*agreed == shape, "pipeline",
             "stage {}: an activation of shape {} for stage {}, which agreed on {} at the first micro-batch (every "
             "micro-batch of a run must have the same shape)",
             stage(), shape_str(shape), peer, shape_str(*agreed));
  } else {
    p.header = std::make_shared<std::array<int64_t, kMaxDims + 1>>();
    p.header->fill(0);
    (*p.header)[0] = static_cast<int64_t>(shape.size());
    for (size_t d = 0; d < shape.size(); ++d) (*p.header)[d + 1] = shape[d];
    pp_.send_async(p.header->data(), kMaxDims + 1, comm::DataType::i64, peer, kTagShape);
    *agreed = shape;
  }
  p.work = pp_.send_async(p.data.data(), static_cast<size_t>(p.data.numel()), comm::DataType::f32, peer, kTagData);
  sends_.push_back(std::move(p));
  // Forget the sends that finished (in order: a later one cannot finish before an earlier one
  // to the same peer, and holding a finished one a little longer is harmless).
  while (!sends_.empty() && sends_.front().work.test()) sends_.erase(sends_.begin());
}

Tensor Pipeline::recv_tensor(int peer, const char* what, Shape* agreed) {
  if (!agreed->empty()) {
    Tensor t = Tensor::empty(*agreed);
    pp_.recv(t.data(), static_cast<size_t>(t.numel()), comm::DataType::f32, peer, kTagData);
    return t;
  }
  std::array<int64_t, kMaxDims + 1> header{};
  pp_.recv(header.data(), header.size(), comm::DataType::i64, peer, kTagShape);
  const int64_t dims = header[0];
  DT_CHECK(dims >= 1 && dims <= static_cast<int64_t>(kMaxDims), "pipeline",
           "stage {} received a malformed {} header from stage {}: {} dimensions", stage(), what, peer, dims);
  Shape shape(header.begin() + 1, header.begin() + 1 + dims);
  int64_t numel = 1;
  for (int64_t s : shape) {
    DT_CHECK(s > 0 && s <= kMaxElements && numel <= kMaxElements / s, "pipeline",
             "stage {} received a malformed {} header from stage {}: shape {}", stage(), what, peer, shape_str(shape));
    numel *= s;
  }
  Tensor t = Tensor::empty(shape);
  pp_.recv(t.data(), static_cast<size_t>(numel), comm::DataType::f32, peer, kTagData);
  *agreed = shape;
  return t;
}

void Pipeline::drain_sends() {
  for (Pending& p : sends_) p.work.wait();
  sends_.clear();
}

double Pipeline::train_step(const std::function<std::pair<Tensor, Tensor>(int)>& micro_batch, float loss_scale,
                            const std::function<void(bool)>& before_backward, StageStats* stats,
                            const std::function<void(int)>& after_backward) {
  const int M = options_.micro_batches;
  const std::vector<PipeOp> ops = pipeline_schedule(options_.schedule, stages(), stage(), M);
  std::map<int, InFlight> live;
  StageStats st;
  const auto t0 = comm::Clock::now();
  const int64_t base = memory::live_bytes();
  memory::reset_peak();
  int64_t held = 0;
  double loss_sum = 0.0;
  int backwards = 0;

  auto stage_forward = [&](InFlight& f) {
    Tensor out = model_.forward(f.input);
    if (last()) {
      Tensor loss = model_.loss(out, f.targets);
      return loss;
    }
    return out;
  };

  for (const PipeOp& op : ops) {
    if (op.forward) {
      const int64_t before = memory::live_bytes();
      InFlight f;
      if (first() || last()) {
        auto batch = micro_batch(op.micro);
        if (first()) f.input = batch.first;
        if (last()) f.targets = batch.second;
      }
      if (!first()) {
        f.input = recv_tensor(stage() - 1, "activation", &shape_in_);
        f.input.set_requires_grad(true);
      }
      const auto a = comm::Clock::now();
      Tensor out;
      if (options_.recompute) {
        NoGradGuard no_grad;
        out = stage_forward(f);
      } else {
        out = stage_forward(f);
      }
      const auto b = comm::Clock::now();
      st.busy_s += seconds(a, b);
      st.spans.push_back({true, op.micro, a, b});
      if (last()) {
        loss_sum += static_cast<double>(out.item());
        if (!options_.recompute) f.output = out * loss_scale;
      } else {
        send_tensor(out, stage() + 1, &shape_out_);
        if (!options_.recompute) f.output = out;
      }
      f.bytes = memory::live_bytes() - before;
      held += f.bytes;
      live.emplace(op.micro, std::move(f));
      st.max_in_flight = std::max(st.max_in_flight, static_cast<int>(live.size()));
      st.activation_peak_bytes = std::max(st.activation_peak_bytes, held);
      continue;
    }
    auto it = live.find(op.micro);
    DT_CHECK(it != live.end(), "pipeline", "stage {}: backward of micro-batch {} before its forward", stage(),
             op.micro);
    InFlight& f = it->second;
    Tensor grad;
    // A gradient has the shape of the activation it belongs to: the link's agreed shape.
    if (!last()) grad = recv_tensor(stage() + 1, "gradient", &shape_out_);
    ++backwards;
    if (before_backward) before_backward(backwards == M);
    const auto a = comm::Clock::now();
    if (options_.recompute) {
      f.output = stage_forward(f);
      if (last()) f.output = f.output * loss_scale;
    }
    if (last()) {
      f.output.backward();
    } else {
      f.output.backward(grad);  // checks the shape: it is the one sent (send_tensor checked it)
    }
    const auto b = comm::Clock::now();
    st.busy_s += seconds(a, b);
    st.spans.push_back({false, op.micro, a, b});
    if (!first()) {
      Tensor g = f.input.grad();
      DT_CHECK(g.defined(), "pipeline", "stage {}: micro-batch {}'s input got no gradient", stage(), op.micro);
      send_tensor(g, stage() - 1, &shape_in_);
    }
    if (after_backward) after_backward(op.micro);
    held -= f.bytes;
    live.erase(it);
  }
  drain_sends();
  const auto t1 = comm::Clock::now();
  st.step_s = seconds(t0, t1);
  st.bubble = st.step_s > 0.0 ? std::max(0.0, 1.0 - st.busy_s / st.step_s) : 0.0;
  st.peak_bytes = memory::peak_bytes() - base;
  if (stats != nullptr) *stats = std::move(st);
  return last() ? loss_sum : 0.0;
}

Tensor Pipeline::forward_only(const Tensor& x) {
  NoGradGuard no_grad;
  // Evaluation batches may differ in shape: a header every time (a fresh, empty shape).
  Shape received;
  Tensor in = first() ? x : recv_tensor(stage() - 1, "activation", &received);
  Tensor out = model_.forward(in);
  if (last()) return out;
  Shape sent;
  send_tensor(out, stage() + 1, &sent);
  drain_sends();
  return Tensor();
}

}  // namespace dtrain::parallel
