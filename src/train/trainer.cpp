// The trainer (trainer.h): the pieces a run is made of (model, optimizer, data, evaluation) and
// run_training, a Trainer whose phases set up the mesh, build this rank's stage, resume from a
// checkpoint, run the steps and finish the run. Its trace is trace.cpp; its state as a
// checkpoint, checkpoint_state.cpp; the options check between ranks, same_options.cpp; fault
// injection lives beside the launcher (launch/fault.h).
#include "dtrain/train/trainer.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "checkpoint_state.h"
#include "dtrain/checkpoint/checkpoint.h"
#include "dtrain/checkpoint/model_io.h"
#include "dtrain/comm/group.h"
#include "dtrain/comm/progress.h"
#include "dtrain/core/error.h"
#include "dtrain/core/file.h"
#include "dtrain/core/log.h"
#include "dtrain/launch/fault.h"
#include "dtrain/optim/offload.h"
#include "dtrain/optim/quantize.h"
#include "dtrain/parallel/ddp.h"
#include "dtrain/parallel/exact.h"
#include "dtrain/parallel/mesh.h"
#include "dtrain/parallel/pipeline.h"
#include "dtrain/parallel/tensor_parallel.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/gemm.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/peak.h"
#include "dtrain/tensor/profile.h"
#include "dtrain/train/metrics.h"
#include "run_record.h"
#include "same_options.h"
#include "trace.h"

namespace dtrain::train {

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
  return std::make_unique<optim::AdamW>(std::move(params), cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay,
                                        optim::parse_state_format(cfg.optimizer_state));
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
    const std::string dir =
        cfg.data.size() > 14 && cfg.data[13] == ':' ? cfg.data.substr(14) : data::FashionMnist::kDefaultDir;
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

// Bytes of parameters, gradients and optimizer state one process will hold, from the stage's
// parameter count and the layout (before any gradient or state exists).
struct StateEstimate {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t total() const { return params + grads + optimizer; }
};

StateEstimate estimate_state(const TrainConfig& cfg, int64_t local_params) {
  StateEstimate e;
  e.params = 4 * local_params;
  e.grads = cfg.zero >= 2 ? e.params / cfg.dp : e.params;
  int64_t state = cfg.optimizer == "adamw" ? 2 * e.params : (cfg.momentum != 0.0f ? e.params : 0);
  // int8: a byte per moment and an f32 scale per 256 of them (each tensor's partial last block
  // adds at most one scale more than this).
  if (cfg.optimizer == "adamw" && cfg.optimizer_state == "int8") {
    state = 2 * (local_params + 4 * ((local_params + optim::kQuantBlock - 1) / optim::kQuantBlock));
  }
  e.optimizer = state / (cfg.zero >= 1 ? cfg.dp : 1);
  // ZeRO 3 keeps a piece of the parameters (and gathers about two blocks at a time: not counted).
  if (cfg.zero == 3) e.params /= cfg.dp;
  // Offloaded, the state is on disk; a step holds one chunk of each of its tensors (4 for int8).
  if (!cfg.offload.empty()) e.optimizer = std::min<int64_t>(e.optimizer, 4 * 4 * optim::kOffloadChunk);
  return e;
}

// Offloaded state that tells the trainer when the step handed a chunk back: where
// DTRAIN_FAULT's phase=optimizer fires, with the state files half updated.
class ObservedStorage : public optim::StateStorage {
 public:
  ObservedStorage(std::shared_ptr<optim::StateStorage> inner, std::function<void()> after_release)
      : inner_(std::move(inner)), after_release_(std::move(after_release)) {}
  Tensor allocate(const std::string& name, const Shape& shape, DType dtype) override {
    return inner_->allocate(name, shape, dtype);
  }
  void release(void* data, size_t bytes) override {
    inner_->release(data, bytes);
    after_release_();
  }

 private:
  std::shared_ptr<optim::StateStorage> inner_;
  std::function<void()> after_release_;
};

// CPU time of this process (all threads): with the train time, how much of the cores a run had
// on a shared machine.
double process_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

std::string mib(int64_t bytes) { return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20)); }

// Point-to-point tags on the world group at the end of a run (9: the trace, trace.cpp).
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

// Per-rank figures every rank contributes to the final record.
struct RankFigures {
  double step_s = 0.0, busy_s = 0.0;
  double activation_peak_bytes = 0.0, peak_bytes = 0.0, max_in_flight = 0.0;
  double peak_rss = 0.0, state_bytes = 0.0;
};

// One run of run_training, in phases that run() calls in order:
//   join_mesh      the world the launcher started, the options check, the mesh's axes
//   check_outputs  outputs written at the end, refused now rather than lost after the run
//   build_stage    this rank's stage of the model, its tensor-parallel shard, the memory check,
//                  the data-parallel reducer, the pipeline, the optimizer
//   (the faults)   DTRAIN_FAULT's faults for this rank (launch/fault.h), fired in the steps
//   resume         the checkpointer, and the newest complete checkpoint loaded into the stage
//   plan_steps     the data order, the step count, the learning-rate schedule, the outputs
//   train_step     one optimizer step (run once per step)
//   finish         the last checkpoint, the trace, the whole model on rank 0, evaluation, the
//                  final record and --save
// The members are declared in the order the phases create them, so that they are destroyed
// in reverse (the checkpointer before the optimizer, the reducer before the mesh, the world
// group last), as the locals of the one function this used to be were.
class Trainer {
 public:
  explicit Trainer(const TrainConfig& cfg);
  TrainResult run();

 private:
  void join_mesh();
  void check_outputs() const;
  void build_stage();
  void split_stages();
  void check_memory() const;
  void build_data_parallel();
  void build_pipeline();
  void resume();
  nlohmann::json checkpoint_layout() const;
  void restore_compression_state(const checkpoint::CheckpointFound& found, const nlohmann::json& layout);
  void plan_steps();
  void announce() const;

  void train_step(int64_t step);
  data::Batch micro_batch(int64_t step, int64_t k) const { return micro_batch(step, k, coord_.dp); }
  data::Batch micro_batch(int64_t step, int64_t k, int replica) const;
  void reseed_global_dropout(int64_t step, int64_t k, int replica);
  double pipeline_round(int64_t step, int64_t a);
  double micro_step(int64_t step, int64_t a);
  void add_exact(int64_t step);
  bool audited(int64_t step) const;
  std::vector<uint64_t> gradient_checksums();
  void flip_gradient_bit(int64_t step);
  void audit(int64_t step);
  void synchronize(int64_t step);
  void clip_gradients();
  double mesh_grad_square_sum();
  void save_checkpoint(int64_t step, Clock::time_point t1);
  void log_step(int64_t step, double step_loss);

  TrainResult finish();
  nlohmann::json final_record();
  void check_replicas_agree();
  void add_data_parallel_figures(nlohmann::json& record) const;
  std::vector<nn::NamedTensor> whole_model();
  std::vector<nn::NamedTensor> local_parameters();
  void evaluate_run();
  void add_rank_figures(nlohmann::json& record);
  void add_profile(nlohmann::json& record) const;

  // join_mesh
  TrainConfig cfg_;
  Precision precision_ = Precision::f32;
  Clock::time_point origin_;
  int world_ = 1;
  std::unique_ptr<comm::Group> group_;
  std::unique_ptr<parallel::Mesh> mesh_;
  parallel::MeshCoord coord_;
  int rank_ = 0;
  bool lead_ = true;
  bool pipelined_ = false;
  // build_stage
  DataSource src_;
  std::vector<nn::BlockRange> stages_{nn::BlockRange{}};
  std::shared_ptr<nn::Model> model_;
  std::map<std::string, parallel::ShardSpec> shard_specs_;
  StateEstimate need_;
  std::unique_ptr<parallel::DataParallel> ddp_;
  std::unique_ptr<parallel::Pipeline> pipe_;
  std::unique_ptr<parallel::ExactGradients> exact_;  // --deterministic without data parallelism
  std::unique_ptr<optim::Optimizer> optimizer_;
  // resume
  std::unique_ptr<checkpoint::Checkpointer> ckpt_;
  int64_t start_step_ = 0;
  std::vector<launch::Fault> faults_;
  // plan_steps
  int64_t batch_ = 0;
  int64_t M_ = 1;            // micro-batches per pipeline round
  int64_t micro_steps_ = 1;  // micro-batches per rank per optimizer step
  int64_t micro_ = 0;        // samples per micro-batch
  std::optional<data::ShardedSampler> sampler_;
  int64_t steps_per_epoch_ = 0;
  int64_t total_steps_ = 0;
  optim::LrSchedule sched_;
  bool text_ = false;
  const char* unit_ = "samples";
  bool holds_loss_ = false;  // the last stage's ranks, one per tensor-parallel group
  MetricsWriter metrics_;
  std::optional<Progress> progress_;
  std::optional<Trace> trace_;
  std::string run_id_ = make_run_id();  // in the start record and the trace: they belong together
  // train_step
  TrainResult result_;
  double train_time_ = 0.0, compute_time_ = 0.0, comm_time_ = 0.0, wait_time_ = 0.0;
  double train_cpu_ = 0.0;                   // CPU time of this process over the steps (all its threads)
  uint64_t wire_bytes_ = 0, raw_bytes_ = 0;  // gradient bytes this rank sent, and what f32 would have sent
  double interval_loss_ = 0.0;
  int64_t interval_steps_ = 0;
  std::vector<int64_t> epoch_indices_;
  std::vector<uint64_t> own_checksums_;  // --audit: this rank's first micro-batch's gradients
  int64_t epoch_ = -1;
  RankFigures fig_;
};

Trainer::Trainer(const TrainConfig& cfg) : cfg_(cfg) {
  set_num_threads(cfg_.threads);
  precision_ = cfg_.precision == "bf16" ? Precision::bf16 : Precision::f32;
  set_matmul_precision(precision_);
  origin_ = Clock::now();
  world_ = world_size(cfg_);
}

TrainResult Trainer::run() {
  join_mesh();
  check_outputs();
  src_ = build_data(cfg_);
  build_stage();
  faults_ = launch::faults_from_env(rank_);  // DTRAIN_FAULT (launch/fault.h)
  resume();
  plan_steps();
  for (int64_t step = start_step_; step < total_steps_; ++step) train_step(step);
  return finish();
}

// ------------------------------------------------------------------ setting up

// Parallel: joins the world the launcher (or MPI) started and splits it into the mesh's axes.
void Trainer::join_mesh() {
  if (world_ > 1) {
    comm::GroupOptions options;
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg_.timeout * 1000.0));
    options.heartbeat_timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg_.heartbeat_timeout * 1000.0));
    if (cfg_.backend == "mpi") {
      group_ = std::make_unique<comm::Group>(comm::Group::from_mpi(options));
    } else {
      options.transport = comm::parse_transport(cfg_.backend);
      group_ = std::make_unique<comm::Group>(comm::Group::from_env(options));
    }
    DT_CHECK(group_->size() == world_, "train", "--dp {} x --pp {} x --tp {} = {} ranks but the {} started {} ({})",
             cfg_.dp, cfg_.pp, cfg_.tp, world_, cfg_.backend == "mpi" ? "MPI job" : "launcher", group_->size(),
             cfg_.backend == "mpi" ? "mpirun -np" : "WORLD_SIZE");
    check_same_options(cfg_, *group_);
    mesh_ = std::make_unique<parallel::Mesh>(*group_, parallel::MeshShape{cfg_.dp, cfg_.pp, cfg_.tp});
    coord_ = mesh_->coord();
    rank_ = group_->rank();
  }
  lead_ = rank_ == 0;
  pipelined_ = cfg_.pp > 1;
}

// Outputs written at the end: refused now, not lost after the whole run.
void Trainer::check_outputs() const {
  if (lead_ && !cfg_.save.empty()) check_output_path(cfg_.save, "--save", "train");
  if (lead_ && !cfg_.trace.empty()) check_output_path(cfg_.trace, "--trace", "train");
  if (lead_ && !cfg_.metrics.empty()) check_output_path(cfg_.metrics, "--metrics", "train");
}

// This rank's stage of the model, and what trains it: the data-parallel reducer over its
// replicas, the pipeline over its stages, the optimizer over its parameters (or ZeRO pieces).
void Trainer::build_stage() {
  split_stages();
  model_ = build_model(cfg_, stages_[static_cast<size_t>(coord_.pp)]);
  if (!pipelined_) stages_[0] = model_->range();  // the whole model, its end now known
  if (cfg_.tp > 1) shard_specs_ = parallel::tensor_parallelize(*model_, mesh_->tp(), cfg_.heads);
  need_ = estimate_state(cfg_, model_->num_parameters());
  check_memory();
  build_data_parallel();
  build_pipeline();
  // The exact sums run over every micro-batch of the step: dp x accumulate x micro-batches.
  if (cfg_.deterministic && !ddp_) {
    exact_ = std::make_unique<parallel::ExactGradients>(model_->named_parameters(),
                                                        cfg_.dp * cfg_.accumulate * cfg_.micro_batches);
  }
  optimizer_ = build_optimizer(cfg_, ddp_ ? ddp_->optimizer_params() : model_->parameters());
  // ZeRO 1 and 3 on one host: the pieces are slices of the host's one copy, read next by the
  // other ranks.
  optimizer_->set_shared_parameters(ddp_ && ddp_->shares_parameters());
  if (!cfg_.offload.empty()) {
    // Inside step S the optimizer has counted S steps.
    optimizer_->set_state_storage(std::make_shared<ObservedStorage>(
        optim::offload_storage(fmt::format("{}/rank-{}", cfg_.offload, rank_)),
        [this] { launch::inject_faults(faults_, optimizer_->step_count(), launch::FaultPhase::optimizer); }));
  }
}

// The blocks of each pipeline stage: balanced by cost and memory, or --stages.
void Trainer::split_stages() {
  if (!pipelined_) return;
  auto probe = build_model(cfg_, nn::BlockRange{0, 1});
  stages_ = cfg_.stages.empty() ? parallel::balance_stages(probe->block_flops(), probe->block_params(), cfg_.pp)
                                : parallel::parse_stages(cfg_.stages, probe->block_flops().size(), cfg_.pp);
}

void Trainer::check_memory() const {
  if (cfg_.memory_limit > 0 && need_.total() > cfg_.memory_limit) {
    DT_THROW("train",
             "the model needs {} per process ({} parameters: {} of parameters, {} of "
             "gradients, {} of {} state) but --memory-limit is {}; split it with --pp or --tp "
             "(or shard the optimizer with --dp and --zero, the parameters too with --zero 3{})",
             mib(need_.total()), model_->num_parameters(), mib(need_.params), mib(need_.grads), mib(need_.optimizer),
             cfg_.optimizer == "adamw" ? cfg_.optimizer_state + " adamw" : cfg_.optimizer, mib(cfg_.memory_limit),
             cfg_.optimizer == "adamw" && cfg_.optimizer_state == "f32"
                 ? ", or store AdamW's moments in 8 bits with --optimizer-state int8"
                 : "");
  }
}

// The reducer over the replicas of this stage and shard, which starts from rank 0's parameters.
void Trainer::build_data_parallel() {
  if (cfg_.dp <= 1) return;
  parallel::DdpOptions o;
  o.bucket_bytes = static_cast<size_t>(cfg_.bucket_mb * 1024 * 1024);
  o.zero = cfg_.zero;
  o.overlap = cfg_.overlap;
  o.share_memory = cfg_.share_memory;
  o.record_events = true;
  o.compress = cfg_.compress;
  o.seed = cfg_.seed;
  o.deterministic = cfg_.deterministic;
  o.micro_batches = cfg_.dp * cfg_.accumulate * cfg_.micro_batches;
  if (cfg_.zero == 3) o.units = parallel::block_units(*model_);
  ddp_ = std::make_unique<parallel::DataParallel>(model_->named_parameters(), mesh_->dp(), o);
  ddp_->broadcast_parameters();
  // ZeRO 3: the blocks gather their parameters around each use.
  model_->set_block_hooks(ddp_->block_hooks());
}

void Trainer::build_pipeline() {
  if (!pipelined_) return;
  parallel::PipelineOptions po;
  po.schedule = parallel::parse_schedule(cfg_.schedule);
  po.micro_batches = static_cast<int>(cfg_.micro_batches);
  po.recompute = cfg_.recompute;
  pipe_ = std::make_unique<parallel::Pipeline>(*model_, mesh_->pp(), po);
}

// Checkpoints: resumes from the newest complete one in --checkpoint-dir, if any.
void Trainer::resume() {
  if (cfg_.checkpoint_dir.empty()) return;
  const nlohmann::json layout = checkpoint_layout();
  ckpt_ = std::make_unique<checkpoint::Checkpointer>(cfg_.checkpoint_dir, cfg_.keep, group_.get(), layout);
  // Any data-parallel / pipeline / ZeRO layout may resume it; model, optimizer and tp must agree.
  const nlohmann::json compatible{{"model", layout.at("model")}, {"optimizer", cfg_.optimizer}, {"tp", cfg_.tp}};
  auto found = ckpt_->latest(compatible);
  if (!found) return;
  restore_checkpoint(*ckpt_, *found, *model_, *optimizer_, ddp_.get(), coord_);
  start_step_ = found->step;
  restore_compression_state(*found, layout);
  if (lead_) {
    DT_LOG_INFO("resumed from {}/step-{:08d}: {} steps done{}", cfg_.checkpoint_dir, start_step_, start_step_,
                found->layout != layout
                    ? fmt::format(" (written by dp {} x pp {}, zero {})", found->layout["dp"].dump(),
                                  found->layout["pp"].dump(), found->layout["zero"].dump())
                    : std::string());
  }
}

// What every manifest records of this run's layout.
nlohmann::json Trainer::checkpoint_layout() const {
  nlohmann::json layout{{"model", nlohmann::json::parse(model_metadata(cfg_))},
                        {"dp", cfg_.dp},
                        {"pp", cfg_.pp},
                        {"tp", cfg_.tp},
                        {"zero", cfg_.zero},
                        {"optimizer", cfg_.optimizer},
                        {"compress", cfg_.compress},
                        {"bucket_mb", cfg_.bucket_mb},
                        {"stages", nlohmann::json::array()}};
  for (const auto& r : stages_) layout["stages"].push_back({r.begin, r.end});
  return layout;
}

// Error feedback and PowerSGD state belong to one rank of one layout: carried over when the
// layout is the same (then the resumed run is bitwise the uninterrupted one).
void Trainer::restore_compression_state(const checkpoint::CheckpointFound& found, const nlohmann::json& layout) {
  if (!ddp_ || cfg_.compress == "none") return;
  std::vector<nn::NamedTensor> state;
  if (found.layout == layout) {
    for (auto& [name, t] : ckpt_->read(found.step, rank_).optimizer) {
      if (name.starts_with("comm/")) state.emplace_back(name.substr(5), t);
    }
  }
  if (!state.empty()) {
    ddp_->load_compression_state(state);
  } else if (lead_) {
    DT_LOG_WARN(
        "--compress {}: the checkpoint has no compression state for this layout; error feedback "
        "starts from zero",
        cfg_.compress);
  }
}

// The data order, the run's length and learning rates, and the outputs that record it.
void Trainer::plan_steps() {
  batch_ = cfg_.batch_size;
  M_ = cfg_.micro_batches;
  micro_steps_ = cfg_.accumulate * M_;
  micro_ = batch_ / (cfg_.dp * micro_steps_);
  // Every rank walks the same shuffled order; step s uses samples [s*B, (s+1)*B) of it, and the
  // data-parallel replica d's micro-batch k takes the slice (k * dp + d) of that global batch:
  // the union is the single-process batch, so the averaged gradient is the same. Stages and
  // tensor-parallel ranks of one replica read the same slices.
  sampler_.emplace(src_.train->size(), 0, 1, cfg_.seed, /*shuffle=*/true);
  steps_per_epoch_ = sampler_->per_rank() / batch_;
  DT_CHECK(steps_per_epoch_ > 0, "train", "--batch-size {} is larger than the training set ({} samples)", batch_,
           src_.train->size());
  total_steps_ = cfg_.steps > 0 ? cfg_.steps : steps_per_epoch_ * std::max<int64_t>(cfg_.epochs, 1);
  sched_ = optim::LrSchedule{cfg_.lr, cfg_.lr_schedule == "cosine" ? cfg_.min_lr : cfg_.lr, cfg_.warmup, total_steps_,
                             cfg_.lr_schedule == "cosine"};
  // A checkpoint past this run's end: nothing to train, and no loss to report (it used to
  // print a summary with loss 0.0000).
  DT_CHECK(start_step_ <= total_steps_, "train",
           "--checkpoint-dir {}: its newest checkpoint is at step {}, past the end of this run ({} steps); raise "
           "--steps (or --epochs), or use another --checkpoint-dir",
           cfg_.checkpoint_dir, start_step_, total_steps_);
  if (start_step_ == total_steps_ && lead_) {
    DT_LOG_WARN("--checkpoint-dir {}: all {} steps were done already; evaluating and saving only (no train loss)",
                cfg_.checkpoint_dir, total_steps_);
  }
  text_ = src_.tokens_per_sample > 0;
  unit_ = text_ ? "tok" : "samples";
  holds_loss_ = coord_.pp == cfg_.pp - 1 && coord_.tp == 0;
  if (lead_) announce();
  // A restarted job (dtrain launch --max-restarts, elastic rounds) appends to the first start's metrics.
  metrics_ = cfg_.metrics.empty() || !lead_ ? MetricsWriter() : MetricsWriter(cfg_.metrics, restart_attempt() > 0);
  metrics_.write(start_record(cfg_, world_, start_step_, total_steps_, run_id_));
  progress_.emplace(total_steps_, cfg_.log_every, cfg_.progress && lead_);
  trace_.emplace(!cfg_.trace.empty(), rank_, origin_);
  if (start_step_ == total_steps_) result_.final_loss = std::numeric_limits<double>::quiet_NaN();
  if (cfg_.profile) {
    profile::reset();
    profile::set_enabled(true);
  }
}

// The run's first log line: model, data, steps and layout.
void Trainer::announce() const {
  std::string layout;
  if (world_ > 1) {
    layout = fmt::format(", {} ranks ({}), {} per micro-batch", world_, mesh_->shape().str(), micro_);
    if (ddp_)
      layout +=
          fmt::format(", {} buckets{}", ddp_->num_buckets(), cfg_.zero ? fmt::format(", ZeRO-{}", cfg_.zero) : "");
    if (pipelined_) {
      std::vector<std::string> cuts;
      for (const auto& r : stages_) cuts.push_back(fmt::format("{}-{}", r.begin, r.end - 1));
      layout += fmt::format(", stages {}, {} x {} micro-batches", fmt::join(cuts, ","), cfg_.schedule, M_);
    }
  }
  DT_LOG_INFO("training {} ({} parameters on this rank) on {} ({} samples), {} steps of batch {}, {} per epoch{}",
              cfg_.model, model_->num_parameters(), cfg_.data, src_.train->size(), total_steps_, batch_,
              steps_per_epoch_, layout);
  if (precision_ == Precision::bf16 && cfg_.model == "gpt") {
    const int64_t head_dim = cfg_.width / cfg_.heads;
    if (!ops::attention_products_bf16(head_dim)) {
      DT_LOG_INFO(
          "bf16: the attention's products stay f32 (head dimension {} < {}, where f32 is faster); every "
          "linear layer's are bf16",
          head_dim, ops::attention_bf16_min_head_dim());
    } else {
      DT_LOG_INFO("bf16: the attention's products are bf16 on {}", ops::attention_bf16_route(head_dim));
    }
  }
}

// ------------------------------------------------------------------ one step

// Forward and backward over this rank's micro-batches, the gradients' synchronisation and
// clipping, the optimizer, then a checkpoint and the log when due.
void Trainer::train_step(int64_t step) {
  comm::note_progress("the start of a step", step + 1);
  launch::inject_faults(faults_, step + 1, launch::FaultPhase::step);
  const int64_t e = step / steps_per_epoch_;
  if (e != epoch_) {
    epoch_ = e;
    epoch_indices_ = sampler_->indices(epoch_);
  }
  const auto t0 = Clock::now();
  const double cpu0 = process_cpu_s();
  // Masks per (step, replica): the same on a resumed run, different between replicas.
  nn::reseed_dropout(*model_, (static_cast<uint64_t>(step) << 20) ^ static_cast<uint64_t>(coord_.dp));
  optimizer_->set_lr(sched_.at(step));
  double step_loss = 0.0;
  for (int64_t a = 0; a < cfg_.accumulate; ++a) step_loss += pipe_ ? pipeline_round(step, a) : micro_step(step, a);
  step_loss /= static_cast<double>(micro_steps_);
  if (audited(step)) audit(step);
  launch::inject_faults(faults_, step + 1, launch::FaultPhase::allreduce);
  const auto ts = Clock::now();
  {
    profile::Scope scope(profile::Kind::comm_wait);
    synchronize(step);
  }
  const auto to = Clock::now();
  wait_time_ += seconds_since(ts, to);
  {
    profile::Scope scope(profile::Kind::optimizer);
    clip_gradients();
    comm::note_progress("the optimizer step", step + 1);
    optimizer_->step();
  }
  if (ddp_) {
    profile::Scope scope(profile::Kind::comm_wait);
    ddp_->gather_parameters();
  }
  {
    profile::Scope scope(profile::Kind::grad_zero);
    if (ddp_) ddp_->zero_grad();
    optimizer_->zero_grad();
  }
  const auto t1 = Clock::now();
  save_checkpoint(step, t1);
  if (ddp_) trace_->span("synchronize", -1, 0, ts, to, step + 1);
  trace_->span("optimizer", -1, 0, to, t1, step + 1);
  trace_->span("step", -1, 0, t0, t1, step + 1);
  train_time_ += seconds_since(t0, t1);
  train_cpu_ += process_cpu_s() - cpu0;
  DT_CHECK(std::isfinite(step_loss), "train", "loss is {} at step {} (lr {}): training diverged", step_loss, step + 1,
           optimizer_->lr());
  log_step(step, step_loss);
}

// Micro-batch k of data-parallel replica `replica` in this step (the audit asks for another's).
data::Batch Trainer::micro_batch(int64_t step, int64_t k, int replica) const {
  const int64_t pos = (step % steps_per_epoch_) * batch_;
  const int64_t at = pos + (k * cfg_.dp + replica) * micro_;
  std::vector<int64_t> idx(epoch_indices_.begin() + at, epoch_indices_.begin() + at + micro_);
  return src_.train->get(idx);
}

// --deterministic: dropout masks per global micro-batch (k of `replica`), not per replica, so
// that any layout, and an auditor recomputing another replica's micro-batch, draws the same ones.
void Trainer::reseed_global_dropout(int64_t step, int64_t k, int replica) {
  nn::reseed_dropout(
      *model_, (static_cast<uint64_t>(step) << 20) ^ (static_cast<uint64_t>(k * cfg_.dp + replica) << 1) ^ uint64_t{1});
}

// Accumulation round `a` through the pipeline: its M micro-batches; returns their loss sum
// (scaled by 1 / micro_steps on the stages' gradients).
double Trainer::pipeline_round(int64_t step, int64_t a) {
  const bool sync = a == cfg_.accumulate - 1;
  parallel::StageStats st;
  const double loss = pipe_->train_step(
      [&](int m) {
        comm::note_progress("reading a batch", step + 1);
        profile::Scope scope(profile::Kind::data);
        data::Batch b = micro_batch(step, a * M_ + m);
        return std::make_pair(b.x, b.y);
      },
      // --deterministic: each micro-batch's gradient unscaled, taken into the exact sums after
      // its backward.
      cfg_.deterministic ? 1.0f : 1.0f / static_cast<float>(micro_steps_),
      [&](bool last) {
        if (ddp_) ddp_->set_sync(sync && last);
      },
      &st,
      [&](int /*m*/) {
        if (cfg_.deterministic) add_exact(step);
      });
  compute_time_ += st.busy_s;
  for (const parallel::PipeSpan& sp : st.spans) {
    trace_->span(sp.forward ? "forward" : "backward", static_cast<int>(a * M_ + sp.micro), 0, sp.start, sp.end,
                 step + 1);
  }
  // The first step of a start also agrees shapes and warms up allocations: left out of
  // the figures (unless it is the only one).
  if (step > start_step_ || total_steps_ - start_step_ == 1) {
    fig_.step_s += st.step_s;
    fig_.busy_s += st.busy_s;
    fig_.activation_peak_bytes = std::max(fig_.activation_peak_bytes, static_cast<double>(st.activation_peak_bytes));
    fig_.peak_bytes = std::max(fig_.peak_bytes, static_cast<double>(st.peak_bytes));
    fig_.max_in_flight = std::max(fig_.max_in_flight, static_cast<double>(st.max_in_flight));
  }
  return loss;
}

// Accumulation micro-step `a` without a pipeline: forward and backward of one micro-batch;
// returns its (unscaled) loss.
double Trainer::micro_step(int64_t step, int64_t a) {
  const bool sync = a == cfg_.accumulate - 1;
  const auto tm = Clock::now();
  comm::note_progress("reading a batch", step + 1);
  data::Batch b;
  {
    profile::Scope scope(profile::Kind::data);
    b = micro_batch(step, a);
  }
  if (ddp_) ddp_->set_sync(sync);
  if (cfg_.deterministic) reseed_global_dropout(step, a, coord_.dp);
  comm::note_progress("forward", step + 1);
  Tensor loss = model_->loss(model_->forward(b.x), b.y);
  const auto tf = Clock::now();
  const double value = static_cast<double>(loss.item());
  if (cfg_.accumulate > 1 && !cfg_.deterministic) loss = loss * (1.0f / static_cast<float>(cfg_.accumulate));
  comm::note_progress("backward", step + 1);
  loss.backward();
  if (a == 0 && launch::bitflip_due(faults_, step + 1)) flip_gradient_bit(step);
  if (a == 0 && audited(step)) own_checksums_ = gradient_checksums();
  if (cfg_.deterministic) add_exact(step);
  const auto tb = Clock::now();
  trace_->span("forward", cfg_.accumulate > 1 ? static_cast<int>(a) : -1, 0, tm, tf, step + 1);
  trace_->span("backward", cfg_.accumulate > 1 ? static_cast<int>(a) : -1, 0, tf, tb, step + 1);
  compute_time_ += seconds_since(tm, tb);
  return value;
}

// --deterministic: this micro-batch's gradients into the exact sums (exact.h), then dropped.
void Trainer::add_exact(int64_t step) {
  profile::Scope scope(profile::Kind::grad_accumulate);
  if (ddp_) {
    ddp_->add_micro_batch();
  } else {
    exact_->add(step + 1, rank_);
  }
}

// --audit K: every K steps (a data-parallel run without stages).
bool Trainer::audited(int64_t step) const {
  return cfg_.audit > 0 && ddp_ != nullptr && !pipe_ && (step + 1) % cfg_.audit == 0;
}

// The checksum of every parameter's gradient now (0 for one without a gradient).
std::vector<uint64_t> Trainer::gradient_checksums() {
  std::vector<uint64_t> sums;
  for (const auto& [name, p] : model_->named_parameters()) {
    const Tensor g = p.grad().defined() ? p.grad().contiguous() : Tensor();
    sums.push_back(g.defined() ? parallel::bits_checksum(g.data(), static_cast<size_t>(g.numel())) : 0);
  }
  return sums;
}

// DTRAIN_FAULT=bitflip: one bit of one element of one gradient of this micro-batch, chosen from
// the step and rank (silent data corruption in this rank's arithmetic).
void Trainer::flip_gradient_bit(int64_t step) {
  std::vector<nn::NamedTensor> params = model_->named_parameters();
  const size_t k = static_cast<size_t>(step + rank_) % params.size();
  auto& [name, p] = params[k];
  Tensor g = p.grad();
  DT_CHECK(g.defined() && g.is_contiguous() && g.numel() > 0, "train",
           "DTRAIN_FAULT bitflip: parameter '{}' has no gradient at step {}", name, step + 1);
  const size_t e = static_cast<size_t>(step * 7919 + rank_) % static_cast<size_t>(g.numel());
  const int bit = static_cast<int>((step * 3 + rank_) % 23);  // a mantissa bit
  uint32_t bits = 0;
  std::memcpy(&bits, g.data() + e, sizeof(bits));
  bits ^= uint32_t{1} << bit;
  std::memcpy(g.data() + e, &bits, sizeof(bits));
  DT_LOG_WARN("DTRAIN_FAULT: flipped bit {} of element {} of the gradient of '{}' on rank {} at step {}", bit, e, name,
              rank_, step + 1);
}

// --audit: this rank recomputes the first micro-batch of the next data-parallel rank from
// scratch and every rank compares, bit for bit (checksums), what each micro-batch's owner
// computed with what its auditor computed. Collective over the replicas; throws on every rank,
// naming the rank, the step and the first tensor that differs.
void Trainer::audit(int64_t step) {
  comm::note_progress("auditing a micro-batch", step + 1);
  const int dp = cfg_.dp;
  const int next = (coord_.dp + 1) % dp;
  const data::Batch b = micro_batch(step, 0, next);
  reseed_global_dropout(step, 0, next);
  ddp_->zero_grad();
  model_->loss(model_->forward(b.x), b.y).backward();
  std::vector<uint64_t> mine = own_checksums_;
  const std::vector<uint64_t> theirs = gradient_checksums();
  ddp_->zero_grad();
  mine.insert(mine.end(), theirs.begin(), theirs.end());
  const size_t n = theirs.size();
  std::vector<uint64_t> all(mine.size() * static_cast<size_t>(dp));
  mesh_->dp().all_gather(mine.data(), all.data(), mine.size(), comm::DataType::i64);
  const std::vector<nn::NamedTensor> params = model_->named_parameters();
  for (int r = 0; r < dp; ++r) {
    const int auditor = (r + dp - 1) % dp;
    const uint64_t* own = all.data() + static_cast<size_t>(r) * 2 * n;
    const uint64_t* redo = all.data() + static_cast<size_t>(auditor) * 2 * n + n;
    for (size_t k = 0; k < n; ++k) {
      DT_CHECK(own[k] == redo[k], "train",
               "--audit: at step {} the gradient of '{}' that rank {} computed for its micro-batch differs from rank "
               "{}'s recomputation of the same micro-batch (checksums {:016x} and {:016x}): silent data corruption "
               "on rank {} (or on rank {}); the run stops",
               step + 1, params[k].first, r, auditor, own[k], redo[k], r, auditor);
    }
  }
}

// Waits for the gradient buckets' all-reduces and records them.
void Trainer::synchronize(int64_t step) {
  if (exact_) exact_->finish();
  if (!ddp_) return;
  ddp_->synchronize();
  for (const auto& ev : ddp_->take_bucket_events()) {
    trace_->span("bucket", ev.bucket, 1, ev.start, ev.end, step + 1, static_cast<int64_t>(ev.bytes));
    comm_time_ += seconds_since(ev.start, ev.end);
  }
  // ZeRO 3: each block's all-gather, from its start (the prefetch) to its completion.
  for (const auto& ev : ddp_->take_gather_events()) {
    trace_->span("gather", ev.bucket, 1, ev.start, ev.end, step + 1, static_cast<int64_t>(ev.bytes));
  }
  const parallel::CommVolume v = ddp_->take_comm_volume();
  wire_bytes_ += v.wire_bytes;
  raw_bytes_ += v.raw_bytes;
}

// --clip-grad: the global norm over the whole model, wherever its pieces live.
void Trainer::clip_gradients() {
  if (!(cfg_.clip_grad > 0.0f)) return;
  if (world_ == cfg_.dp) {
    if (ddp_) {
      ddp_->clip_grad_norm(cfg_.clip_grad);
    } else {
      optim::clip_grad_norm(optimizer_->params(), cfg_.clip_grad);
    }
    return;
  }
  const double norm = std::sqrt(mesh_grad_square_sum());
  if (norm > cfg_.clip_grad) {
    const float scale = static_cast<float>(cfg_.clip_grad / (norm + 1e-6));
    if (ddp_) {
      ddp_->scale_grads(scale);
    } else {
      optim::scale_grads(optimizer_->params(), scale);
    }
  }
}

// Stages and shards hold different gradients: the squared norm is summed over the mesh, each
// replicated tensor-parallel parameter counted once, each data-parallel replica once (under
// ZeRO the replicas hold disjoint pieces, so each piece counts whole). Collective.
double Trainer::mesh_grad_square_sum() {
  auto counted = [&](const std::string& name) {
    auto it = shard_specs_.find(name);
    return coord_.tp == 0 || (it != shard_specs_.end() && it->second.dim >= 0);
  };
  double sq = 0.0;
  if (ddp_) {
    sq = ddp_->grad_square_sum(counted);
    if (!ddp_->sharded()) sq /= cfg_.dp;  // every replica holds the whole gradient
  } else {
    std::vector<Tensor> ps;
    for (const auto& [name, p] : model_->named_parameters()) {
      if (counted(name)) ps.push_back(p);
    }
    sq = optim::grad_square_sum(ps);
  }
  group_->all_reduce(&sq, &sq, 1, comm::DataType::f64, comm::ReduceOp::sum);
  return sq;
}

// Every --checkpoint-every steps (in the background with --checkpoint-async).
void Trainer::save_checkpoint(int64_t step, Clock::time_point t1) {
  if (!ckpt_ || cfg_.checkpoint_every <= 0 || (step + 1) % cfg_.checkpoint_every != 0) return;
  comm::note_progress("writing a checkpoint", step + 1);
  checkpoint::CheckpointShard shard = checkpoint_shard(step + 1, *model_, *optimizer_, ddp_.get());
  const int64_t at = step + 1;
  auto before_commit = [this, at] { launch::inject_faults(faults_, at, launch::FaultPhase::checkpoint); };
  if (cfg_.checkpoint_async) {
    ckpt_->save_async(std::move(shard), before_commit);
  } else {
    ckpt_->save(shard, before_commit);
  }
  trace_->span("checkpoint", -1, 0, t1, Clock::now(), step + 1);
}

// The loss of the log interval (a metrics record every --log-every steps) and the progress bar.
void Trainer::log_step(int64_t step, double step_loss) {
  interval_loss_ += step_loss;
  ++interval_steps_;
  const double samples = static_cast<double>((step + 1 - start_step_) * batch_);
  const double rate =
      text_ ? samples * static_cast<double>(src_.tokens_per_sample) / train_time_ : samples / train_time_;
  if ((step + 1) % cfg_.log_every == 0 || step + 1 == total_steps_) {
    double mean = interval_loss_ / static_cast<double>(interval_steps_);
    if (group_) {
      // The loss lives on the last stage: average over its data-parallel replicas.
      mean = holds_loss_ ? mean / cfg_.dp : 0.0;
      // DTRAIN_FAULT's skip, extra and mismatch act on this collective (launch/fault.h).
      launch::collective_with_faults(
          faults_, step + 1, [&] { group_->all_reduce(&mean, &mean, 1, comm::DataType::f64, comm::ReduceOp::sum); },
          [&] { group_->broadcast(&mean, 1, comm::DataType::f64, 0); });
    }
    result_.final_loss = mean;
    metrics_.write({{"event", "log"},
                    {"step", step + 1},
                    {"epoch", epoch_ + 1},
                    {"loss", result_.final_loss},
                    {"lr", optimizer_->lr()},
                    {text_ ? "tokens_per_s" : "samples_per_s", rate},
                    {"time", unix_seconds()}});
    interval_loss_ = 0.0;
    interval_steps_ = 0;
  }
  comm::note_throughput(rate, unit_);  // dtrain status
  if (lead_) {
    progress_->update(step + 1, epoch_ + 1, holds_loss_ ? step_loss : result_.final_loss, optimizer_->lr(), rate,
                      unit_);
  }
}

// ------------------------------------------------------------------ the end of the run

// The last checkpoint committed, the trace written, the replicas checked, the whole model's
// digest, evaluation, the final metrics record and --save.
TrainResult Trainer::finish() {
  profile::set_enabled(false);
  if (lead_) progress_->finish();
  comm::note_progress("committing the last checkpoint", total_steps_);
  if (ckpt_) ckpt_->finish();  // commits a checkpoint still being written in the background
  if (!cfg_.trace.empty()) write_trace(*trace_, cfg_.trace, group_.get(), rank_, world_, run_id_);
  nlohmann::json record = final_record();
  if (ddp_) {
    check_replicas_agree();
    add_data_parallel_figures(record);
  }
  record["compute_s"] = compute_time_;
  if (cfg_.profile) add_profile(record);
  // The whole model on rank 0, in the single-process order and names: digest and --save.
  const std::vector<nn::NamedTensor> full = whole_model();
  if (lead_) {
    result_.params_digest = checkpoint::params_digest(full);
    int64_t n = 0;
    for (const auto& [name, t] : full) n += t.numel();
    record["params"] = n;
    record["params_digest"] = result_.params_digest;
  }
  evaluate_run();
  result_.peak_rss = peak_rss_bytes();
  record["peak_rss_bytes"] = result_.peak_rss;
  record["state_bytes_per_rank"] = need_.total();
  // What this rank's optimizer holds (its stage, its shard), as allocated.
  record["optimizer_state"] = cfg_.optimizer == "adamw" ? cfg_.optimizer_state : "f32";
  record["optimizer_state_bytes"] = optim::state_bytes(*optimizer_);
  record["offload"] = !cfg_.offload.empty();
  if (group_) add_rank_figures(record);
  if (text_) {
    record["tokens_per_s"] = result_.tokens_per_s;
    record["val_loss"] = result_.val_loss;
  } else {
    record["test_accuracy"] = result_.test_accuracy;
  }
  metrics_.write(record);
  comm::note_progress("saving the model");
  if (!cfg_.save.empty() && lead_) checkpoint::save_model(cfg_.save, checkpoint::ModelFile{model_metadata(cfg_), full});
  return result_;
}

// The run's totals in the result, and the final record's first fields.
nlohmann::json Trainer::final_record() {
  result_.steps = total_steps_;
  result_.epochs_started = epoch_ + 1;
  result_.train_time_s = train_time_;
  result_.samples_per_s =
      train_time_ > 0 ? static_cast<double>((total_steps_ - start_step_) * batch_) / train_time_ : 0.0;
  result_.tokens_per_s = result_.samples_per_s * static_cast<double>(src_.tokens_per_sample);
  // The whole model's FLOPs (a stage knows its model's full configuration).
  result_.model_flops_per_s = 3.0 * model_->flops_per_sample() * (text_ ? result_.tokens_per_s : result_.samples_per_s);
  // MFU against the core's measured peak: every process's --threads threads at the rate of the
  // widest FMA unit present (tensor/peak.h), not against a gemm library's own speed; with bf16
  // products, the bf16 rate where the CPU has a bf16 unit.
  Precision peak_precision = precision_;
  if (peak_precision == Precision::bf16 && measured_peak_flops(cfg_.threads, Precision::bf16) <= 0) {
    peak_precision = Precision::f32;
  }
  const double peak = measured_peak_flops(cfg_.threads, peak_precision);
  result_.peak_flops = peak * world_;
  result_.mfu = result_.peak_flops > 0 ? result_.model_flops_per_s / result_.peak_flops : 0.0;
  nlohmann::json record{{"event", "final"},
                        {"model", cfg_.model},
                        {"steps", result_.steps},
                        {"epochs", result_.epochs_started},
                        {"batch_size", batch_},
                        {"world", world_},
                        {"dp", cfg_.dp},
                        {"pp", cfg_.pp},
                        {"tp", cfg_.tp},
                        {"accumulate", cfg_.accumulate},
                        {"deterministic", cfg_.deterministic},
                        {"train_loss", result_.final_loss},
                        {"train_time_s", result_.train_time_s},
                        {"train_cpu_s", train_cpu_},
                        {"samples_per_s", result_.samples_per_s},
                        {"model_flops_per_s", result_.model_flops_per_s},
                        {"peak_flops_per_rank", peak},
                        {"precision", cfg_.precision},
                        {"peak_isa", peak_probe_isa(peak_precision)},
                        {"mfu", result_.mfu},
                        {"gemm", gemm_backend_name(gemm_backend())}};
  if (precision_ == Precision::bf16) {
    record["bf16_route"] = bf16_products_route();
    if (cfg_.model == "gpt") {
      record["bf16_attention"] = ops::attention_products_bf16(cfg_.width / cfg_.heads);
      record["bf16_attention_route"] = ops::attention_bf16_route(cfg_.width / cfg_.heads);
    }
  }
  return record;
}

// Replicas of one stage and shard must hold identical parameters: that is the contract.
// Collective over the replicas.
void Trainer::check_replicas_agree() {
  const std::string digest = checkpoint::params_digest(local_parameters());
  std::vector<char> mine(64, 0), all(64 * static_cast<size_t>(cfg_.dp));
  std::memcpy(mine.data(), digest.data(), std::min<size_t>(64, digest.size()));
  mesh_->dp().all_gather(mine.data(), all.data(), 64, comm::DataType::u8);
  for (int r = 0; r < cfg_.dp; ++r) {
    const std::string d(all.data() + 64 * static_cast<size_t>(r), 64);
    DT_CHECK(d == std::string(mine.data(), 64), "train",
             "data-parallel replica {} ended with parameters {} but replica {} with {} (stage {}, shard {})", r, d,
             coord_.dp, digest, coord_.pp, coord_.tp);
  }
}

// Memory, communication and overlap of data parallelism on this rank.
void Trainer::add_data_parallel_figures(nlohmann::json& record) const {
  const parallel::MemoryReport mem = ddp_->memory(*optimizer_);
  record["param_bytes_per_rank"] = mem.param_bytes;
  record["grad_bytes_per_rank"] = mem.grad_bytes;
  record["optimizer_bytes_per_rank"] = mem.optimizer_bytes;
  record["zero"] = cfg_.zero;
  // ZeRO 3: the most bytes of whole blocks' parameters held at once (a block and the prefetched next).
  if (ddp_->shards_parameters()) record["gathered_param_peak_bytes"] = ddp_->gathered_peak_bytes();
  record["buckets"] = ddp_->num_buckets();
  record["comm_s"] = comm_time_;
  // Gradient bytes per step that this rank sent, what f32 would have sent, and their ratio.
  record["compress"] = cfg_.compress;
  // Every step this process ran synchronised once.
  const int64_t synced_steps = total_steps_ - start_step_;
  record["wire_bytes_per_step"] = synced_steps > 0 ? static_cast<double>(wire_bytes_) / synced_steps : 0.0;
  record["f32_bytes_per_step"] = synced_steps > 0 ? static_cast<double>(raw_bytes_) / synced_steps : 0.0;
  record["compression_ratio"] = wire_bytes_ > 0 ? static_cast<double>(raw_bytes_) / wire_bytes_ : 1.0;
  record["sync_wait_s"] = wait_time_;
  // overlap = (T_compute + T_comm - T_step) / T_comm, with T_step the compute plus the wait
  // for the buckets (the optimizer is excluded from both sides).
  record["overlap"] = comm_time_ > 0 ? (compute_time_ + comm_time_ - (compute_time_ + wait_time_)) / comm_time_ : 0.0;
}

// The whole model's parameters on rank 0 (tensor-parallel shards and stages gathered), in the
// single-process order and names; this rank's on the others. Collective.
std::vector<nn::NamedTensor> Trainer::whole_model() {
  std::vector<nn::NamedTensor> full = local_parameters();
  if (cfg_.tp > 1) {
    for (auto& [name, t] : full) {
      auto it = shard_specs_.find(name);
      if (it != shard_specs_.end() && it->second.dim >= 0) t = parallel::gather_shards(t, it->second, mesh_->tp());
    }
  }
  if (mesh_) full = gather_full_model(std::move(full), *mesh_);
  return full;
}

// This rank's stage and shard of the model, whole (ZeRO 3 gathers the pieces: collective over the
// data-parallel replicas).
std::vector<nn::NamedTensor> Trainer::local_parameters() {
  std::vector<nn::NamedTensor> params = model_->named_parameters();
  if (ddp_ && ddp_->shards_parameters()) {
    std::vector<Tensor> whole = ddp_->gather_pieces(ddp_->optimizer_params());
    for (size_t k = 0; k < params.size(); ++k) params[k].second = whole[k];
  }
  return params;
}

// Evaluation: the first data-parallel replica's ranks run forward; the last stage's first
// shard computes the figure and hands it to rank 0. Under ZeRO 3 every replica runs it (each
// block's forward gathers its parameters from all of them).
void Trainer::evaluate_run() {
  double eval_value = 0.0;
  if (coord_.dp == 0 || (ddp_ && ddp_->shards_parameters())) {
    std::function<Tensor(const Tensor&)> forward;
    if (pipe_) forward = [&](const Tensor& x) { return pipe_->forward_only(x); };
    eval_value = text_ ? evaluate(*model_, *src_.eval, batch_, cfg_.eval_batches, forward)
                       : evaluate(*model_, *src_.eval, 1000, 0, forward);
    const int holder = mesh_ ? parallel::mesh_rank(mesh_->shape(), {0, cfg_.pp - 1, 0}) : 0;
    if (holder != 0) {
      if (rank_ == holder) group_->send(&eval_value, 1, comm::DataType::f64, 0, kTagEvaluation);
      if (lead_) group_->recv(&eval_value, 1, comm::DataType::f64, holder, kTagEvaluation);
    }
  }
  if (text_) {
    result_.val_loss = eval_value;
  } else {
    result_.test_accuracy = eval_value;
  }
}

// --profile: this rank's time per op kind over the steps it ran (profile.h), into the record,
// and printed by rank 0, largest first. "other" is the train time no kind was charged with:
// autograd's engine, allocation, the loop itself.
void Trainer::add_profile(nlohmann::json& record) const {
  const std::vector<profile::Entry> entries = profile::snapshot();
  const double steps = static_cast<double>(std::max<int64_t>(1, total_steps_ - start_step_));
  double charged = 0.0;
  nlohmann::json kinds = nlohmann::json::object();
  for (const profile::Entry& e : entries) {
    charged += e.total_s();
    if (e.calls == 0) continue;
    kinds[profile::kind_name(e.kind)] = {{"forward_s", e.forward_s}, {"backward_s", e.backward_s}, {"calls", e.calls}};
  }
  const double other = std::max(0.0, train_time_ - charged);
  record["profile"] = {{"rank", rank_}, {"train_time_s", train_time_}, {"kinds", kinds}, {"other_s", other}};
  if (!lead_) return;
  std::vector<profile::Entry> rows;
  for (const profile::Entry& e : entries) {
    if (e.calls > 0) rows.push_back(e);
  }
  std::sort(rows.begin(), rows.end(),
            [](const profile::Entry& a, const profile::Entry& b) { return a.total_s() > b.total_s(); });
  std::string table = fmt::format(
      "profile of rank {} over {} steps ({:.3f} s of training, {:.2f} ms per step), exclusive time per op kind:\n"
      "  {:<16} {:>12} {:>12} {:>12} {:>7} {:>11}\n",
      rank_, total_steps_ - start_step_, train_time_, 1e3 * train_time_ / steps, "kind", "fwd ms/step", "bwd ms/step",
      "ms/step", "%", "calls/step");
  auto pct = [&](double s) { return train_time_ > 0 ? 100.0 * s / train_time_ : 0.0; };
  for (const profile::Entry& e : rows) {
    table += fmt::format("  {:<16} {:>12.3f} {:>12.3f} {:>12.3f} {:>6.1f}% {:>11.1f}\n", profile::kind_name(e.kind),
                         1e3 * e.forward_s / steps, 1e3 * e.backward_s / steps, 1e3 * e.total_s() / steps,
                         pct(e.total_s()), static_cast<double>(e.calls) / steps);
  }
  table += fmt::format("  {:<16} {:>12} {:>12} {:>12.3f} {:>6.1f}%   (autograd engine, allocation, the loop)\n",
                       "other", "", "", 1e3 * other / steps, pct(other));
  std::fputs(table.c_str(), stderr);
}

// Per-rank figures from every rank: everyone's peak RSS, and the stages' bubbles and memory.
// Collective.
void Trainer::add_rank_figures(nlohmann::json& record) {
  fig_.peak_rss = static_cast<double>(result_.peak_rss);
  fig_.state_bytes = static_cast<double>(need_.total());
  constexpr size_t kFields = sizeof(RankFigures) / sizeof(double);
  std::vector<double> all(kFields * static_cast<size_t>(world_));
  group_->all_gather(&fig_, all.data(), kFields, comm::DataType::f64);
  auto at = [&](int r) { return reinterpret_cast<const RankFigures*>(all.data() + kFields * static_cast<size_t>(r)); };
  nlohmann::json rss = nlohmann::json::array();
  for (int r = 0; r < world_; ++r) rss.push_back(static_cast<int64_t>(at(r)->peak_rss));
  record["peak_rss_bytes_per_rank"] = rss;
  if (!pipelined_) return;
  nlohmann::json bubble = nlohmann::json::array(), act = nlohmann::json::array(), peak = nlohmann::json::array(),
                 inflight = nlohmann::json::array(), cuts = nlohmann::json::array();
  for (int s = 0; s < cfg_.pp; ++s) {
    const RankFigures* f = at(parallel::mesh_rank(mesh_->shape(), {0, s, 0}));
    bubble.push_back(f->step_s > 0 ? std::max(0.0, 1.0 - f->busy_s / f->step_s) : 0.0);
    act.push_back(static_cast<int64_t>(f->activation_peak_bytes));
    peak.push_back(static_cast<int64_t>(f->peak_bytes));
    inflight.push_back(static_cast<int64_t>(f->max_in_flight));
    cuts.push_back({stages_[static_cast<size_t>(s)].begin, stages_[static_cast<size_t>(s)].end});
  }
  record["schedule"] = cfg_.schedule;
  record["micro_batches"] = M_;
  record["stages"] = cuts;
  record["stage_bubble"] = bubble;
  record["bubble_theory"] = static_cast<double>(cfg_.pp - 1) / static_cast<double>(M_ + cfg_.pp - 1);
  record["stage_activation_peak_bytes"] = act;
  record["stage_step_peak_bytes"] = peak;
  record["stage_max_in_flight"] = inflight;
}

}  // namespace

TrainResult run_training(const TrainConfig& cfg) {
  // The loop notes its progress (comm/progress.h); once this returns or throws, what follows
  // (leaving the groups, the caller's own work) is not watched.
  struct StopWatchingProgress {
    ~StopWatchingProgress() { comm::pause_progress(); }
  } stop_watching;
  Trainer trainer(cfg);
  return trainer.run();
}

}  // namespace dtrain::train
