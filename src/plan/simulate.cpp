// The step simulator (simulate.h). Each stage's main lane is a program of operations built from
// the pipeline schedule; the loop advances time from event to event: a lane's compute finishing
// at the current sharing rate, a communication's latency and wire time running out, a message
// arriving.
#include "dtrain/plan/simulate.h"

#include <algorithm>
#include <deque>
#include <limits>

#include "dtrain/core/error.h"

namespace dtrain::plan {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kEps = 1e-12;

enum class OpKind { compute, comm, recv_activation, recv_gradient, send_activation, send_gradient, bucket, wait_dp };
enum class Category { compute, tp_comm, pipeline_wait, dp_wait, gather };

struct Op {
  OpKind kind = OpKind::compute;
  Category category = Category::compute;
  double cpu = 0.0;   // compute: core-seconds
  Cost cost;          // comm
  int index = 0;      // message sequence number (accumulation round x micro-batches + micro-batch) or bucket
  bool busy = false;  // forward or backward compute
};

// What a lane is doing: after `latency` (a pure wait), cpu work left (progressing at the cores'
// sharing rate) and wire time left (progressing at the host links' sharing rate); both must run
// out. `flows` names the host links the wire time uses, (link, flows) pairs (null: none shared).
using Flows = std::vector<std::pair<size_t, int>>;

struct Activity {
  bool active = false;
  double cpu = 0.0;
  double wire = 0.0;
  double latency_until = 0.0;
  const Flows* flows = nullptr;
  bool started(double t) const { return latency_until <= t + kEps; }
  bool done(double t) const { return started(t) && cpu <= kEps && wire <= kEps; }
  bool wants_cpu(double t) const { return active && started(t) && cpu > kEps; }
  bool wants_wire(double t) const { return active && started(t) && wire > kEps; }
};

Activity start(const Cost& c, double t, const Flows* flows) {
  return Activity{true, c.cpu, c.wire, t + c.latency, flows};
}

struct Lane {
  std::vector<Op> program;
  size_t pc = 0;
  Activity act;
  bool waiting = false;  // on a message or on the dp lane
  double wait_until = kInf;
};

struct DpLane {
  std::deque<Cost> queue;
  Activity act;
  bool idle() const { return !act.active && queue.empty(); }
};

// A link between two neighbouring stages in one direction: messages go one after another.
struct Link {
  double free_at = 0.0;
  std::vector<double> arrival;  // by message sequence number; kInf until sent
};

void append_compute(std::vector<Op>& p, double cpu, bool busy = true) {
  if (cpu > 0) p.push_back(Op{OpKind::compute, Category::compute, cpu, {}, 0, busy});
}

void append_comm(std::vector<Op>& p, const Cost& c, Category category) {
  if (c.seconds() > 0) p.push_back(Op{OpKind::comm, category, 0.0, c, 0, false});
}

std::vector<Op> build_program(const SimConfig& cfg, int s) {
  const SimStage& st = cfg.stages[static_cast<size_t>(s)];
  const int P = static_cast<int>(cfg.stages.size());
  const int M = cfg.micro_batches;
  const std::vector<parallel::PipeOp> order = parallel::pipeline_schedule(cfg.schedule, P, s, M);
  std::vector<Op> p;
  for (int a = 0; a < cfg.accumulate; ++a) {
    const bool sync_round = a == cfg.accumulate - 1;
    int backwards = 0;
    for (const parallel::PipeOp& op : order) {
      const int seq = a * M + op.micro;
      if (op.forward) {
        if (s > 0) p.push_back(Op{OpKind::recv_activation, Category::pipeline_wait, 0.0, {}, seq});
        append_compute(p, st.forward);
        append_comm(p, st.forward_comm, Category::tp_comm);
        if (s + 1 < P) {
          // The message leaves; moving it (copies, the network stack) takes this rank's cores too.
          p.push_back(Op{OpKind::send_activation, Category::compute, 0.0, {}, seq});
          append_compute(p, st.send_forward.cpu, false);
        }
        continue;
      }
      if (s + 1 < P) p.push_back(Op{OpKind::recv_gradient, Category::pipeline_wait, 0.0, {}, seq});
      ++backwards;
      if (sync_round && backwards == M && !st.buckets.empty()) {
        // The synchronising backward: buckets start as the parts that fill them finish.
        std::vector<double> parts = st.backward_parts.empty() ? std::vector<double>{1.0} : st.backward_parts;
        size_t next_bucket = 0;
        for (size_t k = 0; k < parts.size(); ++k) {
          append_compute(p, (st.backward + st.bucket_copy) * parts[k]);
          while (next_bucket < st.buckets.size() &&
                 (st.ready_after[next_bucket] <= static_cast<int>(k) || k + 1 == parts.size())) {
            p.push_back(Op{OpKind::bucket, Category::compute, 0.0, {}, static_cast<int>(next_bucket)});
            ++next_bucket;
          }
        }
      } else {
        append_compute(p, st.backward);
      }
      append_comm(p, st.backward_comm, Category::tp_comm);
      if (s > 0) {
        p.push_back(Op{OpKind::send_gradient, Category::compute, 0.0, {}, seq});
        append_compute(p, st.send_backward.cpu, false);
      }
    }
  }
  if (!st.buckets.empty()) p.push_back(Op{OpKind::wait_dp, Category::dp_wait, 0.0, {}, 0});
  append_compute(p, st.optimizer, false);
  append_comm(p, st.after_optimizer, Category::gather);
  return p;
}

}  // namespace

SimResult simulate_step(const SimConfig& cfg) {
  const int P = static_cast<int>(cfg.stages.size());
  DT_CHECK(P >= 1 && cfg.micro_batches >= 1 && cfg.accumulate >= 1, "plan",
           "simulate_step: {} stages, {} micro-batches, {} accumulation rounds: each must be at least 1", P,
           cfg.micro_batches, cfg.accumulate);
  DT_CHECK(cfg.cores >= 0, "plan", "simulate_step: cores {} must be non-negative", cfg.cores);
  for (int s = 0; s < P; ++s) {
    const SimStage& st = cfg.stages[static_cast<size_t>(s)];
    DT_CHECK(st.ready_after.size() == st.buckets.size(), "plan",
             "simulate_step: stage {} has {} buckets but {} ready points", s, st.buckets.size(), st.ready_after.size());
    DT_CHECK(st.demand > 0 && st.forward >= 0 && st.backward >= 0 && st.optimizer >= 0, "plan",
             "simulate_step: stage {} has a negative time or no demand", s);
  }
  const int messages = cfg.accumulate * cfg.micro_batches;
  std::vector<Lane> lanes(static_cast<size_t>(P));
  std::vector<DpLane> dp(static_cast<size_t>(P));
  // forward_links[s]: stage s -> s+1 activations; backward_links[s]: stage s+1 -> s gradients.
  std::vector<Link> forward_links(static_cast<size_t>(P)), backward_links(static_cast<size_t>(P));
  for (int s = 0; s < P; ++s) {
    lanes[static_cast<size_t>(s)].program = build_program(cfg, s);
    forward_links[static_cast<size_t>(s)].arrival.assign(static_cast<size_t>(messages), kInf);
    backward_links[static_cast<size_t>(s)].arrival.assign(static_cast<size_t>(messages), kInf);
  }
  SimResult result;
  result.stages.assign(static_cast<size_t>(P), {});
  std::vector<bool> finished(static_cast<size_t>(P), false);
  // Each stage's host-link flows as (link, flows) pairs.
  size_t hosts = 0;
  std::vector<Flows> dp_flows(static_cast<size_t>(P)), tp_flows(static_cast<size_t>(P));
  for (int s = 0; s < P; ++s) {
    const SimStage& st = cfg.stages[static_cast<size_t>(s)];
    for (size_t h = 0; h < st.dp_flows.size(); ++h) {
      if (st.dp_flows[h] > 0) dp_flows[static_cast<size_t>(s)].emplace_back(h, st.dp_flows[h]);
    }
    for (size_t h = 0; h < st.tp_flows.size(); ++h) {
      if (st.tp_flows[h] > 0) tp_flows[static_cast<size_t>(s)].emplace_back(h, st.tp_flows[h]);
    }
    hosts = std::max({hosts, st.dp_flows.size(), st.tp_flows.size()});
  }
  std::vector<int> load(hosts, 0);

  auto send = [](Link& link, int seq, const Cost& c, double t) {
    const double begin = std::max(t, link.free_at);
    link.free_at = begin + std::max(c.wire, c.cpu);
    link.arrival[static_cast<size_t>(seq)] = link.free_at + c.latency;
  };

  double t = 0.0;
  // Starts or finishes every operation that can move at time t; true when something did.
  auto advance_lane = [&](int s) {
    Lane& lane = lanes[static_cast<size_t>(s)];
    const SimStage& st = cfg.stages[static_cast<size_t>(s)];
    bool moved = false;
    while (!finished[static_cast<size_t>(s)]) {
      if (lane.act.active) {
        if (!lane.act.done(t)) return moved;
        lane.act.active = false;
        ++lane.pc;
        moved = true;
        continue;
      }
      if (lane.pc >= lane.program.size()) {
        finished[static_cast<size_t>(s)] = true;
        result.stages[static_cast<size_t>(s)].end_s = t;
        return true;
      }
      const Op& op = lane.program[lane.pc];
      switch (op.kind) {
        case OpKind::compute:
          lane.act = Activity{true, op.cpu, 0.0, t, nullptr};
          break;
        case OpKind::comm:
          // The ZeRO all-gather runs over the data-parallel group; the rest over the tensor-parallel one.
          lane.act = start(
              op.cost, t,
              op.category == Category::gather ? &dp_flows[static_cast<size_t>(s)] : &tp_flows[static_cast<size_t>(s)]);
          break;
        case OpKind::recv_activation:
        case OpKind::recv_gradient: {
          const Link& link = op.kind == OpKind::recv_activation ? forward_links[static_cast<size_t>(s - 1)]
                                                                : backward_links[static_cast<size_t>(s)];
          const double at = link.arrival[static_cast<size_t>(op.index)];
          if (at > t + kEps) {
            lane.waiting = true;
            lane.wait_until = at;
            return moved;
          }
          lane.waiting = false;
          ++lane.pc;
          moved = true;
          break;
        }
        case OpKind::send_activation:
          send(forward_links[static_cast<size_t>(s)], op.index, st.send_forward, t);
          ++lane.pc;
          moved = true;
          break;
        case OpKind::send_gradient:
          send(backward_links[static_cast<size_t>(s - 1)], op.index, st.send_backward, t);
          ++lane.pc;
          moved = true;
          break;
        case OpKind::bucket:
          dp[static_cast<size_t>(s)].queue.push_back(st.buckets[static_cast<size_t>(op.index)]);
          ++lane.pc;
          moved = true;
          break;
        case OpKind::wait_dp:
          if (!dp[static_cast<size_t>(s)].idle()) {
            lane.waiting = true;
            lane.wait_until = kInf;
            return moved;
          }
          lane.waiting = false;
          ++lane.pc;
          moved = true;
          break;
      }
    }
    return moved;
  };
  auto advance_dp = [&](int s) {
    DpLane& d = dp[static_cast<size_t>(s)];
    bool moved = false;
    while (true) {
      if (d.act.active) {
        if (!d.act.done(t)) return moved;
        d.act.active = false;
        moved = true;
      }
      if (d.queue.empty()) return moved;
      d.act = start(d.queue.front(), t, &dp_flows[static_cast<size_t>(s)]);
      d.queue.pop_front();
      moved = true;
    }
  };

  const size_t max_events = 50'000'000;
  for (size_t events = 0;; ++events) {
    DT_CHECK(events < max_events, "plan", "simulate_step: no end after {} events", max_events);
    for (bool moved = true; moved;) {
      moved = false;
      for (int s = 0; s < P; ++s) moved = advance_dp(s) || moved;
      for (int s = 0; s < P; ++s) moved = advance_lane(s) || moved;
    }
    if (std::all_of(finished.begin(), finished.end(), [](bool f) { return f; })) break;
    // Cores wanted by every lane with compute left; all of them progress at one rate.
    double demand = 0.0;
    for (int s = 0; s < P; ++s) {
      const double d = cfg.stages[static_cast<size_t>(s)].demand;
      if (lanes[static_cast<size_t>(s)].act.wants_cpu(t)) demand += d;
      if (dp[static_cast<size_t>(s)].act.wants_cpu(t)) demand += d;
    }
    const double rate = cfg.cores > 0 && demand > cfg.cores ? cfg.cores / demand : 1.0;
    // Flows on every host's link; an activity's wire time runs at 1 / (the most flows on a link
    // it uses).
    std::fill(load.begin(), load.end(), 0);
    auto add_load = [&](const Activity& a) {
      if (a.flows == nullptr || !a.wants_wire(t)) return;
      for (const auto& [h, f] : *a.flows) load[h] += f;
    };
    for (int s = 0; s < P; ++s) {
      add_load(lanes[static_cast<size_t>(s)].act);
      add_load(dp[static_cast<size_t>(s)].act);
    }
    auto wire_rate = [&](const Activity& a) {
      int most = 1;
      if (a.flows != nullptr) {
        for (const auto& [h, f] : *a.flows) most = std::max(most, load[h]);
      }
      return 1.0 / most;
    };
    double next = kInf;
    auto consider = [&](const Activity& a) {
      if (!a.active) return;
      if (!a.started(t)) {
        next = std::min(next, a.latency_until);
        return;
      }
      if (a.cpu > kEps) next = std::min(next, t + a.cpu / rate);
      if (a.wire > kEps) next = std::min(next, t + a.wire / wire_rate(a));
    };
    for (int s = 0; s < P; ++s) {
      const Lane& lane = lanes[static_cast<size_t>(s)];
      consider(lane.act);
      consider(dp[static_cast<size_t>(s)].act);
      if (!finished[static_cast<size_t>(s)] && lane.waiting) next = std::min(next, lane.wait_until);
    }
    DT_CHECK(next < kInf, "plan", "simulate_step: every stage waits at {} s (inconsistent schedule)", t);
    const double dt = std::max(0.0, next - t);
    for (int s = 0; s < P; ++s) {
      Lane& lane = lanes[static_cast<size_t>(s)];
      SimStageResult& r = result.stages[static_cast<size_t>(s)];
      for (Activity* a : {&lane.act, &dp[static_cast<size_t>(s)].act}) {
        const double w = wire_rate(*a);
        if (a->wants_cpu(t)) a->cpu = std::max(0.0, a->cpu - rate * dt);
        if (a->wants_wire(t)) a->wire = std::max(0.0, a->wire - w * dt);
      }
      if (finished[static_cast<size_t>(s)]) continue;
      const Op& op = lane.program[std::min(lane.pc, lane.program.size() - 1)];
      switch (op.category) {
        case Category::compute:
          r.compute_s += dt;
          if (op.busy) r.busy_s += dt;
          break;
        case Category::tp_comm:
          r.tp_comm_s += dt;
          break;
        case Category::pipeline_wait:
          r.pipeline_wait_s += dt;
          break;
        case Category::dp_wait:
          r.dp_wait_s += dt;
          break;
        case Category::gather:
          r.gather_s += dt;
          break;
      }
    }
    t = next;
  }
  for (int s = 0; s < P; ++s) {
    if (result.stages[static_cast<size_t>(s)].end_s >= result.step_s) {
      result.step_s = result.stages[static_cast<size_t>(s)].end_s;
      result.critical = s;
    }
  }
  return result;
}

}  // namespace dtrain::plan
