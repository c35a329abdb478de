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

void check_config(const SimConfig& cfg) {
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
}

// What starting a lane's next operation did: it runs an activity now, it is over already (a
// send, a message that arrived), or the lane must wait.
enum class OpStart { started, passed, blocked };

// One simulate_step: every stage's lanes, the links between the stages, the host links' load
// and the clock. run() repeats, until every stage finished: settle (start and finish whatever
// can move at the current time), find the next event, and advance every activity to it.
class Simulator {
 public:
  explicit Simulator(const SimConfig& cfg);
  SimResult run();

 private:
  void settle();
  bool advance_lane(int s);
  OpStart start_op(int s);
  bool advance_dp(int s);
  bool all_finished() const {
    return std::all_of(finished_.begin(), finished_.end(), [](bool f) { return f; });
  }
  double core_rate() const;
  void count_link_load();
  double wire_rate(const Activity& a) const;
  double next_event(double rate) const;
  void progress(double rate, double dt);
  static void send(Link& link, int seq, const Cost& c, double t);

  const SimConfig& cfg_;
  int P_;
  std::vector<Lane> lanes_;
  std::vector<DpLane> dp_;
  // forward_links_[s]: stage s -> s+1 activations; backward_links_[s]: stage s+1 -> s gradients.
  std::vector<Link> forward_links_, backward_links_;
  SimResult result_;
  std::vector<bool> finished_;
  std::vector<Flows> dp_flows_, tp_flows_;  // each stage's host-link flows as (link, flows) pairs
  std::vector<int> load_;                   // flows on each host's link now
  double t_ = 0.0;
};

Simulator::Simulator(const SimConfig& cfg) : cfg_(cfg), P_(static_cast<int>(cfg.stages.size())) {
  const auto P = static_cast<size_t>(P_);
  const int messages = cfg_.accumulate * cfg_.micro_batches;
  lanes_.resize(P);
  dp_.resize(P);
  forward_links_.resize(P);
  backward_links_.resize(P);
  for (int s = 0; s < P_; ++s) {
    lanes_[static_cast<size_t>(s)].program = build_program(cfg_, s);
    forward_links_[static_cast<size_t>(s)].arrival.assign(static_cast<size_t>(messages), kInf);
    backward_links_[static_cast<size_t>(s)].arrival.assign(static_cast<size_t>(messages), kInf);
  }
  result_.stages.assign(P, {});
  finished_.assign(P, false);
  size_t hosts = 0;
  dp_flows_.resize(P);
  tp_flows_.resize(P);
  for (int s = 0; s < P_; ++s) {
    const SimStage& st = cfg_.stages[static_cast<size_t>(s)];
    for (size_t h = 0; h < st.dp_flows.size(); ++h) {
      if (st.dp_flows[h] > 0) dp_flows_[static_cast<size_t>(s)].emplace_back(h, st.dp_flows[h]);
    }
    for (size_t h = 0; h < st.tp_flows.size(); ++h) {
      if (st.tp_flows[h] > 0) tp_flows_[static_cast<size_t>(s)].emplace_back(h, st.tp_flows[h]);
    }
    hosts = std::max({hosts, st.dp_flows.size(), st.tp_flows.size()});
  }
  load_.assign(hosts, 0);
}

SimResult Simulator::run() {
  const size_t max_events = 50'000'000;
  for (size_t events = 0;; ++events) {
    DT_CHECK(events < max_events, "plan", "simulate_step: no end after {} events", max_events);
    settle();
    if (all_finished()) break;
    const double rate = core_rate();
    count_link_load();
    const double next = next_event(rate);
    DT_CHECK(next < kInf, "plan", "simulate_step: every stage waits at {} s (inconsistent schedule)", t_);
    progress(rate, std::max(0.0, next - t_));
    t_ = next;
  }
  for (int s = 0; s < P_; ++s) {
    if (result_.stages[static_cast<size_t>(s)].end_s >= result_.step_s) {
      result_.step_s = result_.stages[static_cast<size_t>(s)].end_s;
      result_.critical = s;
    }
  }
  return result_;
}

// Starts or finishes every operation that can move at the current time, until none can.
void Simulator::settle() {
  for (bool moved = true; moved;) {
    moved = false;
    for (int s = 0; s < P_; ++s) moved = advance_dp(s) || moved;
    for (int s = 0; s < P_; ++s) moved = advance_lane(s) || moved;
  }
}

// Moves stage s's main lane as far as it can at the current time; true when something moved.
bool Simulator::advance_lane(int s) {
  Lane& lane = lanes_[static_cast<size_t>(s)];
  bool moved = false;
  while (!finished_[static_cast<size_t>(s)]) {
    if (lane.act.active) {
      if (!lane.act.done(t_)) return moved;
      lane.act.active = false;
      ++lane.pc;
      moved = true;
      continue;
    }
    if (lane.pc >= lane.program.size()) {
      finished_[static_cast<size_t>(s)] = true;
      result_.stages[static_cast<size_t>(s)].end_s = t_;
      return true;
    }
    const OpStart r = start_op(s);
    if (r == OpStart::blocked) return moved;
    if (r == OpStart::passed) {
      ++lane.pc;
      moved = true;
    }
  }
  return moved;
}

// Starts the operation at stage s's program counter.
OpStart Simulator::start_op(int s) {
  Lane& lane = lanes_[static_cast<size_t>(s)];
  const SimStage& st = cfg_.stages[static_cast<size_t>(s)];
  const Op& op = lane.program[lane.pc];
  switch (op.kind) {
    case OpKind::compute:
      lane.act = Activity{true, op.cpu, 0.0, t_, nullptr};
      return OpStart::started;
    case OpKind::comm:
      // The ZeRO all-gather runs over the data-parallel group; the rest over the tensor-parallel one.
      lane.act = start(
          op.cost, t_,
          op.category == Category::gather ? &dp_flows_[static_cast<size_t>(s)] : &tp_flows_[static_cast<size_t>(s)]);
      return OpStart::started;
    case OpKind::recv_activation:
    case OpKind::recv_gradient: {
      const Link& link = op.kind == OpKind::recv_activation ? forward_links_[static_cast<size_t>(s - 1)]
                                                            : backward_links_[static_cast<size_t>(s)];
      const double at = link.arrival[static_cast<size_t>(op.index)];
      if (at > t_ + kEps) {
        lane.waiting = true;
        lane.wait_until = at;
        return OpStart::blocked;
      }
      lane.waiting = false;
      return OpStart::passed;
    }
    case OpKind::send_activation:
      send(forward_links_[static_cast<size_t>(s)], op.index, st.send_forward, t_);
      return OpStart::passed;
    case OpKind::send_gradient:
      send(backward_links_[static_cast<size_t>(s - 1)], op.index, st.send_backward, t_);
      return OpStart::passed;
    case OpKind::bucket:
      dp_[static_cast<size_t>(s)].queue.push_back(st.buckets[static_cast<size_t>(op.index)]);
      return OpStart::passed;
    case OpKind::wait_dp:
      if (!dp_[static_cast<size_t>(s)].idle()) {
        lane.waiting = true;
        lane.wait_until = kInf;
        return OpStart::blocked;
      }
      lane.waiting = false;
      return OpStart::passed;
  }
  return OpStart::passed;
}

// Moves stage s's dp lane: finishes its bucket, starts the next; true when something moved.
bool Simulator::advance_dp(int s) {
  DpLane& d = dp_[static_cast<size_t>(s)];
  bool moved = false;
  while (true) {
    if (d.act.active) {
      if (!d.act.done(t_)) return moved;
      d.act.active = false;
      moved = true;
    }
    if (d.queue.empty()) return moved;
    d.act = start(d.queue.front(), t_, &dp_flows_[static_cast<size_t>(s)]);
    d.queue.pop_front();
    moved = true;
  }
}

// Cores wanted by every lane with compute left; all of them progress at this one rate.
double Simulator::core_rate() const {
  double demand = 0.0;
  for (int s = 0; s < P_; ++s) {
    const double d = cfg_.stages[static_cast<size_t>(s)].demand;
    if (lanes_[static_cast<size_t>(s)].act.wants_cpu(t_)) demand += d;
    if (dp_[static_cast<size_t>(s)].act.wants_cpu(t_)) demand += d;
  }
  return cfg_.cores > 0 && demand > cfg_.cores ? cfg_.cores / demand : 1.0;
}

// Flows on every host's link.
void Simulator::count_link_load() {
  std::fill(load_.begin(), load_.end(), 0);
  auto add_load = [&](const Activity& a) {
    if (a.flows == nullptr || !a.wants_wire(t_)) return;
    for (const auto& [h, f] : *a.flows) load_[h] += f;
  };
  for (int s = 0; s < P_; ++s) {
    add_load(lanes_[static_cast<size_t>(s)].act);
    add_load(dp_[static_cast<size_t>(s)].act);
  }
}

// An activity's wire time runs at 1 / (the most flows on a link it uses).
double Simulator::wire_rate(const Activity& a) const {
  int most = 1;
  if (a.flows != nullptr) {
    for (const auto& [h, f] : *a.flows) most = std::max(most, load_[h]);
  }
  return 1.0 / most;
}

// The time of the next event: an activity's latency, cpu or wire time running out, or a
// message a lane waits for arriving.
double Simulator::next_event(double rate) const {
  double next = kInf;
  auto consider = [&](const Activity& a) {
    if (!a.active) return;
    if (!a.started(t_)) {
      next = std::min(next, a.latency_until);
      return;
    }
    if (a.cpu > kEps) next = std::min(next, t_ + a.cpu / rate);
    if (a.wire > kEps) next = std::min(next, t_ + a.wire / wire_rate(a));
  };
  for (int s = 0; s < P_; ++s) {
    const Lane& lane = lanes_[static_cast<size_t>(s)];
    consider(lane.act);
    consider(dp_[static_cast<size_t>(s)].act);
    if (!finished_[static_cast<size_t>(s)] && lane.waiting) next = std::min(next, lane.wait_until);
  }
  return next;
}

// Advances every activity by dt at the current rates, and accounts dt on each unfinished
// stage to the category of the operation its main lane is in.
void Simulator::progress(double rate, double dt) {
  for (int s = 0; s < P_; ++s) {
    Lane& lane = lanes_[static_cast<size_t>(s)];
    SimStageResult& r = result_.stages[static_cast<size_t>(s)];
    for (Activity* a : {&lane.act, &dp_[static_cast<size_t>(s)].act}) {
      const double w = wire_rate(*a);
      if (a->wants_cpu(t_)) a->cpu = std::max(0.0, a->cpu - rate * dt);
      if (a->wants_wire(t_)) a->wire = std::max(0.0, a->wire - w * dt);
    }
    if (finished_[static_cast<size_t>(s)]) continue;
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
}

// A message on `link` leaves when the link is free, after the ones before it.
void Simulator::send(Link& link, int seq, const Cost& c, double t) {
  const double begin = std::max(t, link.free_at);
  link.free_at = begin + std::max(c.wire, c.cpu);
  link.arrival[static_cast<size_t>(seq)] = link.free_at + c.latency;
}

}  // namespace

SimResult simulate_step(const SimConfig& cfg) {
  check_config(cfg);
  return Simulator(cfg).run();
}

}  // namespace dtrain::plan
