// From a model, a machine and a layout to the simulated step (plan.h).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "dtrain/core/error.h"
#include "dtrain/optim/quantize.h"
#include "dtrain/plan/plan.h"

namespace dtrain::plan {

std::string Layout::str() const {
  std::string s = fmt::format("dp {} x pp {} x tp {}", dp, pp, tp);
  if (zero > 0) s += fmt::format(", zero {}", zero);
  if (pp > 1) s += fmt::format(", {} x {}", parallel::schedule_name(schedule), micro_batches);
  if (accumulate > 1) s += fmt::format(", accumulate {}", accumulate);
  if (recompute) s += ", recompute";
  if (optimizer_state == "int8") s += ", int8 optimizer state";
  return s;
}

void check_layout(const ModelSpec& model, const Layout& l, int64_t batch) {
  DT_CHECK(l.dp >= 1 && l.pp >= 1 && l.tp >= 1, "plan", "--dp {} x --pp {} x --tp {}: each must be at least 1", l.dp,
           l.pp, l.tp);
  DT_CHECK(l.zero >= 0 && l.zero <= 3, "plan", "--zero {}: expected 0, 1, 2 or 3", l.zero);
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
  DT_CHECK(l.optimizer_state == "f32" || (l.optimizer_state == "int8" && l.optimizer == "adamw" && l.zero == 0), "plan",
           "optimizer state '{}' with {} and --zero {}: expected f32, or int8 with adamw and --zero 0",
           l.optimizer_state, l.optimizer, l.zero);
  DT_CHECK(l.bucket_bytes > 0, "plan", "--bucket-mb must be positive");
}

namespace {

// Which link each axis's communication uses. Tensor- and data-parallel groups that span hosts
// put flows on the host links, per stage (they share the links in the simulation); pipeline
// sends between stages on different hosts share them statically (as many at once as ranks of
// the stage on a host).
struct AxisLink {
  LinkCost link;
  bool crosses = false;
};

struct Links {
  AxisLink tp, pp, dp;
  std::vector<std::vector<int>> tp_flows, dp_flows;  // [stage][host]
};

int mesh_rank(const Layout& l, int d, int s, int t) { return (d * l.pp + s) * l.tp + t; }

Links links_of(const Hardware& hw, const Layout& l) {
  const int g = std::max(1, hw.ranks_per_host);
  auto host = [&](int r) { return r / g; };
  const int hosts = (l.world() + g - 1) / g;
  Links out;
  out.tp_flows.assign(static_cast<size_t>(l.pp), std::vector<int>(static_cast<size_t>(hosts), 0));
  out.dp_flows = out.tp_flows;
  // A ring whose ranks on a host are consecutive adds one flow to that host's link; a group's
  // flows count on every host it has ranks on.
  auto count = [&](std::vector<int>& flows, const std::vector<int>& ranks) {
    if (host(ranks.front()) == host(ranks.back())) return false;
    int last = -1;  // ranks ascend, so a host's ranks are consecutive here
    for (int r : ranks) {
      if (host(r) != last) ++flows[static_cast<size_t>(host(r))];
      last = host(r);
    }
    return true;
  };
  bool tp_cross = false, pp_cross = false, dp_cross = false;
  for (int s = 0; s < l.pp; ++s) {
    for (int d = 0; d < l.dp; ++d) {
      std::vector<int> ranks;
      ranks.reserve(static_cast<size_t>(l.tp));
      for (int t = 0; t < l.tp; ++t) ranks.push_back(mesh_rank(l, d, s, t));
      tp_cross = count(out.tp_flows[static_cast<size_t>(s)], ranks) || tp_cross;
    }
    for (int t = 0; t < l.tp; ++t) {
      std::vector<int> ranks;
      ranks.reserve(static_cast<size_t>(l.dp));
      for (int d = 0; d < l.dp; ++d) ranks.push_back(mesh_rank(l, d, s, t));
      dp_cross = count(out.dp_flows[static_cast<size_t>(s)], ranks) || dp_cross;
    }
  }
  int pp_max = 0;
  for (int s = 0; s + 1 < l.pp; ++s) {
    std::vector<int> sending(static_cast<size_t>(hosts), 0);
    for (int d = 0; d < l.dp; ++d) {
      for (int t = 0; t < l.tp; ++t) {
        const int r = mesh_rank(l, d, s, t), n = mesh_rank(l, d, s + 1, t);
        if (host(r) == host(n)) continue;
        pp_cross = true;
        pp_max = std::max(pp_max, ++sending[static_cast<size_t>(host(r))]);
      }
    }
  }
  // Hosts whose links carry the same flows of every stage behave alike: keep one of each kind
  // (with one device per host, thousands of hosts become a few kinds).
  std::map<std::vector<int>, int> kinds;
  for (int h = 0; h < hosts; ++h) {
    std::vector<int> column;
    for (int s = 0; s < l.pp; ++s) {
      column.push_back(out.tp_flows[static_cast<size_t>(s)][static_cast<size_t>(h)]);
      column.push_back(out.dp_flows[static_cast<size_t>(s)][static_cast<size_t>(h)]);
    }
    if (std::any_of(column.begin(), column.end(), [](int f) { return f > 0; })) kinds.emplace(column, 0);
  }
  for (auto& flows : {&out.tp_flows, &out.dp_flows}) {
    for (auto& per_stage : *flows) per_stage.clear();
  }
  for (const auto& [column, unused] : kinds) {
    for (int s = 0; s < l.pp; ++s) {
      out.tp_flows[static_cast<size_t>(s)].push_back(column[2 * static_cast<size_t>(s)]);
      out.dp_flows[static_cast<size_t>(s)].push_back(column[2 * static_cast<size_t>(s) + 1]);
    }
  }
  out.tp = AxisLink{tp_cross ? hw.inter : hw.intra, tp_cross};
  out.dp = AxisLink{dp_cross ? hw.inter : hw.intra, dp_cross};
  out.pp = AxisLink{pp_cross ? hw.inter : hw.intra, pp_cross};
  if (pp_cross) out.pp.link.beta_wire *= pp_max;
  return out;
}

// Bytes of optimizer state per parameter (f32; int8 AdamW: a byte per moment and an f32 scale
// per 256 of them), beside a mixed-precision master copy.
double optimizer_state_bytes(const Layout& l, const Precision& p) {
  double state = l.optimizer == "adamw" ? 8.0 : (l.optimizer == "sgd" ? 4.0 : 0.0);
  if (l.optimizer == "adamw" && l.optimizer_state == "int8") state = 2.0 * (1.0 + 4.0 / optim::kQuantBlock);
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
  // Exact: check_layout refused a batch that does not divide into dp x accumulate x micro-batches.
  // NOLINTNEXTLINE(bugprone-integer-division)
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
    double params = 0.0, act = 0.0, largest_two = 0.0, largest = 0.0;
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
      // ZeRO 3 gathers a block and prefetches the next: the two largest neighbours at most.
      largest_two = std::max(largest_two, largest + local_params(b, l.tp));
      largest = local_params(b, l.tp);
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
        if (l.zero > 0 && l.zero < 3) {
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
      // ZeRO 3: every micro-batch gathers the stage's parameters before its forward and again
      // before its backward (counted on the critical path: the prefetch's overlap is not modelled).
      if (l.zero == 3) {
        const Cost gather = all_gather_cost(params * prec.param_bytes, l.dp, links.dp.link);
        st.forward_comm += gather;
        st.backward_comm += gather;
      }
      // The gradient-ready hooks copy every gradient into its bucket.
      st.bucket_copy = done * hw.copy_s_per_byte;
    }
    const double owned = l.zero > 0 ? params / l.dp : params;
    st.optimizer = hw.optimizer_s_per_param * owned;
    st.demand = static_cast<double>(l.tp) * l.dp * std::max(1, hw.threads);
    if (links.tp.crosses) st.tp_flows = links.tp_flows[static_cast<size_t>(s)];
    if (links.dp.crosses) st.dp_flows = links.dp_flows[static_cast<size_t>(s)];
    sim.stages.push_back(st);

    // Memory of one rank of the stage.
    // ZeRO 3: this rank's piece, and the blocks gathered while they run.
    sp.memory.params = l.zero == 3 ? (params / l.dp + largest_two) * prec.param_bytes : params * prec.param_bytes;
    sp.memory.grads = params * prec.grad_bytes / (l.zero >= 2 ? l.dp : 1);
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
  // The step as the busiest stage (most compute) spends it; waiting for the others after it
  // finished counts as bubble.
  size_t busiest = 0;
  for (size_t s = 1; s < res.stages.size(); ++s) {
    if (res.stages[s].compute_s > res.stages[busiest].compute_s) busiest = s;
  }
  const SimStageResult& c = res.stages[busiest];
  out.compute_s = c.compute_s;
  out.exposed_comm_s = c.tp_comm_s + c.dp_wait_s + c.gather_s;
  out.bubble_s = c.pipeline_wait_s + (res.step_s - c.end_s);
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
