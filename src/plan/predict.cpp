// From a model, a machine and a layout to the simulated step (plan.h).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "dtrain/core/error.h"
#include "dtrain/plan/plan.h"

namespace dtrain::plan {

std::string Layout::str() const {
  std::string s = fmt::format("dp {} x pp {} x tp {}", dp, pp, tp);
  if (zero > 0) s += fmt::format(", zero {}", zero);
  if (pp > 1) s += fmt::format(", {} x {}", parallel::schedule_name(schedule), micro_batches);
  if (accumulate > 1) s += fmt::format(", accumulate {}", accumulate);
  if (recompute) s += ", recompute";
  return s;
}

void check_layout(const ModelSpec& model, const Layout& l, int64_t batch) {
  DT_CHECK(l.dp >= 1 && l.pp >= 1 && l.tp >= 1, "plan", "--dp {} x --pp {} x --tp {}: each must be at least 1", l.dp,
           l.pp, l.tp);
  DT_CHECK(l.zero >= 0 && l.zero <= 2, "plan", "--zero {}: expected 0, 1 or 2", l.zero);
  DT_CHECK(l.zero == 0 || l.dp > 1, "plan", "--zero {} shards over data-parallel ranks: it needs --dp 2 or more",
           l.zero);
  DT_CHECK(l.micro_batches >= 1 && l.accumulate >= 1, "plan",
           "--micro-batches {} and --accumulate {} must be at least 1", l.micro_batches, l.accumulate);
  DT_CHECK(l.micro_batches == 1 || l.pp > 1, "plan",
           "--micro-batches {} needs pipeline stages (--pp 2 or more); without them use --accumulate", l.micro_batches);
  DT_CHECK(batch > 0, "plan", "--batch-size must be positive, got {}", batch);
  const int64_t per_step = l.dp * l.accumulate * l.micro_batches;
  DT_CHECK(batch % per_step == 0, "plan",
           "--batch-size {} is not divisible by --dp {} x --accumulate {} x --micro-batches {} = {}: every rank and "
           "micro-batch must get the same number of samples",
           batch, l.dp, l.accumulate, l.micro_batches, per_step);
  const int64_t blocks = static_cast<int64_t>(model.blocks.size());
  DT_CHECK(l.pp <= blocks, "plan", "--pp {} stages but the {} model has only {} blocks to cut between", l.pp,
           model.kind, blocks);
  DT_CHECK(l.stages.empty() || static_cast<int>(l.stages.size()) == l.pp, "plan", "{} stage ranges for --pp {}",
           l.stages.size(), l.pp);
  if (l.tp > 1) {
    DT_CHECK(model.heads > 0, "plan", "--tp {}: tensor parallelism splits the GPT's attention and MLP; the {} has none",
             l.tp, model.kind);
    DT_CHECK(model.heads % l.tp == 0, "plan", "--heads {} is not divisible by --tp {}: each rank takes whole heads",
             model.heads, l.tp);
    DT_CHECK(model.width % l.tp == 0, "plan", "--width {} is not divisible by --tp {}", model.width, l.tp);
  }
  DT_CHECK(l.optimizer == "adamw" || l.optimizer == "sgd" || l.optimizer == "sgd0", "plan",
           "optimizer '{}': expected adamw, sgd or sgd0", l.optimizer);
  DT_CHECK(l.bucket_bytes > 0, "plan", "--bucket-mb must be positive");
}

namespace {

// Which link each axis's communication uses, and how many flows share a host's link at once.
struct AxisLink {
  LinkCost link;
  bool crosses = false;
};

struct Links {
  AxisLink tp, pp, dp;
};

int mesh_rank(const Layout& l, int d, int s, int t) { return (d * l.pp + s) * l.tp + t; }

AxisLink axis_link(const Hardware& hw, bool crosses, int flows) {
  AxisLink a;
  a.crosses = crosses;
  a.link = crosses ? hw.inter : hw.intra;
  if (crosses) a.link.beta_wire *= std::max(1, flows);
  return a;
}

Links links_of(const Hardware& hw, const Layout& l) {
  const int g = std::max(1, hw.ranks_per_host);
  auto host = [&](int r) { return r / g; };
  const int hosts = (l.world() + g - 1) / g;
  // flows[h]: per host, the most concurrent crossing flows of one operation.
  std::vector<int> tp_flows(static_cast<size_t>(hosts), 0), pp_flows, dp_flows;
  bool tp_cross = false, pp_cross = false, dp_cross = false;
  for (int d = 0; d < l.dp; ++d) {
    for (int s = 0; s < l.pp; ++s) {
      const int first = mesh_rank(l, d, s, 0), last = mesh_rank(l, d, s, l.tp - 1);
      if (host(first) == host(last)) continue;
      tp_cross = true;
      for (int h = host(first); h <= host(last); ++h) ++tp_flows[static_cast<size_t>(h)];
    }
  }
  int tp_max = 0, pp_max = 0, dp_max = 0;
  for (int f : tp_flows) tp_max = std::max(tp_max, f);
  // Pipeline sends from stage s to s + 1 run at once on the tp x dp ranks of stage s.
  for (int s = 0; s + 1 < l.pp; ++s) {
    std::vector<int> out(static_cast<size_t>(hosts), 0);
    for (int d = 0; d < l.dp; ++d) {
      for (int t = 0; t < l.tp; ++t) {
        const int r = mesh_rank(l, d, s, t), n = mesh_rank(l, d, s + 1, t);
        if (host(r) == host(n)) continue;
        pp_cross = true;
        pp_max = std::max(pp_max, ++out[static_cast<size_t>(host(r))]);
      }
    }
  }
  // Gradient all-reduces of one stage run at once over its tp shards' groups; a ring group
  // whose ranks on a host are consecutive adds one flow to that host's link.
  for (int s = 0; s < l.pp; ++s) {
    std::vector<int> flows(static_cast<size_t>(hosts), 0);
    for (int t = 0; t < l.tp; ++t) {
      const int first = mesh_rank(l, 0, s, t), last = mesh_rank(l, l.dp - 1, s, t);
      if (host(first) == host(last)) continue;
      dp_cross = true;
      std::vector<bool> seen(static_cast<size_t>(hosts), false);
      for (int d = 0; d < l.dp; ++d) seen[static_cast<size_t>(host(mesh_rank(l, d, s, t)))] = true;
      for (int h = 0; h < hosts; ++h) {
        if (seen[static_cast<size_t>(h)]) dp_max = std::max(dp_max, ++flows[static_cast<size_t>(h)]);
      }
    }
  }
  return Links{axis_link(hw, tp_cross, tp_max), axis_link(hw, pp_cross, pp_max), axis_link(hw, dp_cross, dp_max)};
}

// Bytes of optimizer state per parameter (f32), beside a mixed-precision master copy.
double optimizer_state_bytes(const Layout& l, const Precision& p) {
  const double state = l.optimizer == "adamw" ? 8.0 : (l.optimizer == "sgd" ? 4.0 : 0.0);
  return state + p.master_bytes;
}

double local_params(const BlockSpec& b, int tp) {
  return static_cast<double>(b.params - b.tp_params) + static_cast<double>(b.tp_params) / tp;
}

double local_flops(const BlockSpec& b, int tp) { return (b.flops - b.tp_flops) + b.tp_flops / tp; }

}  // namespace

namespace {

Prediction predict_impl(const ModelSpec& model, const Hardware& hw, const Layout& layout, int64_t batch,
                        const KernelTimes* kernels, const KernelTimes* single, bool simulate_unfit) {
  check_layout(model, layout, batch);
  const size_t nblocks = model.blocks.size();
  if (kernels != nullptr && !kernels->empty()) {
    DT_CHECK(kernels->forward.size() == nblocks && kernels->backward.size() == nblocks, "plan",
             "kernel times for {} blocks, the model has {}", kernels->forward.size(), nblocks);
  } else {
    kernels = nullptr;
    DT_CHECK(hw.device_flops > 0, "plan", "no compute rate: give --device-flops or calibrate (--calibrate)");
  }
  const Layout& l = layout;
  const Precision& prec = model.precision;
  const std::vector<nn::BlockRange> cuts =
      l.stages.empty() ? parallel::balance_stages(model.block_flops(), model.block_params(), l.pp) : l.stages;
  const double rows = static_cast<double>(batch / (l.dp * l.accumulate * l.micro_batches));
  const Links links = links_of(hw, l);

  Prediction out;
  out.layout = l;
  out.batch = batch;
  SimConfig sim;
  sim.micro_batches = static_cast<int>(l.micro_batches);
  sim.accumulate = static_cast<int>(l.accumulate);
  sim.schedule = l.schedule;
  sim.cores = hw.cores;
  for (int s = 0; s < l.pp; ++s) {
    const nn::BlockRange r = cuts[static_cast<size_t>(s)];
    SimStage st;
    StagePrediction sp;
    sp.blocks = r;
    double params = 0.0, act = 0.0;
    std::vector<double> part_backward, part_bytes;  // per block, in backward order
    for (size_t i = r.end; i-- > r.begin;) {
      const BlockSpec& b = model.blocks[i];
      const double f = kernels ? kernels->forward[i] : rows * local_flops(b, l.tp) / hw.device_flops;
      const double bw = kernels ? kernels->backward[i] : 2.0 * f;
      st.forward += f;
      st.backward += bw + (l.recompute ? f : 0.0);
      part_backward.push_back(bw + (l.recompute ? f : 0.0));
      params += local_params(b, l.tp);
      part_bytes.push_back(local_params(b, l.tp) * prec.grad_bytes);
      act += rows * (b.act_bytes + b.tp_act_bytes / l.tp);
      for (int k = 0; k < b.tp_all_reduces && l.tp > 1; ++k) {
        st.forward_comm += all_reduce_cost(comm::Algorithm::automatic, rows * b.out_bytes, l.tp, links.tp.link);
      }
    }
    st.backward_comm = st.forward_comm;
    if (l.recompute) st.backward_comm += st.forward_comm;
    const double out_bytes = rows * model.blocks[r.end - 1].out_bytes;
    const double in_bytes = r.begin > 0 ? rows * model.blocks[r.begin - 1].out_bytes : 0.0;
    if (s + 1 < l.pp) st.send_forward = p2p_cost(out_bytes, links.pp.link);
    if (s > 0) st.send_backward = p2p_cost(in_bytes, links.pp.link);
    // Gradient buckets of about bucket_bytes in reverse order of the parameters; a bucket starts
    // when the block holding its last bytes finished its backward.
    if (l.dp > 1) {
      double total_bw = 0.0;
      for (double x : part_backward) total_bw += x;
      for (double x : part_backward)
        st.backward_parts.push_back(total_bw > 0 ? x / total_bw : 1.0 / part_backward.size());
      double filled = 0.0, done = 0.0;
      auto add_bucket = [&](double bytes, int part) {
        st.buckets.push_back(l.zero > 0 ? reduce_scatter_cost(bytes, l.dp, links.dp.link)
                                        : all_reduce_cost(comm::Algorithm::automatic, bytes, l.dp, links.dp.link));
        st.ready_after.push_back(part);
        if (l.zero > 0) {
          st.after_optimizer += all_gather_cost(bytes / prec.grad_bytes * prec.param_bytes, l.dp, links.dp.link);
        }
      };
      for (size_t k = 0; k < part_bytes.size(); ++k) {
        done += part_bytes[k];
        while (done - filled >= l.bucket_bytes) {
          add_bucket(l.bucket_bytes, static_cast<int>(k));
          filled += l.bucket_bytes;
        }
      }
      if (done - filled > 0) add_bucket(done - filled, static_cast<int>(part_bytes.size()) - 1);
    }
    const double owned = l.zero > 0 ? params / l.dp : params;
    st.optimizer = hw.optimizer_s_per_param * owned;
    st.demand = static_cast<double>(l.tp) * l.dp * std::max(1, hw.threads);
    sim.stages.push_back(st);

    // Memory of one rank of the stage.
    sp.memory.params = params * prec.param_bytes;
    sp.memory.grads = params * prec.grad_bytes / (l.zero == 2 ? l.dp : 1);
    sp.memory.optimizer = params * optimizer_state_bytes(l, prec) / (l.zero >= 1 ? l.dp : 1);
    const int64_t m = l.micro_batches;
    sp.in_flight = static_cast<int>(l.schedule == parallel::Schedule::gpipe ? m : std::min<int64_t>(l.pp - s, m));
    // Each micro-batch in flight keeps the stage's input (received) and, without recompute, what
    // its blocks keep for backward; with recompute one micro-batch's worth is rebuilt at a time.
    sp.memory.activations = sp.in_flight * (in_bytes + (l.recompute ? 0.0 : act)) + (l.recompute ? act : 0.0);
    out.stages.push_back(sp);
  }

  for (const StagePrediction& sp : out.stages) {
    if (sp.memory.total() > out.memory.total()) out.memory = sp.memory;
  }
  out.fits = hw.memory <= 0 || out.memory.total() <= hw.memory;
  out.bubble_theory = static_cast<double>(l.pp - 1) / static_cast<double>(l.micro_batches + l.pp - 1);
  if (!out.fits && !simulate_unfit) return out;
  const SimResult res = simulate_step(sim);
  out.step_s = res.step_s;
  for (int s = 0; s < l.pp; ++s) out.stages[static_cast<size_t>(s)].sim = res.stages[static_cast<size_t>(s)];
  const SimStageResult& c = res.stages[static_cast<size_t>(res.critical)];
  out.compute_s = c.compute_s;
  out.exposed_comm_s = c.tp_comm_s + c.dp_wait_s + c.gather_s;
  out.bubble_s = c.pipeline_wait_s;
  // T(1): one device, the whole batch in one pass, no communication.
  double t1 = hw.optimizer_s_per_param * static_cast<double>(model.params());
  if (single != nullptr && !single->empty()) {
    DT_CHECK(single->forward.size() == nblocks && single->backward.size() == nblocks, "plan",
             "single-process kernel times for {} blocks, the model has {}", single->forward.size(), nblocks);
    for (size_t i = 0; i < nblocks; ++i) t1 += single->forward[i] + single->backward[i];
  } else if (hw.device_flops > 0) {
    t1 += 3.0 * model.flops_per_sample() * static_cast<double>(batch) / hw.device_flops;
  } else {
    t1 = 0.0;
  }
  out.single_device_s = t1;
  out.efficiency = out.step_s > 0 ? t1 / (l.world() * out.step_s) : 0.0;
  out.samples_per_s = out.step_s > 0 ? static_cast<double>(batch) / out.step_s : 0.0;
  return out;
}

}  // namespace

Prediction predict(const ModelSpec& model, const Hardware& hw, const Layout& layout, int64_t batch,
                   const KernelTimes* kernels, const KernelTimes* single) {
  return predict_impl(model, hw, layout, batch, kernels, single, true);
}

Prediction predict_if_fits(const ModelSpec& model, const Hardware& hw, const Layout& layout, int64_t batch) {
  return predict_impl(model, hw, layout, batch, nullptr, nullptr, false);
}

}  // namespace dtrain::plan
