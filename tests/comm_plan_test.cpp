// Collective plans (dtrain/comm/plan.h) executed by p threads over an in-memory transport,
// checked against exactly verifiable expectations, plus plan-only checks (well-formedness,
// bytes and rounds against the cost model) that need no threads.
//
// Inputs are small integers (nccl-tests "verifiable" style): sums of up to 8 ranks stay
// exact in every float type (bf16 gets smaller values: 8 significant bits), products are
// of {+-1, +-2}, so every algorithm must produce exactly the reference, bit for bit; avg
// is the exact sum divided once in the element's precision (halves: in f32, then rounded).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../src/comm/plan_common.h"
#include "dtrain/comm/plan.h"
#include "dtrain/comm/reduce.h"
#include "dtrain/comm/transport.h"

namespace dtrain::comm {
namespace {

// ---------------------------------------------------------------------------------------
// LoopbackTransport: p threads exchanging through shared FIFO queues (one per ordered pair).
// Sends copy eagerly; receives match their peer's messages in order, checking tag and size.

struct LoopbackHub {
  explicit LoopbackHub(int p) : size(p), queues(static_cast<size_t>(p * p)) {}

  struct Message {
    uint64_t tag;
    std::vector<std::byte> data;
  };
  std::deque<Message>& queue(int src, int dst) { return queues[static_cast<size_t>(src * size + dst)]; }

  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu);
    aborted = true;
    reason = why;
    cv.notify_all();
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mu);
    aborted = false;
    for (auto& q : queues) q.clear();
  }
  size_t queued_messages() {
    std::lock_guard<std::mutex> lock(mu);
    size_t n = 0;
    for (auto& q : queues) n += q.size();
    return n;
  }

  int size;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::deque<Message>> queues;
  bool aborted = false;
  std::string reason;
};

class LoopbackTransport : public Transport {
 public:
  LoopbackTransport(LoopbackHub& hub, int rank) : hub_(hub), rank_(rank), pending_(static_cast<size_t>(hub.size)) {}

  int rank() const override { return rank_; }
  int size() const override { return hub_.size; }
  TransportKind kind() const override { return TransportKind::none; }  // a test double

  RequestId post_send(int peer, uint64_t tag, const void* data, size_t bytes) override {
    check_peer(peer);
    std::lock_guard<std::mutex> lock(hub_.mu);
    const auto* p = static_cast<const std::byte*>(data);
    hub_.queue(rank_, peer).push_back({tag, std::vector<std::byte>(p, p + bytes)});
    hub_.cv.notify_all();
    const RequestId id = next_id_++;
    requests_[id] = {peer, tag, nullptr, bytes, true};
    return id;
  }

  RequestId post_recv(int peer, uint64_t tag, void* data, size_t bytes) override {
    check_peer(peer);
    std::lock_guard<std::mutex> lock(hub_.mu);
    const RequestId id = next_id_++;
    requests_[id] = {peer, tag, data, bytes, false};
    pending_[static_cast<size_t>(peer)].push_back(id);
    return id;
  }

  void wait(const std::vector<RequestId>& ids, Deadline deadline) override {
    std::unique_lock<std::mutex> lock(hub_.mu);
    while (true) {
      if (hub_.aborted)
        throw TransportError(TransportError::Kind::aborted, {}, "loopback aborted: " + hub_.reason, __FILE__, __LINE__);
      progress_locked();
      if (all_done(ids)) break;
      if (hub_.cv.wait_until(lock, deadline) == std::cv_status::timeout) {
        progress_locked();
        if (all_done(ids)) break;
        std::set<int> peers;
        for (RequestId id : ids) {
          if (!requests_.at(id).done) peers.insert(requests_.at(id).peer);
        }
        throw TransportError(TransportError::Kind::timeout, std::vector<int>(peers.begin(), peers.end()),
                             "loopback: timed out", __FILE__, __LINE__);
      }
    }
    for (RequestId id : ids) requests_.erase(id);
  }

  bool test(const std::vector<RequestId>& ids) override {
    std::lock_guard<std::mutex> lock(hub_.mu);
    if (hub_.aborted)
      throw TransportError(TransportError::Kind::aborted, {}, "loopback aborted: " + hub_.reason, __FILE__, __LINE__);
    progress_locked();
    if (!all_done(ids)) return false;
    for (RequestId id : ids) requests_.erase(id);
    return true;
  }

  void abort(const std::string& reason) override { hub_.abort(reason); }

  void reset() {
    std::lock_guard<std::mutex> lock(hub_.mu);
    requests_.clear();
    for (auto& p : pending_) p.clear();
  }

 private:
  struct Request {
    int peer;
    uint64_t tag;
    void* data;
    size_t bytes;
    bool done;
  };

  void check_peer(int peer) const {
    if (peer < 0 || peer >= hub_.size || peer == rank_) {
      throw TransportError(TransportError::Kind::protocol, {peer}, "loopback: bad peer", __FILE__, __LINE__);
    }
  }

  void progress_locked() {
    for (int q = 0; q < hub_.size; ++q) {
      auto& order = pending_[static_cast<size_t>(q)];
      auto& queue = hub_.queue(q, rank_);
      while (!order.empty() && !queue.empty()) {
        Request& req = requests_.at(order.front());
        LoopbackHub::Message& msg = queue.front();
        if (msg.tag != req.tag || msg.data.size() != req.bytes) {
          std::ostringstream os;
          os << "loopback: rank " << rank_ << " expected tag " << req.tag << " / " << req.bytes << " bytes from " << q
             << ", got tag " << msg.tag << " / " << msg.data.size() << " bytes";
          throw TransportError(TransportError::Kind::protocol, {q}, os.str(), __FILE__, __LINE__);
        }
        if (req.bytes > 0) std::memcpy(req.data, msg.data.data(), req.bytes);
        req.done = true;
        queue.pop_front();
        order.pop_front();
      }
    }
  }

  bool all_done(const std::vector<RequestId>& ids) const {
    return std::all_of(ids.begin(), ids.end(), [&](RequestId id) { return requests_.at(id).done; });
  }

  LoopbackHub& hub_;
  int rank_;
  RequestId next_id_ = 1;
  std::unordered_map<RequestId, Request> requests_;
  std::vector<std::deque<RequestId>> pending_;  // posted receives per peer, in order
};

// p persistent threads, one per rank; run() executes one function on all of them.
class Team {
 public:
  explicit Team(int p) : p_(p), hub_(p), start_(p + 1), done_(p + 1) {
    for (int r = 0; r < p; ++r) transports_.push_back(std::make_unique<LoopbackTransport>(hub_, r));
    for (int r = 0; r < p; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~Team() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& t : threads_) t.join();
  }
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;

  /// Runs fn on every rank; returns the exception of each rank (null when none).
  std::vector<std::exception_ptr> run(const std::function<void(int, Transport&)>& fn) {
    hub_.reset();
    for (auto& t : transports_) t->reset();
    fn_ = &fn;
    errors_.assign(static_cast<size_t>(p_), nullptr);
    start_.arrive_and_wait();
    done_.arrive_and_wait();
    return errors_;
  }
  /// Messages sent but never received in the last run.
  size_t leftover_messages() { return hub_.queued_messages(); }

 private:
  void loop(int r) {
    while (true) {
      start_.arrive_and_wait();
      if (stop_) return;
      try {
        (*fn_)(r, *transports_[static_cast<size_t>(r)]);
      } catch (...) {
        errors_[static_cast<size_t>(r)] = std::current_exception();
        hub_.abort("rank " + std::to_string(r) + " failed");
      }
      done_.arrive_and_wait();
    }
  }

  int p_;
  LoopbackHub hub_;
  std::vector<std::unique_ptr<LoopbackTransport>> transports_;
  std::vector<std::thread> threads_;
  std::barrier<> start_;
  std::barrier<> done_;
  std::atomic<bool> stop_{false};
  const std::function<void(int, Transport&)>* fn_ = nullptr;
  std::vector<std::exception_ptr> errors_;
};

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown exception";
  }
}

// ---------------------------------------------------------------------------------------
// Element encoding (reference conversions written independently of reduce.cpp).

double round_to_format(double x, int bits, double min_quantum, double overflow) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  int e = 0;
  std::frexp(x, &e);
  const double quantum = std::max(std::ldexp(1.0, e - bits), min_quantum);
  const double r = std::nearbyint(x / quantum) * quantum;
  return std::fabs(r) >= overflow ? std::copysign(INFINITY, x) : r;
}
uint16_t to_bf16(double v) {
  const double r = round_to_format(static_cast<float>(v), 8, std::ldexp(1.0, -133), std::ldexp(1.0, 128));
  return static_cast<uint16_t>(std::bit_cast<uint32_t>(static_cast<float>(r)) >> 16);
}
uint16_t to_f16(double v) {
  const double r = round_to_format(static_cast<float>(v), 11, std::ldexp(1.0, -24), 65536.0);
  const uint16_t sign = std::signbit(r) ? 0x8000 : 0;
  const double a = std::fabs(r);
  if (std::isinf(a)) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14)) return sign | static_cast<uint16_t>(a * std::ldexp(1.0, 24));
  int e = 0;
  const double m = std::frexp(a, &e);
  return sign | static_cast<uint16_t>((e + 14) << 10) | static_cast<uint16_t>((2 * m - 1) * 1024);
}

bool is_float(DataType t) {
  return t == DataType::f32 || t == DataType::f64 || t == DataType::bf16 || t == DataType::f16;
}

void store_float(DataType t, std::byte* p, double v) {
  switch (t) {
    case DataType::f32: {
      const auto f = static_cast<float>(v);
      std::memcpy(p, &f, 4);
      break;
    }
    case DataType::f64:
      std::memcpy(p, &v, 8);
      break;
    case DataType::bf16: {
      const uint16_t h = to_bf16(v);
      std::memcpy(p, &h, 2);
      break;
    }
    case DataType::f16: {
      const uint16_t h = to_f16(v);
      std::memcpy(p, &h, 2);
      break;
    }
    default:
      break;
  }
}
void store_int(DataType t, std::byte* p, uint64_t bits) {  // little endian: the low bytes
  std::memcpy(p, &bits, size_of(t));
}
void store_value(DataType t, std::byte* p, int64_t v) {
  if (is_float(t)) {
    store_float(t, p, static_cast<double>(v));
  } else {
    store_int(t, p, static_cast<uint64_t>(v));
  }
}

// ---------------------------------------------------------------------------------------
// Collectives under test: buffers, inputs and expected outputs.

enum class Coll { all_reduce, reduce_scatter, all_gather, broadcast, reduce, gather, scatter, all_to_all };

const char* name_of(Coll c) {
  switch (c) {
    case Coll::all_reduce:
      return "all_reduce";
    case Coll::reduce_scatter:
      return "reduce_scatter";
    case Coll::all_gather:
      return "all_gather";
    case Coll::broadcast:
      return "broadcast";
    case Coll::reduce:
      return "reduce";
    case Coll::gather:
      return "gather";
    case Coll::scatter:
      return "scatter";
    case Coll::all_to_all:
      return "all_to_all";
  }
  return "?";
}
bool reduces(Coll c) { return c == Coll::all_reduce || c == Coll::reduce_scatter || c == Coll::reduce; }

struct Case {
  Coll coll;
  Algorithm algo;
  DataType dtype;
  ReduceOp op;
  size_t count;
  bool in_place;
  int root = 0;
  size_t segment = 0;  // ring all_reduce / reduce_scatter through detail:: with this segment
};

std::string describe(const Case& c, int p) {
  std::ostringstream os;
  os << name_of(c.coll) << " algo=" << comm::name_of(c.algo) << " p=" << p << " count=" << c.count
     << " dtype=" << comm::name_of(c.dtype) << " op=" << comm::name_of(c.op) << (c.in_place ? " in-place" : "")
     << " root=" << c.root;
  if (c.segment > 0) os << " segment=" << c.segment;
  return os.str();
}

// Uneven shares with zeros: count=7, p=8 gives 7 2 5 0 3 6 1 4.
std::vector<size_t> shares(size_t count, int p) {
  std::vector<size_t> counts(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) counts[static_cast<size_t>(r)] = (count + 3 * static_cast<size_t>(r)) % (count + 1);
  return counts;
}

// Input value of rank r, element i.
int64_t input_value(const Case& c, int r, size_t i) {
  const auto ri = static_cast<int64_t>(r);
  const auto ii = static_cast<int64_t>(i);
  if (!reduces(c.coll)) return (ri * 131 + ii * 7) % 251;  // position-dependent, exact in every type
  switch (c.op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return c.dtype == DataType::bf16 ? (ri + 1) * 2 + ii % 7 : (ri + 1) * 10 + ii % 7;
    case ReduceOp::prod: {
      int64_t v = 1 + (ri + ii) % 2;
      if (c.dtype != DataType::u8 && (ri * 3 + ii) % 5 == 0) v = -v;
      return v;
    }
    case ReduceOp::max:
    case ReduceOp::min: {
      const int64_t v = (ri * 37 + ii * 11) % 50;
      return c.dtype == DataType::u8 ? v : v - 20;
    }
  }
  return 0;
}

// Reduction of the ranks' values `vals` as the collective must produce it, encoded.
void store_reduced(const Case& c, const std::vector<int64_t>& vals, std::byte* out, int p) {
  const DataType t = c.dtype;
  if (is_float(t)) {
    double acc = static_cast<double>(vals[0]);
    for (size_t q = 1; q < vals.size(); ++q) {
      const auto v = static_cast<double>(vals[q]);
      switch (c.op) {
        case ReduceOp::sum:
        case ReduceOp::avg:
          acc += v;
          break;
        case ReduceOp::prod:
          acc *= v;
          break;
        case ReduceOp::max:
          acc = std::max(acc, v);
          break;
        case ReduceOp::min:
          acc = std::min(acc, v);
          break;
      }
    }
    if (c.op == ReduceOp::avg) {
      acc = t == DataType::f64 ? acc / p : static_cast<double>(static_cast<float>(acc) / static_cast<float>(p));
    }
    store_float(t, out, acc);
    return;
  }
  const auto wrap = [&](uint64_t u) -> int64_t {  // to the type, sign-extended for i32
    if (t == DataType::u8) return static_cast<int64_t>(u & 0xff);
    if (t == DataType::i32) return static_cast<int32_t>(static_cast<uint32_t>(u));
    return static_cast<int64_t>(u);
  };
  uint64_t acc = static_cast<uint64_t>(vals[0]);
  for (size_t q = 1; q < vals.size(); ++q) {
    const auto v = static_cast<uint64_t>(vals[q]);
    switch (c.op) {
      case ReduceOp::sum:
      case ReduceOp::avg:
        acc += v;
        break;
      case ReduceOp::prod:
        acc *= v;
        break;
      case ReduceOp::max:
        acc = static_cast<uint64_t>(std::max(wrap(acc), wrap(v)));
        break;
      case ReduceOp::min:
        acc = static_cast<uint64_t>(std::min(wrap(acc), wrap(v)));
        break;
    }
  }
  if (c.op == ReduceOp::avg) acc = static_cast<uint64_t>(wrap(acc) / p);
  store_int(t, out, acc);
}

struct Layout {
  std::vector<size_t> counts;  // v forms
  std::vector<size_t> offsets;
  size_t in_elems(const Case& c, int r, int p) const {
    const auto rr = static_cast<size_t>(r);
    switch (c.coll) {
      case Coll::all_reduce:
      case Coll::broadcast:
      case Coll::reduce:
        return c.count;
      case Coll::reduce_scatter:
      case Coll::scatter:
        return offsets.back();
      case Coll::all_gather:
      case Coll::gather:
        return counts[rr];
      case Coll::all_to_all:
        return c.count * static_cast<size_t>(p);
    }
    return 0;
  }
  size_t out_elems(const Case& c, int r, int p) const {
    const auto rr = static_cast<size_t>(r);
    switch (c.coll) {
      case Coll::all_reduce:
      case Coll::broadcast:
      case Coll::reduce:
        return c.count;
      case Coll::reduce_scatter:
      case Coll::scatter:
        return counts[rr];
      case Coll::all_gather:
      case Coll::gather:
        return offsets.back();
      case Coll::all_to_all:
        return c.count * static_cast<size_t>(p);
    }
    return 0;
  }
};

Layout layout_of(const Case& c, int p) {
  Layout l;
  l.counts = shares(c.count, p);
  l.offsets = detail::prefix_sums(l.counts);
  return l;
}

Plan make_plan(const Case& c, const Layout& l, int r, int p) {
  if (c.segment > 0 && c.coll == Coll::all_reduce) return detail::plan_ring_all_reduce(r, p, c.count, c.segment);
  if (c.segment > 0 && c.coll == Coll::reduce_scatter)
    return detail::plan_ring_reduce_scatter(r, p, l.counts, c.segment);
  switch (c.coll) {
    case Coll::all_reduce:
      return plan_all_reduce(c.algo, r, p, c.count);
    case Coll::reduce_scatter:
      return plan_reduce_scatter(c.algo, r, p, l.counts);
    case Coll::all_gather:
      return plan_all_gather(c.algo, r, p, l.counts);
    case Coll::broadcast:
      return plan_broadcast(c.algo, r, p, c.count, c.root);
    case Coll::reduce:
      return plan_reduce(c.algo, r, p, c.count, c.root);
    case Coll::gather:
      return plan_gather(c.algo, r, p, l.counts, c.root);
    case Coll::scatter:
      return plan_scatter(c.algo, r, p, l.counts, c.root);
    case Coll::all_to_all:
      return plan_all_to_all(c.algo, r, p, c.count);
  }
  return {};
}

// ---------------------------------------------------------------------------------------
// Plan well-formedness: what every plan promises (plan.h, plan_common.h), checked statically
// on all ranks' plans together. Returns an empty string when fine.

bool overlaps(const Region& a, const Region& b) {
  return a.buf == b.buf && a.count > 0 && b.count > 0 && a.offset < b.offset + b.count && b.offset < a.offset + a.count;
}

std::string check_plans(const std::vector<Plan>& plans, const std::vector<size_t>& in_elems,
                        const std::vector<size_t>& out_elems) {
  const int p = static_cast<int>(plans.size());
  std::ostringstream err;
  // (round, elements) of every message, per ordered pair.
  std::map<std::pair<int, int>, std::vector<std::pair<size_t, size_t>>> sent, received;
  for (int r = 0; r < p; ++r) {
    const Plan& plan = plans[static_cast<size_t>(r)];
    const auto rr = static_cast<size_t>(r);
    auto in_bounds = [&](const Region& g) {
      const size_t limit = g.buf == Buf::input    ? in_elems[rr]
                           : g.buf == Buf::output ? out_elems[rr]
                                                  : plan.scratch_count;
      return g.offset + g.count <= limit;
    };
    for (size_t k = 0; k < plan.rounds.size(); ++k) {
      std::vector<Region> written, read;  // by the transport during the wait
      for (const PlanOp& op : plan.rounds[k].ops) {
        const std::string where = "rank " + std::to_string(r) + " round " + std::to_string(k) + ": ";
        const bool local = op.kind == PlanOp::Kind::copy || op.kind == PlanOp::Kind::reduce_local;
        if (!local && (op.peer < 0 || op.peer >= p || op.peer == r)) err << where << "bad peer " << op.peer << "\n";
        if (op.kind != PlanOp::Kind::recv && !in_bounds(op.src)) err << where << "src out of bounds\n";
        if (op.kind != PlanOp::Kind::send && !in_bounds(op.dst)) err << where << "dst out of bounds\n";
        if (!local && op.kind != PlanOp::Kind::recv && op.src.buf == Buf::input)
          err << where << "message reads input\n";
        if (op.kind != PlanOp::Kind::send && op.dst.buf == Buf::input) err << where << "writes input\n";
        if (op.kind == PlanOp::Kind::reduce_local && op.src.buf == Buf::input && op.dst.buf != Buf::scratch) {
          err << where << "reduce_local from input into a buffer that may alias it\n";
        }
        if (local && op.src.count != op.dst.count) err << where << "local op sizes differ\n";
        switch (op.kind) {
          case PlanOp::Kind::send:
            read.push_back(op.src);
            sent[{r, op.peer}].push_back({k, op.src.count});
            break;
          case PlanOp::Kind::recv:
            written.push_back(op.dst);
            received[{op.peer, r}].push_back({k, op.dst.count});
            break;
          case PlanOp::Kind::recv_reduce:
            if (op.src.buf != Buf::scratch || op.src.count != op.dst.count) err << where << "bad recv_reduce landing\n";
            if (overlaps(op.src, op.dst)) err << where << "recv_reduce landing overlaps its dst\n";
            written.push_back(op.src);
            received[{op.peer, r}].push_back({k, op.dst.count});
            break;
          default:
            break;
        }
      }
      for (size_t i = 0; i < written.size(); ++i) {
        for (size_t j = 0; j < written.size(); ++j) {
          if (i != j && overlaps(written[i], written[j]))
            err << "rank " << r << " round " << k << ": two receives overlap\n";
        }
        for (const Region& s : read) {
          if (overlaps(written[i], s)) err << "rank " << r << " round " << k << ": a receive overlaps a send\n";
        }
      }
    }
  }
  for (const auto& [pair, msgs] : sent) {
    if (received[pair] != msgs) err << "messages " << pair.first << " -> " << pair.second << " do not match\n";
  }
  for (const auto& [pair, msgs] : received) {
    if (sent[pair] != msgs) err << "messages " << pair.first << " -> " << pair.second << " do not match\n";
  }
  return err.str();
}

// ---------------------------------------------------------------------------------------
// One case, executed on a team; returns "" or a description of what went wrong.

std::string run_case(Team& team, int p, const Case& c, uint64_t tag_base) {
  const Layout l = layout_of(c, p);
  const size_t e = size_of(c.dtype);
  std::vector<Plan> plans;
  std::vector<size_t> in_n, out_n;
  for (int r = 0; r < p; ++r) {
    plans.push_back(make_plan(c, l, r, p));
    in_n.push_back(l.in_elems(c, r, p));
    out_n.push_back(l.out_elems(c, r, p));
  }
  if (std::string bad = check_plans(plans, in_n, out_n); !bad.empty()) return "malformed plan:\n" + bad;

  // Buffers: in place uses one buffer of max(in, out) elements, input at its front.
  constexpr std::byte kSentinel{0xa5};
  std::vector<std::vector<std::byte>> in(static_cast<size_t>(p)), out(static_cast<size_t>(p));
  std::vector<std::vector<std::byte>> in_orig(static_cast<size_t>(p)), out_orig(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    const auto rr = static_cast<size_t>(r);
    std::vector<std::byte> data(in_n[rr] * e);
    for (size_t i = 0; i < in_n[rr]; ++i) store_value(c.dtype, data.data() + i * e, input_value(c, r, i));
    if (c.in_place) {
      out[rr].assign(std::max(in_n[rr], out_n[rr]) * e, kSentinel);
      std::copy(data.begin(), data.end(), out[rr].begin());
    } else {
      in[rr] = data;
      out[rr].assign(out_n[rr] * e, kSentinel);
    }
    in_orig[rr] = data;
    out_orig[rr] = out[rr];
  }

  const auto errors = team.run([&](int r, Transport& t) {
    const auto rr = static_cast<size_t>(r);
    const void* input = c.in_place ? static_cast<const void*>(out[rr].data()) : in[rr].data();
    execute(plans[rr], t, input, out[rr].data(), c.dtype, c.op, tag_base, deadline_after(std::chrono::seconds(20)));
  });
  for (int r = 0; r < p; ++r) {
    if (errors[static_cast<size_t>(r)])
      return "rank " + std::to_string(r) + " threw: " + what_of(errors[static_cast<size_t>(r)]);
  }
  if (const size_t left = team.leftover_messages(); left > 0) return std::to_string(left) + " messages never received";

  // Expected outputs.
  std::ostringstream err;
  int reported = 0;
  auto value_bytes = [&](int q, size_t i) {
    std::vector<std::byte> b(e);
    store_value(c.dtype, b.data(), input_value(c, q, i));
    return b;
  };
  for (int r = 0; r < p; ++r) {
    const auto rr = static_cast<size_t>(r);
    const std::byte* got = out[rr].data();
    const bool untouched = (c.coll == Coll::reduce || c.coll == Coll::gather) && r != c.root;
    if (untouched) {
      if (out[rr] != out_orig[rr]) err << "rank " << r << ": non-root output was written\n";
      continue;
    }
    std::vector<std::byte> expect(out_n[rr] * e);
    for (size_t i = 0; i < out_n[rr]; ++i) {
      std::byte* x = expect.data() + i * e;
      std::vector<int64_t> vals;
      switch (c.coll) {
        case Coll::all_reduce:
        case Coll::reduce:
          for (int q = 0; q < p; ++q) vals.push_back(input_value(c, q, i));
          store_reduced(c, vals, x, p);
          break;
        case Coll::reduce_scatter:
          for (int q = 0; q < p; ++q) vals.push_back(input_value(c, q, l.offsets[rr] + i));
          store_reduced(c, vals, x, p);
          break;
        case Coll::all_gather:
        case Coll::gather: {
          const auto q =
              static_cast<size_t>(std::upper_bound(l.offsets.begin(), l.offsets.end(), i) - l.offsets.begin() - 1);
          std::memcpy(x, value_bytes(static_cast<int>(q), i - l.offsets[q]).data(), e);
          break;
        }
        case Coll::broadcast:
          std::memcpy(x, value_bytes(c.root, i).data(), e);
          break;
        case Coll::scatter:
          std::memcpy(x, value_bytes(c.root, l.offsets[rr] + i).data(), e);
          break;
        case Coll::all_to_all: {
          const size_t q = i / c.count;
          std::memcpy(x, value_bytes(static_cast<int>(q), rr * c.count + i % c.count).data(), e);
          break;
        }
      }
      if (std::memcmp(got + i * e, x, e) != 0 && reported < 5) {
        err << "rank " << r << " element " << i << " differs\n";
        ++reported;
      }
    }
    if (c.in_place) {  // the rest of the buffer is input only: untouched
      const auto tail = static_cast<std::ptrdiff_t>(out_n[rr] * e);
      if (!std::equal(out[rr].begin() + tail, out[rr].end(), out_orig[rr].begin() + tail)) {
        err << "rank " << r << ": in-place buffer written past the output\n";
      }
    } else if (in[rr] != in_orig[rr]) {
      err << "rank " << r << ": input was modified\n";
    }
  }
  return err.str();
}

// Runs every case for each world size on one team; reports at most a few failures.
void run_matrix(const std::vector<int>& sizes, const std::function<std::vector<Case>(int)>& cases_for) {
  int failures = 0;
  size_t ran = 0;
  for (int p : sizes) {
    Team team(p);
    uint64_t tag = 0;
    for (const Case& c : cases_for(p)) {
      const std::string bad = run_case(team, p, c, (++tag) << 20);
      ++ran;
      if (!bad.empty()) {
        ADD_FAILURE() << describe(c, p) << ":\n" << bad;
        if (++failures >= 10) return;
      }
    }
  }
  EXPECT_GT(ran, 0u);
}

const std::vector<size_t> kCounts = {0, 1, 2, 7, 13, 64, 1000, 4099};
const std::vector<int> kAllSizes = {1, 2, 3, 4, 5, 6, 7, 8};
constexpr DataType kDtypes[] = {DataType::f32, DataType::bf16, DataType::f16, DataType::f64,
                                DataType::i32, DataType::i64,  DataType::u8};
constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::prod};

std::vector<int> roots_for(int p) {
  std::set<int> roots = {0, p - 1, p / 2};
  return {roots.begin(), roots.end()};
}

// ---------------------------------------------------------------------------------------
// Executed matrices.

TEST(CommPlan, AllReduceEverySizeAndCount) {
  run_matrix(kAllSizes, [](int) {
    std::vector<Case> cases;
    for (Algorithm a :
         {Algorithm::ring, Algorithm::halving_doubling, Algorithm::recursive_doubling, Algorithm::automatic})
      for (size_t n : kCounts)
        for (auto [t, op] : {std::pair{DataType::f32, ReduceOp::sum}, std::pair{DataType::i32, ReduceOp::max}})
          for (bool in_place : {false, true}) cases.push_back({Coll::all_reduce, a, t, op, n, in_place});
    return cases;
  });
}

TEST(CommPlan, AllReduceEveryDtypeAndOp) {
  run_matrix({2, 3, 5, 8}, [](int) {
    std::vector<Case> cases;
    for (Algorithm a : {Algorithm::ring, Algorithm::halving_doubling, Algorithm::recursive_doubling})
      for (size_t n : {size_t{1}, size_t{13}, size_t{1000}})
        for (DataType t : kDtypes)
          for (ReduceOp op : kOps)
            for (bool in_place : {false, true}) cases.push_back({Coll::all_reduce, a, t, op, n, in_place});
    return cases;
  });
}

TEST(CommPlan, RingWithSmallSegments) {
  // Segmentation exercised at test sizes: segments of 1, 3 and 16 elements (uneven tails).
  run_matrix(kAllSizes, [](int) {
    std::vector<Case> cases;
    for (Coll coll : {Coll::all_reduce, Coll::reduce_scatter})
      for (size_t seg : {size_t{1}, size_t{3}, size_t{16}})
        for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{13}, size_t{64}, size_t{1000}})
          for (bool in_place : {false, true}) {
            if (seg < 16 && n > 64) continue;  // hundreds of rounds per case: slow, no new shape
            cases.push_back({coll, Algorithm::ring, DataType::i32, ReduceOp::sum, n, in_place, 0, seg});
            cases.push_back({coll, Algorithm::ring, DataType::f32, ReduceOp::avg, n, in_place, 0, seg});
          }
    return cases;
  });
}

TEST(CommPlan, RingLargeVectorUsesSegments) {
  // Chunks larger than kRingSegmentElems: two segments per chunk through the public API.
  const size_t n = 3 * detail::kRingSegmentElems + 5;
  const Plan plan = plan_all_reduce(Algorithm::ring, 0, 3, n);
  EXPECT_EQ(plan.rounds.size(), 2u * 2u * 2u);
  EXPECT_LE(plan.scratch_count, detail::kRingSegmentElems);
  run_matrix({3}, [n](int) {
    return std::vector<Case>{{Coll::all_reduce, Algorithm::ring, DataType::i32, ReduceOp::sum, n, true},
                             {Coll::all_reduce, Algorithm::ring, DataType::f32, ReduceOp::sum, n, false},
                             {Coll::reduce_scatter, Algorithm::ring, DataType::i32, ReduceOp::sum, 2 * n, false}};
  });
}

TEST(CommPlan, ReduceScatterEverySizeAndCount) {
  run_matrix(kAllSizes, [](int) {
    std::vector<Case> cases;
    for (Algorithm a : {Algorithm::ring, Algorithm::halving_doubling, Algorithm::automatic})
      for (size_t n : kCounts)
        for (auto [t, op] : {std::pair{DataType::f32, ReduceOp::sum}, std::pair{DataType::i32, ReduceOp::max}})
          for (bool in_place : {false, true}) cases.push_back({Coll::reduce_scatter, a, t, op, n, in_place});
    return cases;
  });
}

TEST(CommPlan, ReduceScatterEveryDtypeAndOp) {
  run_matrix({3, 4, 6}, [](int) {
    std::vector<Case> cases;
    for (Algorithm a : {Algorithm::ring, Algorithm::halving_doubling})
      for (size_t n : {size_t{7}, size_t{64}})
        for (DataType t : kDtypes)
          for (ReduceOp op : kOps)
            for (bool in_place : {false, true}) cases.push_back({Coll::reduce_scatter, a, t, op, n, in_place});
    return cases;
  });
}

TEST(CommPlan, AllGatherEverySizeAndCount) {
  run_matrix(kAllSizes, [](int) {
    std::vector<Case> cases;
    for (Algorithm a :
         {Algorithm::ring, Algorithm::recursive_doubling, Algorithm::halving_doubling, Algorithm::automatic})
      for (size_t n : kCounts)
        for (DataType t : {DataType::u8, DataType::f32})
          for (bool in_place : {false, true}) cases.push_back({Coll::all_gather, a, t, ReduceOp::sum, n, in_place});
    return cases;
  });
}

TEST(CommPlan, RootedCollectivesEverySizeAndCount) {
  run_matrix(kAllSizes, [](int p) {
    std::vector<Case> cases;
    for (Coll coll : {Coll::broadcast, Coll::reduce, Coll::gather, Coll::scatter})
      for (Algorithm a : {Algorithm::binomial, Algorithm::linear, Algorithm::automatic})
        for (int root : roots_for(p))
          for (size_t n : kCounts)
            for (bool in_place : {false, true}) {
              cases.push_back({coll, a, DataType::f32, ReduceOp::sum, n, in_place, root});
              if (coll == Coll::reduce) cases.push_back({coll, a, DataType::i32, ReduceOp::max, n, in_place, root});
            }
    return cases;
  });
}

TEST(CommPlan, ReduceEveryDtypeAndOp) {
  run_matrix({3, 5, 8}, [](int p) {
    std::vector<Case> cases;
    for (Algorithm a : {Algorithm::binomial, Algorithm::linear})
      for (DataType t : kDtypes)
        for (ReduceOp op : kOps)
          for (bool in_place : {false, true}) cases.push_back({Coll::reduce, a, t, op, 13, in_place, p - 1});
    return cases;
  });
}

TEST(CommPlan, DataMovementEveryDtype) {
  run_matrix({3, 4}, [](int p) {
    std::vector<Case> cases;
    for (DataType t : kDtypes) {
      cases.push_back({Coll::all_gather, Algorithm::ring, t, ReduceOp::sum, 13, false});
      cases.push_back({Coll::broadcast, Algorithm::binomial, t, ReduceOp::sum, 13, false, p - 1});
      cases.push_back({Coll::gather, Algorithm::binomial, t, ReduceOp::sum, 13, true, 1});
      cases.push_back({Coll::scatter, Algorithm::binomial, t, ReduceOp::sum, 13, true, 1});
      cases.push_back({Coll::all_to_all, Algorithm::pairwise, t, ReduceOp::sum, 13, false});
    }
    return cases;
  });
}

TEST(CommPlan, AllToAllEverySizeAndCount) {
  run_matrix(kAllSizes, [](int) {
    std::vector<Case> cases;
    for (Algorithm a : {Algorithm::pairwise, Algorithm::automatic})
      for (size_t n : kCounts)
        for (bool in_place : {false, true})
          cases.push_back({Coll::all_to_all, a, DataType::f32, ReduceOp::sum, n, in_place});
    return cases;
  });
}

TEST(CommPlan, RandomFloatsGiveBitwiseIdenticalResultsOnEveryRank) {
  // Non-exact f32 sums: the value depends on the order of reduction, and every rank must
  // still hold the very same bits (data parallelism keeps parameters identical this way).
  for (int p : kAllSizes) {
    Team team(p);
    for (Algorithm a : {Algorithm::ring, Algorithm::halving_doubling, Algorithm::recursive_doubling}) {
      for (size_t n : {size_t{1}, size_t{7}, size_t{1000}, size_t{4099}}) {
        std::vector<std::vector<float>> bufs(static_cast<size_t>(p), std::vector<float>(n));
        std::mt19937 rng(static_cast<unsigned>(p * 1000 + static_cast<int>(n)));
        std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
        std::vector<double> exact(n, 0.0);
        double magnitude = 0;
        for (auto& b : bufs) {
          for (size_t i = 0; i < n; ++i) {
            b[i] = dist(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
            exact[i] += b[i];
            magnitude = std::max(magnitude, static_cast<double>(std::fabs(b[i])));
          }
        }
        const auto errors = team.run([&](int r, Transport& t) {
          auto& b = bufs[static_cast<size_t>(r)];
          execute(plan_all_reduce(a, r, p, n), t, b.data(), b.data(), DataType::f32, ReduceOp::sum, 0,
                  deadline_after(std::chrono::seconds(20)));
        });
        for (const auto& e : errors) ASSERT_FALSE(e) << what_of(e);
        for (int r = 1; r < p; ++r) {
          ASSERT_EQ(std::memcmp(bufs[0].data(), bufs[static_cast<size_t>(r)].data(), n * sizeof(float)), 0)
              << comm::name_of(a) << " p=" << p << " n=" << n << ": rank " << r << " differs from rank 0";
        }
        for (size_t i = 0; i < n; ++i) {
          ASSERT_NEAR(bufs[0][i], exact[i], p * magnitude * 1e-6) << comm::name_of(a) << " p=" << p << " i=" << i;
        }
      }
    }
  }
}

TEST(CommPlan, BarrierLetsNoRankLeaveEarly) {
  for (int p : kAllSizes) {
    Team team(p);
    for (int iter = 0; iter < 20; ++iter) {
      std::atomic<int> arrived{0};
      std::atomic<int> early{0};
      const auto errors = team.run([&](int r, Transport& t) {
        arrived.fetch_add(1);
        execute(plan_barrier(r, p), t, nullptr, nullptr, DataType::u8, ReduceOp::sum, 0,
                deadline_after(std::chrono::seconds(20)));
        if (arrived.load() != p) early.fetch_add(1);
      });
      for (const auto& e : errors) ASSERT_FALSE(e) << what_of(e);
      ASSERT_EQ(early.load(), 0) << "p=" << p;
    }
    EXPECT_EQ(plan_barrier(0, p).rounds.size(), static_cast<size_t>(detail::ceil_log2(p)));
  }
}

TEST(CommPlan, MissingPeerTimesOutNamingIt) {
  Team team(3);
  const auto start = Clock::now();
  const auto errors = team.run([&](int r, Transport& t) {
    if (r == 2) return;  // never joins
    std::vector<float> buf(100, 1.0f);
    execute(plan_all_reduce(Algorithm::ring, r, 3, buf.size()), t, buf.data(), buf.data(), DataType::f32, ReduceOp::sum,
            0, deadline_after(std::chrono::milliseconds(200)));
  });
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  // The first rank to time out aborts the hub, so the other may report the abort instead.
  bool named = false;
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[static_cast<size_t>(r)]) << "rank " << r << " should have failed";
    try {
      std::rethrow_exception(errors[static_cast<size_t>(r)]);
    } catch (const TransportError& e) {
      if (e.kind() == TransportError::Kind::timeout) {
        named = named || std::find(e.peers().begin(), e.peers().end(), 2) != e.peers().end();
      }
    }
  }
  EXPECT_TRUE(named) << "a timeout should name rank 2";
}

// ---------------------------------------------------------------------------------------
// Plan-only checks.

size_t sent_elements(const Plan& plan) {
  size_t n = 0;
  for (const Round& round : plan.rounds)
    for (const PlanOp& op : round.ops)
      if (op.kind == PlanOp::Kind::send) n += op.src.count;
  return n;
}

size_t rounds_with_messages(const Plan& plan) {
  return static_cast<size_t>(std::count_if(plan.rounds.begin(), plan.rounds.end(), [](const Round& r) {
    return std::any_of(r.ops.begin(), r.ops.end(), [](const PlanOp& op) {
      return op.kind != PlanOp::Kind::copy && op.kind != PlanOp::Kind::reduce_local;
    });
  }));
}

TEST(CommPlan, RingAllReduceSendsTwoNTimesPMinusOneOverP) {
  for (int p = 2; p <= 8; ++p) {
    for (size_t n : {size_t{8}, size_t{1000}, size_t{4099}, size_t{1} << 16, size_t{3} << 20}) {
      const std::vector<size_t> chunks = detail::even_counts(n, p);
      const size_t segs = (chunks[0] + detail::kRingSegmentElems - 1) / detail::kRingSegmentElems;
      for (int r = 0; r < p; ++r) {
        const Plan plan = plan_all_reduce(Algorithm::ring, r, p, n);
        const size_t sent = sent_elements(plan);
        // Exactly: everything but our chunk in reduce-scatter, everything but the right
        // neighbour's chunk in all-gather.
        EXPECT_EQ(sent, 2 * n - chunks[static_cast<size_t>(r)] - chunks[static_cast<size_t>((r + 1) % p)]);
        const double model = 2.0 * (p - 1) / p * static_cast<double>(n);
        EXPECT_LE(std::fabs(static_cast<double>(sent) - model), 2.0) << "p=" << p << " n=" << n;
        EXPECT_EQ(plan.rounds.size(), 2 * static_cast<size_t>(p - 1) * segs) << "p=" << p << " n=" << n;
        EXPECT_LE(plan.scratch_count, detail::kRingSegmentElems);
      }
    }
  }
}

TEST(CommPlan, RoundCountsMatchCostModel) {
  for (int p = 2; p <= 16; ++p) {
    const bool pow2 = (p & (p - 1)) == 0;
    const size_t lg = static_cast<size_t>(detail::Fold(p).log2_p2);
    const size_t fold = pow2 ? 0 : 2;
    const size_t n = 1000;
    for (int r = 0; r < p; ++r) {
      EXPECT_EQ(plan_all_reduce(Algorithm::ring, r, p, n).rounds.size(), 2u * static_cast<size_t>(p - 1));
      EXPECT_EQ(plan_all_reduce(Algorithm::recursive_doubling, r, p, n).rounds.size(), lg + fold) << "p=" << p;
      EXPECT_EQ(plan_all_reduce(Algorithm::halving_doubling, r, p, n).rounds.size(), 2 * lg + fold) << "p=" << p;
      EXPECT_EQ(
          plan_reduce_scatter(Algorithm::ring, r, p, std::vector<size_t>(static_cast<size_t>(p), 9)).rounds.size(),
          static_cast<size_t>(p - 1));
      EXPECT_EQ(plan_reduce_scatter(Algorithm::halving_doubling, r, p, std::vector<size_t>(static_cast<size_t>(p), 9))
                    .rounds.size(),
                lg + fold);
      EXPECT_EQ(plan_all_gather(Algorithm::ring, r, p, std::vector<size_t>(static_cast<size_t>(p), 9)).rounds.size(),
                static_cast<size_t>(p - 1));
      EXPECT_EQ(plan_all_gather(Algorithm::recursive_doubling, r, p, std::vector<size_t>(static_cast<size_t>(p), 9))
                    .rounds.size(),
                lg + fold);
      EXPECT_EQ(plan_broadcast(Algorithm::binomial, r, p, n, 0).rounds.size(),
                static_cast<size_t>(detail::ceil_log2(p)));
      EXPECT_EQ(plan_reduce(Algorithm::binomial, r, p, n, 0).rounds.size(), static_cast<size_t>(detail::ceil_log2(p)));
      EXPECT_EQ(plan_all_to_all(Algorithm::pairwise, r, p, 4).rounds.size(), static_cast<size_t>(p - 1));
      EXPECT_EQ(plan_broadcast(Algorithm::linear, r, p, n, 0).rounds.size(), 1u);
      // Recursive doubling sends the whole vector each round; halving-doubling ~2n(p-1)/p.
      const Plan rd = plan_all_reduce(Algorithm::recursive_doubling, r, p, n);
      const Plan hd = plan_all_reduce(Algorithm::halving_doubling, r, p, n);
      if (pow2) {
        EXPECT_EQ(sent_elements(rd), lg * n);
        EXPECT_NEAR(static_cast<double>(sent_elements(hd)), 2.0 * (p - 1) / p * n, 2.0 * lg);
        EXPECT_EQ(rounds_with_messages(rd), lg);
      }
    }
  }
}

TEST(CommPlan, PlansAreWellFormedIncludingLargeCounts) {
  // Static checks only (no execution), so large vectors and many segments are cheap.
  for (int p : {1, 2, 3, 5, 7, 8, 12}) {
    for (size_t n : {size_t{0}, size_t{5}, size_t{1} << 18, (size_t{1} << 20) + 3}) {
      for (Algorithm a : {Algorithm::ring, Algorithm::halving_doubling, Algorithm::recursive_doubling}) {
        std::vector<Plan> plans;
        for (int r = 0; r < p; ++r) plans.push_back(plan_all_reduce(a, r, p, n));
        const std::string bad = check_plans(plans, std::vector<size_t>(static_cast<size_t>(p), n),
                                            std::vector<size_t>(static_cast<size_t>(p), n));
        EXPECT_TRUE(bad.empty()) << comm::name_of(a) << " p=" << p << " n=" << n << ":\n" << bad;
      }
      const std::vector<size_t> counts = shares(n, p);
      const size_t total = detail::prefix_sums(counts).back();
      std::vector<Plan> rs, ag;
      for (int r = 0; r < p; ++r) {
        rs.push_back(plan_reduce_scatter(Algorithm::ring, r, p, counts));
        ag.push_back(plan_all_gather(Algorithm::ring, r, p, counts));
      }
      std::vector<size_t> totals(static_cast<size_t>(p), total);
      EXPECT_EQ(check_plans(rs, totals, counts), "") << "reduce_scatter p=" << p << " n=" << n;
      EXPECT_EQ(check_plans(ag, counts, totals), "") << "all_gather p=" << p << " n=" << n;
    }
  }
}

TEST(CommPlan, AlgorithmNamesRoundTrip) {
  for (const char* name : {"auto", "ring", "hd", "rd", "tree", "linear", "pairwise"}) {
    EXPECT_STREQ(comm::name_of(parse_algorithm(name)), name);
  }
  try {
    parse_algorithm("butterfly");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("butterfly"), std::string::npos) << what;
    for (const char* name : {"auto", "ring", "hd", "rd", "tree", "linear", "pairwise"}) {
      EXPECT_NE(what.find(name), std::string::npos) << what;
    }
  }
}

TEST(CommPlan, AlgorithmThatDoesNotApplyNamesBoth) {
  auto expect_error = [](const std::function<void()>& f, const std::string& algo, const std::string& coll) {
    try {
      f();
      ADD_FAILURE() << "expected an error for " << algo << " / " << coll;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'" + algo + "'"), std::string::npos) << what;
      EXPECT_NE(what.find(coll), std::string::npos) << what;
    }
  };
  expect_error([] { plan_broadcast(Algorithm::pairwise, 0, 4, 10, 0); }, "pairwise", "broadcast");
  expect_error([] { plan_all_reduce(Algorithm::binomial, 0, 4, 10); }, "tree", "all_reduce");
  expect_error([] { plan_reduce_scatter(Algorithm::recursive_doubling, 0, 2, {1, 1}); }, "rd", "reduce_scatter");
  expect_error([] { plan_all_to_all(Algorithm::ring, 0, 4, 10); }, "ring", "all_to_all");
  expect_error([] { plan_gather(Algorithm::halving_doubling, 0, 2, {1, 1}, 0); }, "hd", "gather");
}

TEST(CommPlan, InvalidArgumentsAreRejected) {
  EXPECT_THROW(plan_all_reduce(Algorithm::ring, 4, 4, 10), Error);
  EXPECT_THROW(plan_all_reduce(Algorithm::ring, 0, 0, 10), Error);
  EXPECT_THROW(plan_reduce_scatter(Algorithm::ring, 0, 3, {1, 2}), Error);
  EXPECT_THROW(plan_broadcast(Algorithm::binomial, 0, 3, 10, 3), Error);
  EXPECT_THROW(plan_reduce(Algorithm::binomial, 0, 3, 10, -1), Error);
}

TEST(CommPlan, ChooseAllReduceBySize) {
  EXPECT_EQ(choose_all_reduce(1024, 8), Algorithm::recursive_doubling);
  EXPECT_EQ(choose_all_reduce(128 * 1024, 8), Algorithm::halving_doubling);
  EXPECT_EQ(choose_all_reduce(64u << 20, 8), Algorithm::ring);
  EXPECT_EQ(choose_all_reduce(64u << 20, 3), Algorithm::ring);
  // Never returns automatic, and every choice plans.
  for (size_t bytes : {size_t{0}, size_t{4}, size_t{1} << 14, size_t{1} << 20, size_t{1} << 28}) {
    for (int p = 1; p <= 8; ++p) {
      const Algorithm a = choose_all_reduce(bytes, p);
      EXPECT_NE(a, Algorithm::automatic);
      EXPECT_NO_THROW(plan_all_reduce(a, 0, p, bytes / 4));
    }
  }
}

}  // namespace
}  // namespace dtrain::comm
