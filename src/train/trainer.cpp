#include "dtrain/train/trainer.h"

#include <dirent.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <thread>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "dtrain/core/error.h"
#include "dtrain/core/file.h"
#include "dtrain/comm/group.h"
#include "dtrain/comm/progress.h"
#include "dtrain/core/log.h"
#include "dtrain/parallel/ddp.h"
#include "dtrain/parallel/mesh.h"
#include "dtrain/parallel/pipeline.h"
#include "dtrain/parallel/tensor_parallel.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/metrics.h"
#include "dtrain/train/model_io.h"

namespace dtrain::train {

using Clock = std::chrono::steady_clock;

std::shared_ptr<nn::Model> build_model(const TrainConfig& cfg, nn::BlockRange range) {
  if (cfg.model == "mlp") {
    return std::make_shared<nn::Mlp>(data::FashionMnist::kPixels, cfg.hidden, data::FashionMnist::kClasses, cfg.seed,
                                     range);
  }
  nn::GptConfig g;
  g.layers = cfg.layers;
  g.heads = cfg.heads;
  g.width = cfg.width;
  g.seq_len = cfg.seq_len;
  g.dropout = cfg.dropout;
  return std::make_shared<nn::Gpt>(g, cfg.seed, range);
}

std::unique_ptr<optim::Optimizer> build_optimizer(const TrainConfig& cfg, std::vector<Tensor> params) {
  if (cfg.optimizer == "sgd") {
    return std::make_unique<optim::Sgd>(std::move(params), cfg.lr, cfg.momentum, cfg.weight_decay);
  }
  return std::make_unique<optim::AdamW>(std::move(params), cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay);
}

std::string model_metadata(const TrainConfig& cfg) {
  nlohmann::json j{{"model", cfg.model}};
  if (cfg.model == "mlp") {
    j["hidden"] = cfg.hidden;
  } else {
    j["layers"] = cfg.layers;
    j["heads"] = cfg.heads;
    j["width"] = cfg.width;
    j["seq_len"] = cfg.seq_len;
  }
  return j.dump();
}

DataSource build_data(const TrainConfig& cfg) {
  DataSource src;
  if (cfg.data.rfind("fashion-mnist", 0) == 0) {
    const std::string dir = cfg.data.size() > 14 && cfg.data[13] == ':' ? cfg.data.substr(14)
                                                                       : data::FashionMnist::kDefaultDir;
    src.train = std::make_shared<data::FashionMnist>(dir, true);
    src.eval = std::make_shared<data::FashionMnist>(dir, false);
    return src;
  }
  const std::string path = cfg.data.substr(5);
  src.corpus = std::make_shared<data::TextCorpus>(path, cfg.seq_len, cfg.val_fraction);
  // Aliasing constructors: the splits live inside the corpus.
  src.train = std::shared_ptr<data::Dataset>(src.corpus, const_cast<data::TextCorpus::Split*>(&src.corpus->train()));
  src.eval = std::shared_ptr<data::Dataset>(src.corpus, const_cast<data::TextCorpus::Split*>(&src.corpus->val()));
  src.tokens_per_sample = cfg.seq_len;
  return src;
}

double evaluate(nn::Model& model, const data::Dataset& eval, int64_t batch_size, int64_t max_batches,
                const std::function<Tensor(const Tensor&)>& forward) {
  NoGradGuard no_grad;
  model.train(false);
  const int64_t n = eval.size();
  int64_t batches = (n + batch_size - 1) / batch_size;
  if (max_batches > 0) batches = std::min(batches, max_batches);
  const bool classify = model.kind() == "mlp";
  double total = 0.0;
  int64_t count = 0;
  for (int64_t b = 0; b < batches; ++b) {
    comm::note_progress("evaluation");
    std::vector<int64_t> idx;
    for (int64_t i = b * batch_size; i < std::min(n, (b + 1) * batch_size); ++i) idx.push_back(i);
    data::Batch batch = eval.get(idx);
    Tensor out = forward ? forward(batch.x) : model.forward(batch.x);
    if (!out.defined()) continue;
    if (classify) {
      const std::vector<float> logits = out.to_vector();
      const std::vector<float> y = batch.y.to_vector();
      const int64_t c = out.size(-1);
      for (size_t r = 0; r < y.size(); ++r) {
        const float* row = logits.data() + r * static_cast<size_t>(c);
        const int64_t pred = std::max_element(row, row + c) - row;
        total += pred == static_cast<int64_t>(y[r]) ? 1.0 : 0.0;
      }
      count += static_cast<int64_t>(y.size());
    } else {
      total += static_cast<double>(model.loss(out, batch.y).item()) * static_cast<double>(idx.size());
      count += static_cast<int64_t>(idx.size());
    }
  }
  model.train(true);
  return count > 0 ? total / static_cast<double>(count) : 0.0;
}

namespace {

double seconds_since(Clock::time_point t0, Clock::time_point t) { return std::chrono::duration<double>(t - t0).count(); }

// Chrome / Perfetto trace events ("X" complete events), microseconds since the run started.
// Kept as plain records (a run has millions of them) and turned into JSON once at the end.
class Trace {
 public:
  Trace(bool on, int rank, Clock::time_point origin) : on_(on), rank_(rank), origin_(origin) {}
  void span(const char* name, int index, int tid, Clock::time_point start, Clock::time_point end, int64_t step,
            int64_t bytes = -1) {
    if (!on_) return;
    spans_.push_back({name, index, tid, seconds_since(origin_, start) * 1e6,
                      std::max(0.0, seconds_since(start, end) * 1e6), step, bytes});
  }
  nlohmann::json events() const {
    nlohmann::json out = nlohmann::json::array();
    for (const Span& s : spans_) {
      nlohmann::json e{{"name", s.index >= 0 ? fmt::format("{} {}", s.name, s.index) : std::string(s.name)},
                       {"ph", "X"},
                       {"pid", rank_},
                       {"tid", s.tid},
                       {"ts", s.ts},
                       {"dur", s.dur},
                       {"args", {{"step", s.step}}}};
      if (s.bytes >= 0) e["args"]["bytes"] = s.bytes;
      out.push_back(std::move(e));
    }
    return out;
  }

 private:
  struct Span {
    const char* name;
    int index;  // micro-step or bucket, -1: none
    int tid;
    double ts, dur;
    int64_t step, bytes;
  };
  bool on_;
  int rank_;
  Clock::time_point origin_;
  std::vector<Span> spans_;
};

constexpr uint32_t kTagTrace = 9;  // point-to-point tag on the world group: trace events to rank 0

// Every rank sends its events to rank 0, which writes them all into `path` (one process per
// rank row), atomically and never through a symlink (write_file_atomic).
void write_trace(const Trace& trace, const std::string& path, comm::Group* group, int rank, int world) {
  auto metadata = [](int r, int tid, const std::string& name) {
    return nlohmann::json{{"name", "thread_name"}, {"ph", "M"}, {"pid", r}, {"tid", tid}, {"args", {{"name", name}}}};
  };
  nlohmann::json ev = trace.events();
  ev.push_back(nlohmann::json{{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", fmt::format("rank {}", rank)}}}});
  ev.push_back(metadata(rank, 0, "compute"));
  ev.push_back(metadata(rank, 1, "communication"));
  if (world > 1 && group != nullptr && rank != 0) {
    const std::string text = ev.dump();
    const uint64_t n = text.size();
    group->send(&n, 1, comm::DataType::i64, 0, kTagTrace);
    group->send(text.data(), text.size(), comm::DataType::u8, 0, kTagTrace);
    return;
  }
  nlohmann::json all = std::move(ev);
  for (int r = 1; group != nullptr && r < world; ++r) {
    uint64_t n = 0;
    group->recv(&n, 1, comm::DataType::i64, r, kTagTrace);
    DT_CHECK(n < (uint64_t{1} << 34), "train", "rank {} sent a trace of {} bytes", r, n);
    std::string text(n, '\0');
    group->recv(text.data(), text.size(), comm::DataType::u8, r, kTagTrace);
    nlohmann::json part = nlohmann::json::parse(text, nullptr, false);
    DT_CHECK(part.is_array(), "train", "rank {} sent an unreadable trace", r);
    for (auto& e : part) all.push_back(std::move(e));
  }
  write_file_atomic(path, nlohmann::json{{"traceEvents", all}, {"displayTimeUnit", "ms"}}.dump() + "\n", "train");
}

}  // namespace

namespace {

// Bytes of parameters, gradients and optimizer state one process will hold, from the stage's
// parameter count and the layout (before any gradient or state exists).
struct StateEstimate {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t total() const { return params + grads + optimizer; }
};

StateEstimate estimate_state(const TrainConfig& cfg, int64_t local_params) {
  StateEstimate e;
  e.params = 4 * local_params;
  e.grads = cfg.zero == 2 ? e.params / cfg.dp : e.params;
  const int64_t copies = cfg.optimizer == "adamw" ? 2 : (cfg.momentum != 0.0f ? 1 : 0);
  e.optimizer = copies * e.params / (cfg.zero >= 1 ? cfg.dp : 1);
  return e;
}

std::string mib(int64_t bytes) { return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20)); }

// Point-to-point tags on the world group at the end of a run.
constexpr uint32_t kTagGatherModel = 7;
constexpr uint32_t kTagEvaluation = 8;

// Rank 0 of `world` gets the whole model's parameters, in the single-process order, from the
// stages (dp 0, tp 0); the caller has gathered the tensor-parallel shards already.
std::vector<nn::NamedTensor> gather_full_model(std::vector<nn::NamedTensor> local, parallel::Mesh& mesh) {
  const parallel::MeshShape& shape = mesh.shape();
  const parallel::MeshCoord c = mesh.coord();
  comm::Group& world = mesh.world();
  if (shape.pp == 1) return local;
  if (c.dp != 0 || c.tp != 0) return {};
  if (c.pp != 0) {
    nlohmann::json header = nlohmann::json::array();
    for (const auto& [name, t] : local) header.push_back({{"name", name}, {"shape", t.shape()}});
    const std::string text = header.dump();
    const int64_t n = static_cast<int64_t>(text.size());
    world.send(&n, 1, comm::DataType::i64, 0, kTagGatherModel);
    world.send(text.data(), text.size(), comm::DataType::u8, 0, kTagGatherModel);
    for (const auto& [name, t] : local) {
      Tensor d = t.contiguous();
      world.send(d.data(), static_cast<size_t>(d.numel()), comm::DataType::f32, 0, kTagGatherModel);
    }
    return {};
  }
  for (int s = 1; s < shape.pp; ++s) {
    const int from = parallel::mesh_rank(shape, {0, s, 0});
    int64_t n = 0;
    world.recv(&n, 1, comm::DataType::i64, from, kTagGatherModel);
    DT_CHECK(n > 0 && n < (int64_t{1} << 30), "train", "stage {} sent a parameter list of {} bytes", s, n);
    std::string text(static_cast<size_t>(n), '\0');
    world.recv(text.data(), text.size(), comm::DataType::u8, from, kTagGatherModel);
    const nlohmann::json header = nlohmann::json::parse(text, nullptr, false);
    DT_CHECK(header.is_array(), "train", "stage {} sent an unreadable parameter list", s);
    for (const auto& e : header) {
      Tensor t = Tensor::empty(e.at("shape").get<Shape>());
      world.recv(t.data(), static_cast<size_t>(t.numel()), comm::DataType::f32, from, kTagGatherModel);
      local.emplace_back(e.at("name").get<std::string>(), t);
    }
  }
  return local;
}

// DTRAIN_FAULT: faults to inject, for tests and demonstrations. A comma-separated list of
// KIND:rank=R:step=S[:phase=step|allreduce|checkpoint][:attempt=A][:ms=M]. Rank R acts when it
// starts step S (1-based); with phase=allreduce, after its backward, when the other ranks are
// in (or entering) the gradient all_reduce; with phase=checkpoint, in the middle of writing the
// checkpoint of step S (its file written, the manifest not yet). KIND is
//   kill   SIGKILL itself (a crash);
//   stop   SIGSTOP itself (a hung process: only the heartbeats can tell);
//   delay  sleep M ms (a straggler: the run goes on unless M exceeds --timeout);
//   drop   shut down every socket it holds (a lost network: store and TCP peers);
//   hang   block its main thread for good, as a read from a stuck file system does, while its
//          heartbeat thread beats on (only the progress watch can tell, comm/progress.h);
//   exit   exit(0) in the middle of the job (a script that returns early: its peers would wait).
// A delay is a straggler that still makes progress (it notes progress while it sleeps).
// Only on start A of the job (DTRAIN_RESTART, default 0), so that a restarted job runs through;
// attempt=any fires on every start (a worker that cannot come back).
enum class FaultPhase { step, allreduce, checkpoint };
enum class FaultKind { kill, stop, delay, drop, hang, exit };

struct Fault {
  FaultKind kind = FaultKind::kill;
  int64_t ms = 0;
  int rank = -1;
  int64_t step = -1;
  FaultPhase phase = FaultPhase::step;
  int attempt = 0;
};

std::vector<Fault> faults_from_env(int rank) {
  std::vector<Fault> out;
  const char* spec = std::getenv("DTRAIN_FAULT");
  if (spec == nullptr || *spec == '\0') return out;
  const char* restart = std::getenv("DTRAIN_RESTART");
  const int attempt = restart != nullptr ? std::atoi(restart) : 0;
  std::string all = spec;
  size_t at = 0;
  while (at <= all.size()) {
    const size_t comma = std::min(all.find(',', at), all.size());
    const std::string one = all.substr(at, comma - at);
    at = comma + 1;
    Fault f;
    bool kind_given = false;
    size_t p = 0;
    while (p <= one.size()) {
      const size_t colon = std::min(one.find(':', p), one.size());
      const std::string part = one.substr(p, colon - p);
      p = colon + 1;
      const size_t eq = part.find('=');
      const std::string key = part.substr(0, eq), value = eq == std::string::npos ? "" : part.substr(eq + 1);
      try {
        if (!kind_given && (part == "kill" || part == "stop" || part == "delay" || part == "drop" || part == "hang" ||
                            part == "exit")) {
          kind_given = true;
          f.kind = part == "kill"    ? FaultKind::kill
                   : part == "stop"  ? FaultKind::stop
                   : part == "delay" ? FaultKind::delay
                   : part == "hang"  ? FaultKind::hang
                   : part == "exit"  ? FaultKind::exit
                                     : FaultKind::drop;
        } else if (key == "ms") {
          f.ms = std::stoll(value);
        } else if (key == "rank") {
          f.rank = std::stoi(value);
        } else if (key == "step") {
          f.step = std::stoll(value);
        } else if (key == "attempt") {
          f.attempt = value == "any" ? -1 : std::stoi(value);
        } else if (key == "phase" && (value == "step" || value == "allreduce" || value == "checkpoint")) {
          f.phase = value == "step" ? FaultPhase::step
                                    : (value == "allreduce" ? FaultPhase::allreduce : FaultPhase::checkpoint);
        } else {
          throw std::invalid_argument(part);
        }
      } catch (const std::exception&) {
        DT_THROW("train",
                 "DTRAIN_FAULT '{}': cannot read '{}' (expected "
                 "kill|stop|delay|drop|hang|exit:rank=R:step=S[:phase=step|allreduce|checkpoint][:attempt=A|any][:ms=M])",
                 spec, part);
      }
    }
    DT_CHECK(kind_given && f.rank >= 0 && f.step >= 1, "train",
             "DTRAIN_FAULT '{}': '{}' needs a kind (kill, stop, delay, drop, hang or exit) first, rank=R and step=S (S >= 1)", spec,
             one);
    DT_CHECK((f.kind == FaultKind::delay) == (f.ms > 0), "train",
             "DTRAIN_FAULT '{}': '{}': ms=M (M > 0) goes with delay, and only with delay", spec, one);
    if (f.rank == rank && (f.attempt == attempt || f.attempt < 0)) out.push_back(f);
  }
  return out;
}

// Shuts down every socket of this process: its connections to the store and to TCP peers
// break as if the network went away (the peers read end-of-stream, later writes fail).
void drop_connections() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return;
  std::vector<int> fds;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') fds.push_back(std::atoi(e->d_name));
  }
  ::closedir(dir);
  for (int fd : fds) {
    struct stat st {};
    if (::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode)) ::shutdown(fd, SHUT_RDWR);
  }
}

void maybe_fail(const std::vector<Fault>& faults, int64_t step, FaultPhase phase) {
  static const char* const where[] = {"", " before its gradient all_reduce", " during its checkpoint write"};
  for (const Fault& f : faults) {
    if (f.step != step || f.phase != phase) continue;
    const char* at = where[static_cast<int>(phase)];
    switch (f.kind) {
      case FaultKind::kill:
        DT_LOG_WARN("DTRAIN_FAULT: killing this rank (pid {}) at step {}{}", ::getpid(), step, at);
        ::raise(SIGKILL);
        break;
      case FaultKind::stop:
        DT_LOG_WARN("DTRAIN_FAULT: stopping this rank (pid {}, SIGSTOP) at step {}{}", ::getpid(), step, at);
        ::raise(SIGSTOP);
        break;
      case FaultKind::delay: {
        DT_LOG_WARN("DTRAIN_FAULT: delaying this rank by {} ms at step {}{}", f.ms, step, at);
        const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(f.ms);
        while (std::chrono::steady_clock::now() < until) {
          comm::note_progress("a delay (DTRAIN_FAULT)", step);  // slow, not stuck
          std::this_thread::sleep_until(std::min(until, std::chrono::steady_clock::now() + std::chrono::milliseconds(100)));
        }
        break;
      }
      case FaultKind::exit:
        DT_LOG_WARN("DTRAIN_FAULT: this rank (pid {}) exits with code 0 at step {}{}", ::getpid(), step, at);
        std::exit(0);
      case FaultKind::hang: {
        DT_LOG_WARN("DTRAIN_FAULT: hanging this rank's main thread (pid {}) at step {}{}", ::getpid(), step, at);
        comm::note_progress("reading its data (DTRAIN_FAULT hang)", step);
        int fds[2];
        if (::pipe(fds) == 0) {
          char c;
          while (::read(fds[0], &c, 1) != 0) {  // nobody writes: blocks until the process is stopped
          }
        }
        break;
      }
      case FaultKind::drop:
        DT_LOG_WARN("DTRAIN_FAULT: dropping every connection of this rank (pid {}) at step {}{}", ::getpid(), step, at);
        drop_connections();
        break;
    }
  }
}

// Checkpoints hold the optimizer state per parameter name ("exp_avg/h0.qkv.weight"), whole
// even under ZeRO, so that another data-parallel or pipeline layout can load it.
CheckpointShard checkpoint_shard(int64_t step, const nn::Model& model, const optim::Optimizer& optimizer,
                                 const parallel::DataParallel* ddp) {
  CheckpointShard shard;
  shard.step = step;
  shard.params = model.named_parameters();
  const bool zero = ddp != nullptr && ddp->sharded();
  const size_t slots = optimizer.params().size();
  // state() names are "KIND.INDEX" over the optimizer's parameters (ZeRO: bucket pieces).
  std::map<std::string, std::vector<Tensor>> kinds;
  for (const auto& [name, t] : optimizer.state()) {
    const size_t dot = name.rfind('.');
    DT_CHECK(dot != std::string::npos, "checkpoint", "optimizer state '{}' has no index", name);
    auto& v = kinds[name.substr(0, dot)];
    v.resize(slots);
    v.at(std::stoul(name.substr(dot + 1))) = t;
  }
  for (auto& [kind, v] : kinds) {
    if (zero) {
      for (size_t j = 0; j < v.size(); ++j) {
        if (!v[j].defined()) v[j] = Tensor::zeros(optimizer.params()[j].shape());
      }
      v = ddp->gather_pieces(v);  // collective over the replicas; kinds in the same order everywhere
    }
    for (size_t k = 0; k < v.size(); ++k) {
      if (v[k].defined()) shard.optimizer.emplace_back(kind + "/" + shard.params[k].first, v[k]);
    }
  }
  // This rank's compression state (error feedback, PowerSGD): its own, for the same layout.
  if (ddp != nullptr) {
    for (auto& [name, t] : ddp->compression_state()) shard.optimizer.emplace_back("comm/" + name, t);
  }
  const std::vector<int64_t> counters = optimizer.counters();
  shard.step_count = counters.at(0);
  if (counters.size() > 1) {
    for (size_t k = 0; k < shard.params.size(); ++k) {
      shard.param_steps[shard.params[k].first] = counters.at(1 + (zero ? ddp->piece_holding(k) : k));
    }
  }
  return shard;
}

// Loads a checkpoint written by any data-parallel / pipeline / ZeRO layout: this rank's
// parameters by name from the shards of the writer's first replica (its stages with this
// rank's tensor-parallel coordinate), its optimizer state cut to this layout.
void restore_checkpoint(const Checkpointer& ckpt, const CheckpointFound& found, nn::Model& model,
                        optim::Optimizer& optimizer, parallel::DataParallel* ddp, const parallel::MeshCoord& coord) {
  const nlohmann::json& lay = found.layout;
  const parallel::MeshShape old{lay.at("dp").get<int>(), lay.at("pp").get<int>(), lay.at("tp").get<int>()};
  std::map<std::string, Tensor> params, state;
  std::map<std::string, int64_t> steps;
  int64_t step_count = 0;
  for (int s = 0; s < old.pp; ++s) {
    CheckpointShard shard = ckpt.read(found.step, parallel::mesh_rank(old, {0, s, coord.tp}));
    for (auto& [name, t] : shard.params) params[name] = t;
    for (auto& [name, t] : shard.optimizer) state[name] = t;
    for (auto& [name, n] : shard.param_steps) steps[name] = n;
    step_count = shard.step_count;
  }
  auto named = model.named_parameters();
  NoGradGuard no_grad;
  // Ranks that share one copy of the parameters (ZeRO-1 on one host): the first writes it, and
  // the others wait for it below instead of writing the same bytes at the same time.
  const bool shared = ddp != nullptr && ddp->shares_parameters();
  for (auto& [name, p] : named) {
    auto it = params.find(name);
    DT_CHECK(it != params.end() && it->second.shape() == p.shape(), "train",
             "checkpoint step {} has no parameter '{}' of shape {}", found.step, name, shape_str(p.shape()));
    if (!shared || coord.dp == 0) p.copy_from(it->second);
  }
  if (shared) ddp->gather_parameters();  // in shared memory, a barrier
  // The state kinds, and per kind one tensor per parameter of this rank (undefined: none).
  std::map<std::string, std::vector<Tensor>> kinds;
  for (const auto& [key, t] : state) {
    if (key.starts_with("comm/")) continue;  // compression state: per rank, restored by the caller
    const size_t slash = key.find('/');
    kinds[key.substr(0, slash)].resize(named.size());
  }
  for (auto& [kind, v] : kinds) {
    for (size_t k = 0; k < named.size(); ++k) {
      auto it = state.find(kind + "/" + named[k].first);
      if (it != state.end()) v[k] = it->second;
    }
  }
  const bool zero = ddp != nullptr && ddp->sharded();
  std::vector<nn::NamedTensor> loaded;
  for (auto& [kind, v] : kinds) {
    if (zero) v = ddp->scatter_pieces(v);
    for (size_t j = 0; j < v.size(); ++j) {
      if (v[j].defined()) loaded.emplace_back(kind + "." + std::to_string(j), v[j]);
    }
  }
  std::vector<int64_t> counters{step_count};
  if (!steps.empty()) {
    counters.resize(1 + optimizer.params().size(), 0);
    for (size_t k = 0; k < named.size(); ++k) {
      const size_t slot = zero ? ddp->piece_holding(k) : k;
      counters[1 + slot] = std::max(counters[1 + slot], steps.count(named[k].first) ? steps[named[k].first] : 0);
    }
  }
  optimizer.load_state(loaded, counters);
}

// The options that must be the same on every rank: all that shape the math, the data order,
// the layout and the run's length (outputs, logging and threads may differ).
nlohmann::json run_options(const TrainConfig& c) {
  return nlohmann::json{
      {"model", c.model}, {"hidden", c.hidden}, {"layers", c.layers}, {"heads", c.heads}, {"width", c.width},
      {"seq-len", c.seq_len}, {"dropout", c.dropout}, {"val-fraction", c.val_fraction}, {"steps", c.steps},
      {"epochs", c.epochs}, {"batch-size", c.batch_size}, {"optimizer", c.optimizer}, {"lr", c.lr},
      {"momentum", c.momentum}, {"weight-decay", c.weight_decay}, {"beta1", c.beta1}, {"beta2", c.beta2},
      {"eps", c.eps}, {"lr-schedule", c.lr_schedule}, {"warmup", c.warmup}, {"min-lr", c.min_lr},
      {"clip-grad", c.clip_grad}, {"dp", c.dp}, {"accumulate", c.accumulate}, {"zero", c.zero},
      {"bucket-mb", c.bucket_mb}, {"overlap", c.overlap}, {"share-memory", c.share_memory}, {"compress", c.compress},
      {"pp", c.pp}, {"tp", c.tp}, {"micro-batches", c.micro_batches}, {"schedule", c.schedule}, {"stages", c.stages},
      {"recompute", c.recompute}, {"memory-limit", c.memory_limit}, {"checkpoint-dir", c.checkpoint_dir},
      {"checkpoint-every", c.checkpoint_every}, {"keep", c.keep}, {"checkpoint-async", c.checkpoint_async},
      {"timeout", c.timeout}, {"backend", c.backend}, {"heartbeat-timeout", c.heartbeat_timeout}, {"seed", c.seed},
      {"eval-batches", c.eval_batches}};
}

// Ranks started with different options would deadlock (different --steps), fail late
// (different --lr: caught by the final digest check) or silently train something else
// (different --batch-size or --seed). Every rank compares all the ranks' options before
// anything else runs on the group and raises, naming the ranks and the options that differ.
void check_same_options(const TrainConfig& cfg, comm::Group& group) {
  const std::string mine = run_options(cfg).dump();
  const int n = group.size();
  uint64_t length = mine.size();
  std::vector<uint64_t> lengths(static_cast<size_t>(n));
  group.all_gather(&length, lengths.data(), 1, comm::DataType::i64);
  const uint64_t longest = *std::max_element(lengths.begin(), lengths.end());
  DT_CHECK(longest < (uint64_t{1} << 20), "train", "a rank sent {} bytes of options", longest);
  std::string padded = mine;
  padded.resize(longest, ' ');
  std::string all(longest * static_cast<size_t>(n), ' ');
  group.all_gather(padded.data(), all.data(), longest, comm::DataType::u8);
  std::vector<nlohmann::json> options;
  for (int r = 0; r < n; ++r) {
    options.push_back(nlohmann::json::parse(all.substr(longest * static_cast<size_t>(r), lengths[static_cast<size_t>(r)]),
                                            nullptr, false));
    DT_CHECK(options.back().is_object(), "train", "rank {} sent options that are not JSON", r);
  }
  std::vector<std::string> differences;
  for (int r = 1; r < n; ++r) {
    for (const auto& [key, value] : options[0].items()) {
      const auto it = options[static_cast<size_t>(r)].find(key);
      const std::string theirs = it == options[static_cast<size_t>(r)].end() ? "(missing)" : it->dump();
      if (theirs != value.dump() && differences.size() < 8) {
        differences.push_back(fmt::format("rank {} has --{} {} but rank 0 has {}", r, key, theirs, value.dump()));
      }
    }
  }
  DT_CHECK(differences.empty(), "train",
           "the ranks were started with different options, which would train different models or hang: {}; start "
           "every rank with the same command (dtrain train --dp N does)",
           fmt::join(differences, "; "));
}

// Per-rank figures every rank contributes to the final record.
struct RankFigures {
  double step_s = 0.0, busy_s = 0.0;
  double activation_peak_bytes = 0.0, peak_bytes = 0.0, max_in_flight = 0.0;
  double peak_rss = 0.0, state_bytes = 0.0;
};

}  // namespace

TrainResult run_training(const TrainConfig& requested) {
  // The loop notes its progress (comm/progress.h); once this returns or throws, what follows
  // (leaving the groups, the caller's own work) is not watched.
  struct StopWatchingProgress {
    ~StopWatchingProgress() { comm::pause_progress(); }
  } stop_watching;
  TrainConfig cfg = requested;
  set_num_threads(cfg.threads);
  const auto origin = Clock::now();
  const int world = world_size(cfg);
  // Parallel: join the world the launcher started and split it into the mesh's axes.
  std::unique_ptr<comm::Group> group;
  std::unique_ptr<parallel::Mesh> mesh;
  parallel::MeshCoord coord;
  int rank = 0;
  if (world > 1) {
    comm::GroupOptions options;
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.timeout * 1000.0));
    options.heartbeat_timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.heartbeat_timeout * 1000.0));
    if (cfg.backend == "mpi") {
      group = std::make_unique<comm::Group>(comm::Group::from_mpi(options));
    } else {
      options.transport = comm::parse_transport(cfg.backend);
      group = std::make_unique<comm::Group>(comm::Group::from_env(options));
    }
    DT_CHECK(group->size() == world, "train", "--dp {} x --pp {} x --tp {} = {} ranks but the {} started {} ({})", cfg.dp,
             cfg.pp, cfg.tp, world, cfg.backend == "mpi" ? "MPI job" : "launcher", group->size(),
             cfg.backend == "mpi" ? "mpirun -np" : "WORLD_SIZE");
    check_same_options(cfg, *group);
    mesh = std::make_unique<parallel::Mesh>(*group, parallel::MeshShape{cfg.dp, cfg.pp, cfg.tp});
    coord = mesh->coord();
    rank = group->rank();
  }
  const bool lead = rank == 0;
  const bool pipelined = cfg.pp > 1;
  // Outputs written at the end: refused now, not lost after the whole run.
  if (lead && !cfg.save.empty()) check_output_path(cfg.save, "--save", "train");
  if (lead && !cfg.trace.empty()) check_output_path(cfg.trace, "--trace", "train");
  if (lead && !cfg.metrics.empty()) check_output_path(cfg.metrics, "--metrics", "train");
  DataSource src = build_data(cfg);

  // This rank's stage of the model.
  std::vector<nn::BlockRange> stages{nn::BlockRange{}};
  if (pipelined) {
    auto probe = build_model(cfg, nn::BlockRange{0, 1});
    stages = cfg.stages.empty() ? parallel::balance_stages(probe->block_flops(), probe->block_params(), cfg.pp)
                                : parallel::parse_stages(cfg.stages, probe->block_flops().size(), cfg.pp);
  }
  auto model = build_model(cfg, stages[static_cast<size_t>(coord.pp)]);
  if (!pipelined) stages[0] = model->range();  // the whole model, its end now known
  std::map<std::string, parallel::ShardSpec> shard_specs;
  if (cfg.tp > 1) shard_specs = parallel::tensor_parallelize(*model, mesh->tp(), cfg.heads);
  const StateEstimate need = estimate_state(cfg, model->num_parameters());
  if (cfg.memory_limit > 0 && need.total() > cfg.memory_limit) {
    DT_THROW("train", "the model needs {} per process ({} parameters: {} of parameters, {} of "
                                     "gradients, {} of {} state) but --memory-limit is {}; split it with --pp or --tp "
                                     "(or shard the optimizer with --dp and --zero)",
                                     mib(need.total()), model->num_parameters(), mib(need.params), mib(need.grads),
                                     mib(need.optimizer), cfg.optimizer, mib(cfg.memory_limit));
  }
  std::unique_ptr<parallel::DataParallel> ddp;
  if (cfg.dp > 1) {
    parallel::DdpOptions o;
    o.bucket_bytes = static_cast<size_t>(cfg.bucket_mb * 1024 * 1024);
    o.zero = cfg.zero;
    o.overlap = cfg.overlap;
    o.share_memory = cfg.share_memory;
    o.record_events = true;
    o.compress = cfg.compress;
    o.seed = cfg.seed;
    ddp = std::make_unique<parallel::DataParallel>(model->named_parameters(), mesh->dp(), o);
    ddp->broadcast_parameters();
  }
  std::unique_ptr<parallel::Pipeline> pipe;
  if (pipelined) {
    parallel::PipelineOptions po;
    po.schedule = parallel::parse_schedule(cfg.schedule);
    po.micro_batches = static_cast<int>(cfg.micro_batches);
    po.recompute = cfg.recompute;
    pipe = std::make_unique<parallel::Pipeline>(*model, mesh->pp(), po);
  }
  auto optimizer = build_optimizer(cfg, ddp ? ddp->optimizer_params() : model->parameters());
  // Checkpoints: resume from the newest complete one, if any.
  std::unique_ptr<Checkpointer> ckpt;
  int64_t start_step = 0;
  const std::vector<Fault> faults = faults_from_env(rank);
  if (!cfg.checkpoint_dir.empty()) {
    nlohmann::json layout{{"model", nlohmann::json::parse(model_metadata(cfg))},
                          {"dp", cfg.dp},
                          {"pp", cfg.pp},
                          {"tp", cfg.tp},
                          {"zero", cfg.zero},
                          {"optimizer", cfg.optimizer},
                          {"compress", cfg.compress},
                          {"bucket_mb", cfg.bucket_mb},
                          {"stages", nlohmann::json::array()}};
    for (const auto& r : stages) layout["stages"].push_back({r.begin, r.end});
    ckpt = std::make_unique<Checkpointer>(cfg.checkpoint_dir, cfg.keep, group.get(), layout);
    // Any data-parallel / pipeline / ZeRO layout may resume it; model, optimizer and tp must agree.
    const nlohmann::json compatible{{"model", layout["model"]}, {"optimizer", cfg.optimizer}, {"tp", cfg.tp}};
    if (auto found = ckpt->latest(compatible)) {
      restore_checkpoint(*ckpt, *found, *model, *optimizer, ddp.get(), coord);
      start_step = found->step;
      // Error feedback and PowerSGD state belong to one rank of one layout: carried over when
      // the layout is the same (then the resumed run is bitwise the uninterrupted one).
      if (ddp && cfg.compress != "none") {
        std::vector<nn::NamedTensor> state;
        if (found->layout == layout) {
          for (auto& [name, t] : ckpt->read(found->step, rank).optimizer) {
            if (name.starts_with("comm/")) state.emplace_back(name.substr(5), t);
          }
        }
        if (!state.empty()) {
          ddp->load_compression_state(state);
        } else if (lead) {
          DT_LOG_WARN("--compress {}: the checkpoint has no compression state for this layout; error feedback "
                      "starts from zero",
                      cfg.compress);
        }
      }
      if (lead) {
        DT_LOG_INFO("resumed from {}/step-{:08d}: {} steps done{}", cfg.checkpoint_dir, start_step, start_step,
                    found->layout != layout ? fmt::format(" (written by dp {} x pp {}, zero {})", found->layout["dp"].dump(),
                                                          found->layout["pp"].dump(), found->layout["zero"].dump())
                                            : std::string());
      }
    }
  }
  const int64_t batch = cfg.batch_size;
  const int64_t M = cfg.micro_batches;
  const int64_t micro_steps = cfg.accumulate * M;  // micro-batches per rank per optimizer step
  const int64_t micro = batch / (cfg.dp * micro_steps);
  // Every rank walks the same shuffled order; step s uses samples [s*B, (s+1)*B) of it, and the
  // data-parallel replica d's micro-batch k takes the slice (k * dp + d) of that global batch:
  // the union is the single-process batch, so the averaged gradient is the same. Stages and
  // tensor-parallel ranks of one replica read the same slices.
  data::ShardedSampler sampler(src.train->size(), 0, 1, cfg.seed, /*shuffle=*/true);
  const int64_t steps_per_epoch = sampler.per_rank() / batch;
  DT_CHECK(steps_per_epoch > 0, "train", "--batch-size {} is larger than the training set ({} samples)", batch,
           src.train->size());
  const int64_t total_steps = cfg.steps > 0 ? cfg.steps : steps_per_epoch * std::max<int64_t>(cfg.epochs, 1);
  optim::LrSchedule sched{cfg.lr, cfg.lr_schedule == "cosine" ? cfg.min_lr : cfg.lr, cfg.warmup, total_steps,
                          cfg.lr_schedule == "cosine"};
  // A checkpoint past this run's end: nothing to train, and no loss to report (it used to
  // print a summary with loss 0.0000).
  DT_CHECK(start_step <= total_steps, "train",
           "--checkpoint-dir {}: its newest checkpoint is at step {}, past the end of this run ({} steps); raise "
           "--steps (or --epochs), or use another --checkpoint-dir",
           cfg.checkpoint_dir, start_step, total_steps);
  if (start_step == total_steps && lead) {
    DT_LOG_WARN("--checkpoint-dir {}: all {} steps were done already; evaluating and saving only (no train loss)",
                cfg.checkpoint_dir, total_steps);
  }

  const bool text = src.tokens_per_sample > 0;
  const char* unit = text ? "tok" : "samples";
  // The ranks whose losses count: the last stage's, one per tensor-parallel group.
  const bool holds_loss = coord.pp == cfg.pp - 1 && coord.tp == 0;
  if (lead) {
    std::string layout;
    if (world > 1) {
      layout = fmt::format(", {} ranks ({}), {} per micro-batch", world, mesh->shape().str(), micro);
      if (ddp) layout += fmt::format(", {} buckets{}", ddp->num_buckets(), cfg.zero ? fmt::format(", ZeRO-{}", cfg.zero) : "");
      if (pipelined) {
        std::vector<std::string> cuts;
        for (const auto& r : stages) cuts.push_back(fmt::format("{}-{}", r.begin, r.end - 1));
        layout += fmt::format(", stages {}, {} x {} micro-batches", fmt::join(cuts, ","), cfg.schedule, M);
      }
    }
    DT_LOG_INFO("training {} ({} parameters on this rank) on {} ({} samples), {} steps of batch {}, {} per epoch{}",
                cfg.model, model->num_parameters(), cfg.data, src.train->size(), total_steps, batch, steps_per_epoch,
                layout);
  }
  MetricsWriter metrics = cfg.metrics.empty() || !lead ? MetricsWriter() : MetricsWriter(cfg.metrics);
  Progress progress(total_steps, cfg.log_every, cfg.progress && lead);
  Trace trace(!cfg.trace.empty(), rank, origin);

  TrainResult result;
  if (start_step == total_steps) result.final_loss = std::numeric_limits<double>::quiet_NaN();
  double train_time = 0.0, compute_time = 0.0, comm_time = 0.0, wait_time = 0.0;
  uint64_t wire_bytes = 0, raw_bytes = 0;  // gradient bytes this rank sent, and what f32 would have sent
  double interval_loss = 0.0;
  int64_t interval_steps = 0;
  std::vector<int64_t> epoch_indices;
  int64_t epoch = -1;
  RankFigures fig;
  for (int64_t step = start_step; step < total_steps; ++step) {
    comm::note_progress("the start of a step", step + 1);
    maybe_fail(faults, step + 1, FaultPhase::step);
    const int64_t e = step / steps_per_epoch;
    if (e != epoch) {
      epoch = e;
      epoch_indices = sampler.indices(epoch);
    }
    const int64_t pos = (step % steps_per_epoch) * batch;
    auto micro_batch = [&](int64_t k) {
      const int64_t at = pos + (k * cfg.dp + coord.dp) * micro;
      std::vector<int64_t> idx(epoch_indices.begin() + at, epoch_indices.begin() + at + micro);
      return src.train->get(idx);
    };
    const auto t0 = Clock::now();
    // Masks per (step, replica): the same on a resumed run, different between replicas.
    nn::reseed_dropout(*model, (static_cast<uint64_t>(step) << 20) ^ static_cast<uint64_t>(coord.dp));
    optimizer->set_lr(sched.at(step));
    double step_loss = 0.0;
    for (int64_t a = 0; a < cfg.accumulate; ++a) {
      const bool sync = a == cfg.accumulate - 1;
      if (pipe) {
        parallel::StageStats st;
        step_loss += pipe->train_step(
            [&](int m) {
              comm::note_progress("reading a batch", step + 1);
              data::Batch b = micro_batch(a * M + m);
              return std::make_pair(b.x, b.y);
            },
            1.0f / static_cast<float>(micro_steps), [&](bool last) { if (ddp) ddp->set_sync(sync && last); }, &st);
        compute_time += st.busy_s;
        for (const parallel::PipeSpan& sp : st.spans) {
          trace.span(sp.forward ? "forward" : "backward", static_cast<int>(a * M + sp.micro), 0, sp.start, sp.end,
                     step + 1);
        }
        // The first step of a start also agrees shapes and warms up allocations: left out of
        // the figures (unless it is the only one).
        if (step > start_step || total_steps - start_step == 1) {
          fig.step_s += st.step_s;
          fig.busy_s += st.busy_s;
          fig.activation_peak_bytes = std::max(fig.activation_peak_bytes, static_cast<double>(st.activation_peak_bytes));
          fig.peak_bytes = std::max(fig.peak_bytes, static_cast<double>(st.peak_bytes));
          fig.max_in_flight = std::max(fig.max_in_flight, static_cast<double>(st.max_in_flight));
        }
        continue;
      }
      const auto tm = Clock::now();
      comm::note_progress("reading a batch", step + 1);
      data::Batch b = micro_batch(a);
      if (ddp) ddp->set_sync(sync);
      comm::note_progress("forward", step + 1);
      Tensor loss = model->loss(model->forward(b.x), b.y);
      const auto tf = Clock::now();
      step_loss += static_cast<double>(loss.item());
      if (cfg.accumulate > 1) loss = loss * (1.0f / static_cast<float>(cfg.accumulate));
      comm::note_progress("backward", step + 1);
      loss.backward();
      const auto tb = Clock::now();
      trace.span("forward", cfg.accumulate > 1 ? static_cast<int>(a) : -1, 0, tm, tf, step + 1);
      trace.span("backward", cfg.accumulate > 1 ? static_cast<int>(a) : -1, 0, tf, tb, step + 1);
      compute_time += seconds_since(tm, tb);
    }
    step_loss /= static_cast<double>(micro_steps);
    maybe_fail(faults, step + 1, FaultPhase::allreduce);
    const auto ts = Clock::now();
    if (ddp) {
      ddp->synchronize();
      for (const auto& ev : ddp->take_bucket_events()) {
        trace.span("bucket", ev.bucket, 1, ev.start, ev.end, step + 1, static_cast<int64_t>(ev.bytes));
        comm_time += seconds_since(ev.start, ev.end);
      }
      const parallel::CommVolume v = ddp->take_comm_volume();
      wire_bytes += v.wire_bytes;
      raw_bytes += v.raw_bytes;
    }
    const auto to = Clock::now();
    wait_time += seconds_since(ts, to);
    if (cfg.clip_grad > 0.0f) {
      if (world == cfg.dp) {
        if (ddp) {
          ddp->clip_grad_norm(cfg.clip_grad);
        } else {
          optim::clip_grad_norm(optimizer->params(), cfg.clip_grad);
        }
      } else {
        // Stages and shards hold different gradients: the norm is summed over the mesh, each
        // replicated tensor-parallel parameter counted once, each data-parallel replica once
        // (under ZeRO the replicas hold disjoint pieces, so each piece counts whole).
        auto counted = [&](const std::string& name) {
          auto it = shard_specs.find(name);
          return coord.tp == 0 || (it != shard_specs.end() && it->second.dim >= 0);
        };
        double sq = 0.0;
        if (ddp) {
          sq = ddp->grad_square_sum(counted);
          if (!ddp->sharded()) sq /= cfg.dp;  // every replica holds the whole gradient
        } else {
          std::vector<Tensor> ps;
          for (const auto& [name, p] : model->named_parameters()) {
            if (counted(name)) ps.push_back(p);
          }
          sq = optim::grad_square_sum(ps);
        }
        group->all_reduce(&sq, &sq, 1, comm::DataType::f64, comm::ReduceOp::sum);
        const double norm = std::sqrt(sq);
        if (norm > cfg.clip_grad) {
          const float scale = static_cast<float>(cfg.clip_grad / (norm + 1e-6));
          if (ddp) {
            ddp->scale_grads(scale);
          } else {
            optim::scale_grads(optimizer->params(), scale);
          }
        }
      }
    }
    comm::note_progress("the optimizer step", step + 1);
    optimizer->step();
    if (ddp) {
      ddp->gather_parameters();
      ddp->zero_grad();
    }
    optimizer->zero_grad();
    const auto t1 = Clock::now();
    if (ckpt && cfg.checkpoint_every > 0 && (step + 1) % cfg.checkpoint_every == 0) {
      comm::note_progress("writing a checkpoint", step + 1);
      CheckpointShard shard = checkpoint_shard(step + 1, *model, *optimizer, ddp.get());
      const int64_t at = step + 1;
      auto before_commit = [&faults, at] { maybe_fail(faults, at, FaultPhase::checkpoint); };
      if (cfg.checkpoint_async) {
        ckpt->save_async(std::move(shard), before_commit);
      } else {
        ckpt->save(shard, before_commit);
      }
      trace.span("checkpoint", -1, 0, t1, Clock::now(), step + 1);
    }
    if (ddp) trace.span("synchronize", -1, 0, ts, to, step + 1);
    trace.span("optimizer", -1, 0, to, t1, step + 1);
    train_time += seconds_since(t0, t1);
    DT_CHECK(std::isfinite(step_loss), "train", "loss is {} at step {} (lr {}): training diverged", step_loss, step + 1,
             optimizer->lr());
    interval_loss += step_loss;
    ++interval_steps;
    const double samples = static_cast<double>((step + 1 - start_step) * batch);
    const double rate = text ? samples * static_cast<double>(src.tokens_per_sample) / train_time : samples / train_time;
    if ((step + 1) % cfg.log_every == 0 || step + 1 == total_steps) {
      double mean = interval_loss / static_cast<double>(interval_steps);
      if (group) {
        // The loss lives on the last stage: average over its data-parallel replicas.
        mean = holds_loss ? mean / cfg.dp : 0.0;
        group->all_reduce(&mean, &mean, 1, comm::DataType::f64, comm::ReduceOp::sum);
      }
      result.final_loss = mean;
      metrics.write({{"event", "log"},
                     {"step", step + 1},
                     {"epoch", epoch + 1},
                     {"loss", result.final_loss},
                     {"lr", optimizer->lr()},
                     {text ? "tokens_per_s" : "samples_per_s", rate}});
      interval_loss = 0.0;
      interval_steps = 0;
    }
    if (lead) progress.update(step + 1, epoch + 1, holds_loss ? step_loss : result.final_loss, optimizer->lr(), rate, unit);
  }
  if (lead) progress.finish();
  comm::note_progress("committing the last checkpoint", total_steps);
  if (ckpt) ckpt->finish();  // commits a checkpoint still being written in the background

  result.steps = total_steps;
  result.epochs_started = epoch + 1;
  result.train_time_s = train_time;
  result.samples_per_s = train_time > 0 ? static_cast<double>((total_steps - start_step) * batch) / train_time : 0.0;
  result.tokens_per_s = result.samples_per_s * static_cast<double>(src.tokens_per_sample);
  // The whole model's FLOPs (a stage knows its model's full configuration).
  result.model_flops_per_s =
      3.0 * model->flops_per_sample() * (text ? result.tokens_per_s : result.samples_per_s);
  if (!cfg.trace.empty()) write_trace(trace, cfg.trace, group.get(), rank, world);
  nlohmann::json final_record{{"event", "final"},
                              {"model", cfg.model},
                              {"steps", result.steps},
                              {"epochs", result.epochs_started},
                              {"batch_size", batch},
                              {"world", world},
                              {"dp", cfg.dp},
                              {"pp", cfg.pp},
                              {"tp", cfg.tp},
                              {"accumulate", cfg.accumulate},
                              {"train_loss", result.final_loss},
                              {"train_time_s", result.train_time_s},
                              {"samples_per_s", result.samples_per_s},
                              {"model_flops_per_s", result.model_flops_per_s}};
  if (ddp) {
    // Replicas of one stage and shard must hold identical parameters: that is the contract.
    const std::string digest = params_digest(model->named_parameters());
    std::vector<char> mine(64, 0), all(64 * static_cast<size_t>(cfg.dp));
    std::memcpy(mine.data(), digest.data(), std::min<size_t>(64, digest.size()));
    mesh->dp().all_gather(mine.data(), all.data(), 64, comm::DataType::u8);
    for (int r = 0; r < cfg.dp; ++r) {
      const std::string d(all.data() + 64 * r, 64);
      DT_CHECK(d == std::string(mine.data(), 64), "train",
               "data-parallel replica {} ended with parameters {} but replica {} with {} (stage {}, shard {})", r, d,
               coord.dp, digest, coord.pp, coord.tp);
    }
    const parallel::MemoryReport mem = ddp->memory(*optimizer);
    final_record["param_bytes_per_rank"] = mem.param_bytes;
    final_record["grad_bytes_per_rank"] = mem.grad_bytes;
    final_record["optimizer_bytes_per_rank"] = mem.optimizer_bytes;
    final_record["zero"] = cfg.zero;
    final_record["buckets"] = ddp->num_buckets();
    final_record["comm_s"] = comm_time;
    // Gradient bytes per step that this rank sent, what f32 would have sent, and their ratio.
    final_record["compress"] = cfg.compress;
    // Every step this process ran synchronised once.
    const int64_t synced_steps = total_steps - start_step;
    final_record["wire_bytes_per_step"] = synced_steps > 0 ? static_cast<double>(wire_bytes) / synced_steps : 0.0;
    final_record["f32_bytes_per_step"] = synced_steps > 0 ? static_cast<double>(raw_bytes) / synced_steps : 0.0;
    final_record["compression_ratio"] = wire_bytes > 0 ? static_cast<double>(raw_bytes) / wire_bytes : 1.0;
    final_record["sync_wait_s"] = wait_time;
    // overlap = (T_compute + T_comm - T_step) / T_comm, with T_step the compute plus the wait
    // for the buckets (the optimizer is excluded from both sides).
    final_record["overlap"] = comm_time > 0 ? (compute_time + comm_time - (compute_time + wait_time)) / comm_time : 0.0;
  }
  final_record["compute_s"] = compute_time;
  // The whole model on rank 0, in the single-process order and names: digest and --save.
  std::vector<nn::NamedTensor> full = model->named_parameters();
  if (cfg.tp > 1) {
    for (auto& [name, t] : full) {
      auto it = shard_specs.find(name);
      if (it != shard_specs.end() && it->second.dim >= 0) t = parallel::gather_shards(t, it->second, mesh->tp());
    }
  }
  if (mesh) full = gather_full_model(std::move(full), *mesh);
  if (lead) {
    result.params_digest = params_digest(full);
    int64_t n = 0;
    for (const auto& [name, t] : full) n += t.numel();
    final_record["params"] = n;
    final_record["params_digest"] = result.params_digest;
  }

  // Evaluation: the first data-parallel replica's ranks run forward; the last stage's first
  // shard computes the figure and hands it to rank 0.
  double eval_value = 0.0;
  if (coord.dp == 0) {
    std::function<Tensor(const Tensor&)> forward;
    if (pipe) forward = [&](const Tensor& x) { return pipe->forward_only(x); };
    eval_value = text ? evaluate(*model, *src.eval, batch, cfg.eval_batches, forward)
                      : evaluate(*model, *src.eval, 1000, 0, forward);
    const int holder = mesh ? parallel::mesh_rank(mesh->shape(), {0, cfg.pp - 1, 0}) : 0;
    if (holder != 0) {
      if (rank == holder) group->send(&eval_value, 1, comm::DataType::f64, 0, kTagEvaluation);
      if (lead) group->recv(&eval_value, 1, comm::DataType::f64, holder, kTagEvaluation);
    }
  }
  if (text) {
    result.val_loss = eval_value;
  } else {
    result.test_accuracy = eval_value;
  }
  result.peak_rss = peak_rss_bytes();
  final_record["peak_rss_bytes"] = result.peak_rss;
  final_record["state_bytes_per_rank"] = need.total();
  if (group) {
    // Per-rank figures: stage bubbles and memory, everyone's peak RSS.
    fig.peak_rss = static_cast<double>(result.peak_rss);
    fig.state_bytes = static_cast<double>(need.total());
    constexpr size_t kFields = sizeof(RankFigures) / sizeof(double);
    std::vector<double> all(kFields * static_cast<size_t>(world));
    group->all_gather(&fig, all.data(), kFields, comm::DataType::f64);
    auto at = [&](int r) { return reinterpret_cast<const RankFigures*>(all.data() + kFields * static_cast<size_t>(r)); };
    nlohmann::json rss = nlohmann::json::array();
    for (int r = 0; r < world; ++r) rss.push_back(static_cast<int64_t>(at(r)->peak_rss));
    final_record["peak_rss_bytes_per_rank"] = rss;
    if (pipelined) {
      nlohmann::json bubble = nlohmann::json::array(), act = nlohmann::json::array(), peak = nlohmann::json::array(),
                     inflight = nlohmann::json::array(), cuts = nlohmann::json::array();
      for (int s = 0; s < cfg.pp; ++s) {
        const RankFigures* f = at(parallel::mesh_rank(mesh->shape(), {0, s, 0}));
        bubble.push_back(f->step_s > 0 ? std::max(0.0, 1.0 - f->busy_s / f->step_s) : 0.0);
        act.push_back(static_cast<int64_t>(f->activation_peak_bytes));
        peak.push_back(static_cast<int64_t>(f->peak_bytes));
        inflight.push_back(static_cast<int64_t>(f->max_in_flight));
        cuts.push_back({stages[static_cast<size_t>(s)].begin, stages[static_cast<size_t>(s)].end});
      }
      final_record["schedule"] = cfg.schedule;
      final_record["micro_batches"] = M;
      final_record["stages"] = cuts;
      final_record["stage_bubble"] = bubble;
      final_record["bubble_theory"] = static_cast<double>(cfg.pp - 1) / static_cast<double>(M + cfg.pp - 1);
      final_record["stage_activation_peak_bytes"] = act;
      final_record["stage_step_peak_bytes"] = peak;
      final_record["stage_max_in_flight"] = inflight;
    }
  }
  if (text) {
    final_record["tokens_per_s"] = result.tokens_per_s;
    final_record["val_loss"] = result.val_loss;
  } else {
    final_record["test_accuracy"] = result.test_accuracy;
  }
  metrics.write(final_record);
  comm::note_progress("saving the model");
  if (!cfg.save.empty() && lead) save_model(cfg.save, ModelFile{model_metadata(cfg), full});
  return result;
}

}  // namespace dtrain::train
