#include "dtrain/train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "dtrain/core/error.h"
#include "dtrain/comm/group.h"
#include "dtrain/core/log.h"
#include "dtrain/parallel/ddp.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/train/metrics.h"
#include "dtrain/train/model_io.h"

namespace dtrain::train {

using Clock = std::chrono::steady_clock;

std::shared_ptr<nn::Model> build_model(const TrainConfig& cfg) {
  if (cfg.model == "mlp") {
    return std::make_shared<nn::Mlp>(data::FashionMnist::kPixels, cfg.hidden, data::FashionMnist::kClasses, cfg.seed);
  }
  nn::GptConfig g;
  g.layers = cfg.layers;
  g.heads = cfg.heads;
  g.width = cfg.width;
  g.seq_len = cfg.seq_len;
  g.dropout = cfg.dropout;
  return std::make_shared<nn::Gpt>(g, cfg.seed);
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

double evaluate(nn::Model& model, const data::Dataset& eval, int64_t batch_size, int64_t max_batches) {
  NoGradGuard no_grad;
  model.train(false);
  const int64_t n = eval.size();
  int64_t batches = (n + batch_size - 1) / batch_size;
  if (max_batches > 0) batches = std::min(batches, max_batches);
  const bool classify = model.kind() == "mlp";
  double total = 0.0;
  int64_t count = 0;
  for (int64_t b = 0; b < batches; ++b) {
    std::vector<int64_t> idx;
    for (int64_t i = b * batch_size; i < std::min(n, (b + 1) * batch_size); ++i) idx.push_back(i);
    data::Batch batch = eval.get(idx);
    Tensor out = model.forward(batch.x);
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

std::string rank_file(const std::string& path, int rank) { return fmt::format("{}.rank{}", path, rank); }

// Every rank writes its events; rank 0 merges them into `path` (one process per rank row).
void write_trace(const Trace& trace, const std::string& path, comm::Group* group, int rank, int world) {
  auto metadata = [](int r, int tid, const std::string& name) {
    return nlohmann::json{{"name", "thread_name"}, {"ph", "M"}, {"pid", r}, {"tid", tid}, {"args", {{"name", name}}}};
  };
  nlohmann::json ev = trace.events();
  ev.push_back(nlohmann::json{{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", fmt::format("rank {}", rank)}}}});
  ev.push_back(metadata(rank, 0, "compute"));
  ev.push_back(metadata(rank, 1, "communication"));
  if (world == 1 || group == nullptr) {
    std::ofstream(path) << nlohmann::json{{"traceEvents", ev}, {"displayTimeUnit", "ms"}}.dump() << "\n";
    return;
  }
  std::ofstream(rank_file(path, rank)) << ev.dump() << "\n";
  group->barrier();
  if (rank != 0) return;
  nlohmann::json all = nlohmann::json::array();
  for (int r = 0; r < world; ++r) {
    std::ifstream in(rank_file(path, r));
    nlohmann::json part = nlohmann::json::parse(in, nullptr, false);
    DT_CHECK(part.is_array(), "train", "trace part {} is unreadable", rank_file(path, r));
    for (auto& e : part) all.push_back(std::move(e));
    std::remove(rank_file(path, r).c_str());
  }
  std::ofstream(path) << nlohmann::json{{"traceEvents", all}, {"displayTimeUnit", "ms"}}.dump() << "\n";
}

}  // namespace

TrainResult run_training(const TrainConfig& cfg) {
  set_num_threads(cfg.threads);
  const auto origin = Clock::now();
  // Data parallel: join the world the launcher started.
  std::unique_ptr<comm::Group> group;
  int rank = 0, world = 1;
  if (cfg.dp > 1) {
    group = std::make_unique<comm::Group>(comm::Group::from_env());
    rank = group->rank();
    world = group->size();
    DT_CHECK(world == cfg.dp, "train", "--dp {} but the launcher started {} ranks (WORLD_SIZE)", cfg.dp, world);
  }
  const bool lead = rank == 0;
  DataSource src = build_data(cfg);
  auto model = build_model(cfg);
  std::unique_ptr<parallel::DataParallel> ddp;
  if (group) {
    parallel::DdpOptions o;
    o.bucket_bytes = static_cast<size_t>(cfg.bucket_mb * 1024 * 1024);
    o.zero = cfg.zero;
    o.overlap = cfg.overlap;
    o.record_events = true;
    ddp = std::make_unique<parallel::DataParallel>(model->named_parameters(), *group, o);
    ddp->broadcast_parameters();
  } else {
    DT_CHECK(cfg.zero == 0, "train", "--zero {} needs data parallelism (--dp 2 or more)", cfg.zero);
  }
  auto optimizer = build_optimizer(cfg, ddp ? ddp->optimizer_params() : model->parameters());
  const int64_t batch = cfg.batch_size;
  const int64_t micro = batch / (world * cfg.accumulate);
  // Every rank walks the same shuffled order; step s uses samples [s*B, (s+1)*B) of it, and
  // rank r's micro-step m takes the slice (m * world + r) of that global batch: the union is
  // the single-process batch, so the averaged gradient is the same.
  data::ShardedSampler sampler(src.train->size(), 0, 1, cfg.seed, /*shuffle=*/true);
  const int64_t steps_per_epoch = sampler.per_rank() / batch;
  DT_CHECK(steps_per_epoch > 0, "train", "--batch-size {} is larger than the training set ({} samples)", batch,
           src.train->size());
  const int64_t total_steps = cfg.steps > 0 ? cfg.steps : steps_per_epoch * std::max<int64_t>(cfg.epochs, 1);
  optim::LrSchedule sched{cfg.lr, cfg.lr_schedule == "cosine" ? cfg.min_lr : cfg.lr, cfg.warmup, total_steps,
                          cfg.lr_schedule == "cosine"};

  const bool text = src.tokens_per_sample > 0;
  const char* unit = text ? "tok" : "samples";
  if (lead) {
    DT_LOG_INFO("training {} ({} parameters) on {} ({} samples), {} steps of batch {}, {} per epoch{}", cfg.model,
                model->num_parameters(), cfg.data, src.train->size(), total_steps, batch, steps_per_epoch,
                world > 1 ? fmt::format(", {} data-parallel ranks x {} per micro-step, {} buckets{}", world, micro,
                                        ddp->num_buckets(), cfg.zero ? fmt::format(", ZeRO-{}", cfg.zero) : "")
                          : std::string());
  }
  MetricsWriter metrics = cfg.metrics.empty() || !lead ? MetricsWriter() : MetricsWriter(cfg.metrics);
  Progress progress(total_steps, cfg.log_every, cfg.progress && lead);
  Trace trace(!cfg.trace.empty(), rank, origin);

  TrainResult result;
  double train_time = 0.0, compute_time = 0.0, comm_time = 0.0, wait_time = 0.0;
  double interval_loss = 0.0;
  int64_t interval_steps = 0;
  std::vector<int64_t> epoch_indices;
  int64_t epoch = -1;
  for (int64_t step = 0; step < total_steps; ++step) {
    const int64_t e = step / steps_per_epoch;
    if (e != epoch) {
      epoch = e;
      epoch_indices = sampler.indices(epoch);
    }
    const int64_t pos = (step % steps_per_epoch) * batch;
    const auto t0 = Clock::now();
    optimizer->set_lr(sched.at(step));
    float step_loss = 0.0f;
    for (int64_t m = 0; m < cfg.accumulate; ++m) {
      const auto tm = Clock::now();
      const int64_t at = pos + (m * world + rank) * micro;
      std::vector<int64_t> idx(epoch_indices.begin() + at, epoch_indices.begin() + at + micro);
      data::Batch b = src.train->get(idx);
      if (ddp) ddp->set_sync(m == cfg.accumulate - 1);
      Tensor loss = model->loss(model->forward(b.x), b.y);
      const auto tf = Clock::now();
      step_loss += loss.item() / static_cast<float>(cfg.accumulate);
      if (cfg.accumulate > 1) loss = loss * (1.0f / static_cast<float>(cfg.accumulate));
      loss.backward();
      const auto tb = Clock::now();
      trace.span("forward", cfg.accumulate > 1 ? static_cast<int>(m) : -1, 0, tm, tf, step + 1);
      trace.span("backward", cfg.accumulate > 1 ? static_cast<int>(m) : -1, 0, tf, tb, step + 1);
      compute_time += seconds_since(tm, tb);
    }
    const auto ts = Clock::now();
    if (ddp) {
      ddp->synchronize();
      for (const auto& ev : ddp->take_bucket_events()) {
        trace.span("bucket", ev.bucket, 1, ev.start, ev.end, step + 1, static_cast<int64_t>(ev.bytes));
        comm_time += seconds_since(ev.start, ev.end);
      }
    }
    const auto to = Clock::now();
    wait_time += seconds_since(ts, to);
    if (cfg.clip_grad > 0.0f) {
      if (ddp) {
        ddp->clip_grad_norm(cfg.clip_grad);
      } else {
        optim::clip_grad_norm(optimizer->params(), cfg.clip_grad);
      }
    }
    optimizer->step();
    if (ddp) {
      ddp->gather_parameters();
      ddp->zero_grad();
    }
    optimizer->zero_grad();
    const auto t1 = Clock::now();
    if (ddp) trace.span("synchronize", -1, 0, ts, to, step + 1);
    trace.span("optimizer", -1, 0, to, t1, step + 1);
    train_time += seconds_since(t0, t1);
    DT_CHECK(std::isfinite(step_loss), "train", "loss is {} at step {} (lr {}): training diverged", step_loss, step + 1,
             optimizer->lr());
    interval_loss += step_loss;
    ++interval_steps;
    const double samples = static_cast<double>((step + 1) * batch);
    const double rate = text ? samples * static_cast<double>(src.tokens_per_sample) / train_time : samples / train_time;
    if ((step + 1) % cfg.log_every == 0 || step + 1 == total_steps) {
      double mean = interval_loss / static_cast<double>(interval_steps);
      if (group) group->all_reduce(&mean, &mean, 1, comm::DataType::f64, comm::ReduceOp::avg);
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
    if (lead) progress.update(step + 1, epoch + 1, step_loss, optimizer->lr(), rate, unit);
  }
  if (lead) progress.finish();

  result.steps = total_steps;
  result.epochs_started = epoch + 1;
  result.train_time_s = train_time;
  result.samples_per_s = static_cast<double>(total_steps * batch) / train_time;
  result.tokens_per_s = result.samples_per_s * static_cast<double>(src.tokens_per_sample);
  result.model_flops_per_s =
      3.0 * model->flops_per_sample() * (text ? result.tokens_per_s : result.samples_per_s);
  if (!cfg.trace.empty()) write_trace(trace, cfg.trace, group.get(), rank, world);
  result.params_digest = params_digest(model->named_parameters());
  result.peak_rss = peak_rss_bytes();
  nlohmann::json final_record{{"event", "final"},
                              {"model", cfg.model},
                              {"steps", result.steps},
                              {"epochs", result.epochs_started},
                              {"batch_size", batch},
                              {"world", world},
                              {"accumulate", cfg.accumulate},
                              {"train_loss", result.final_loss},
                              {"train_time_s", result.train_time_s},
                              {"samples_per_s", result.samples_per_s},
                              {"model_flops_per_s", result.model_flops_per_s},
                              {"params", model->num_parameters()},
                              {"params_digest", result.params_digest}};
  if (ddp) {
    // Digests of every rank: identical parameters everywhere is the contract.
    std::vector<std::string> digests(static_cast<size_t>(world));
    std::vector<char> mine(64, 0), all(64 * static_cast<size_t>(world));
    std::memcpy(mine.data(), result.params_digest.data(), std::min<size_t>(64, result.params_digest.size()));
    group->all_gather(mine.data(), all.data(), 64, comm::DataType::u8);
    for (int r = 0; r < world; ++r) {
      const std::string d(all.data() + 64 * r, 64);
      DT_CHECK(d == std::string(mine.data(), 64), "train", "rank {} ended with parameters {} but rank {} with {}", r,
               d, rank, result.params_digest);
    }
    const parallel::MemoryReport mem = ddp->memory(*optimizer);
    final_record["param_bytes_per_rank"] = mem.param_bytes;
    final_record["grad_bytes_per_rank"] = mem.grad_bytes;
    final_record["optimizer_bytes_per_rank"] = mem.optimizer_bytes;
    final_record["zero"] = cfg.zero;
    final_record["buckets"] = ddp->num_buckets();
    final_record["compute_s"] = compute_time;
    final_record["comm_s"] = comm_time;
    final_record["sync_wait_s"] = wait_time;
    // overlap = (T_compute + T_comm - T_step) / T_comm, with T_step the compute plus the wait
    // for the buckets (the optimizer is excluded from both sides).
    final_record["overlap"] = comm_time > 0 ? (compute_time + comm_time - (compute_time + wait_time)) / comm_time : 0.0;
  }
  if (lead) {
    if (text) {
      result.val_loss = evaluate(*model, *src.eval, batch, cfg.eval_batches);
    } else {
      result.test_accuracy = evaluate(*model, *src.eval, 1000, 0);
    }
  }
  result.peak_rss = peak_rss_bytes();
  final_record["peak_rss_bytes"] = result.peak_rss;
  if (text) {
    final_record["tokens_per_s"] = result.tokens_per_s;
    final_record["val_loss"] = result.val_loss;
  } else {
    final_record["test_accuracy"] = result.test_accuracy;
  }
  metrics.write(final_record);
  if (!cfg.save.empty() && lead) save_model(cfg.save, ModelFile{model_metadata(cfg), model->named_parameters()});
  return result;
}

}  // namespace dtrain::train
