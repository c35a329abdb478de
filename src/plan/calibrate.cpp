// Kernel timing and the calibration file (calibrate.h).
#include "dtrain/plan/calibrate.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>

#include "dtrain/core/error.h"
#include "dtrain/core/file.h"
#include "dtrain/data/data.h"
#include "dtrain/nn/layers.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/random.h"
#include "dtrain/train/trainer.h"

namespace dtrain::plan {

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kFormat = "dtrain-plan-calibration";
constexpr int kVersion = 1;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// One tensor-parallel shard of a transformer block, as TpTransformerBlock computes it with the
// all-reduces left out: x (B, T, C) -> qkv (B, T, 3C/tp) over heads/tp heads -> proj (C/tp -> C)
// -> + bias + x -> ln2 -> fc (C -> 4C/tp) -> gelu -> fc_proj (4C/tp -> C) -> + bias + h.
class BlockShard : public nn::Module {
 public:
  BlockShard(int64_t width, int64_t heads, int tp, Generator& gen) : heads_(heads / tp) {
    const int64_t c = width, s = width / tp;
    ln1_ = register_module("ln1", std::make_shared<nn::LayerNorm>(c));
    ln2_ = register_module("ln2", std::make_shared<nn::LayerNorm>(c));
    qkv_w_ = register_parameter("qkv_w", Tensor::randn({3 * s, c}, gen, 0.02f));
    qkv_b_ = register_parameter("qkv_b", Tensor::zeros({3 * s}));
    proj_w_ = register_parameter("proj_w", Tensor::randn({c, s}, gen, 0.02f));
    proj_b_ = register_parameter("proj_b", Tensor::zeros({c}));
    fc_w_ = register_parameter("fc_w", Tensor::randn({4 * s, c}, gen, 0.02f));
    fc_b_ = register_parameter("fc_b", Tensor::zeros({4 * s}));
    fcp_w_ = register_parameter("fcp_w", Tensor::randn({c, 4 * s}, gen, 0.02f));
    fcp_b_ = register_parameter("fcp_b", Tensor::zeros({c}));
  }
  Tensor forward(const Tensor& x) override {
    Tensor att = ops::causal_attention(ops::linear(ln1_->forward(x), qkv_w_, qkv_b_), heads_);
    Tensor h = ops::add(x, ops::add(ops::linear(att, proj_w_, Tensor()), proj_b_));
    Tensor m = ops::gelu(ops::linear(ln2_->forward(h), fc_w_, fc_b_));
    return ops::add(h, ops::add(ops::linear(m, fcp_w_, Tensor()), fcp_b_));
  }

 private:
  int64_t heads_;
  std::shared_ptr<nn::LayerNorm> ln1_, ln2_;
  Tensor qkv_w_, qkv_b_, proj_w_, proj_b_, fc_w_, fc_b_, fcp_w_, fcp_b_;
};

// Class ids or token ids as the data sets deliver them (f32).
Tensor ids(const Shape& shape, int64_t classes, Generator& gen) {
  Tensor u = Tensor::uniform(shape, gen, 0.0f, static_cast<float>(classes));
  std::vector<float> v = u.to_vector();
  for (float& x : v) x = std::min(static_cast<float>(classes - 1), static_cast<float>(static_cast<int64_t>(x)));
  return Tensor::from_vector(shape, v);
}

}  // namespace

ModelSpec model_of(const train::TrainConfig& cfg) {
  if (cfg.model == "mlp") return mlp_spec(data::FashionMnist::kPixels, cfg.hidden, data::FashionMnist::kClasses);
  DT_CHECK(cfg.model == "gpt", "plan", "--model '{}': expected mlp or gpt", cfg.model);
  return gpt_spec(cfg.layers, cfg.width, cfg.heads, cfg.seq_len, nn::GptConfig{}.vocab);
}

KernelEntry measure_kernels(const train::TrainConfig& cfg, int64_t rows, int tp, int repeats) {
  DT_CHECK(rows >= 1 && tp >= 1 && repeats >= 1, "plan", "measure_kernels: rows {}, tp {}, repeats {}", rows, tp,
           repeats);
  set_num_threads(cfg.threads);
  KernelEntry e;
  e.model = train::model_metadata(cfg);
  e.rows = rows;
  e.tp = tp;
  e.threads = cfg.threads;
  auto model = train::build_model(cfg);
  model->train(true);
  const bool gpt = cfg.model == "gpt";
  const int64_t n = static_cast<int64_t>(model->num_blocks());
  Generator gen(cfg.seed + 1);
  std::shared_ptr<nn::Module> shard;
  if (gpt && tp > 1) shard = std::make_shared<BlockShard>(cfg.width, cfg.heads, tp, gen);
  for (int64_t i = 0; i < n; ++i) {
    nn::Module& block = (shard && i > 0 && i + 1 < n) ? *shard : *model->block(static_cast<size_t>(i));
    const bool first = i == 0, last = i + 1 == n;
    Tensor x;
    if (first) {
      x = gpt ? ids({rows, cfg.seq_len}, nn::GptConfig{}.vocab, gen)
              : Tensor::randn({rows, data::FashionMnist::kPixels}, gen);
    } else {
      const int64_t in = gpt ? cfg.width : cfg.hidden[static_cast<size_t>(i - 1)];
      x = gpt ? Tensor::randn({rows, cfg.seq_len, in}, gen) : Tensor::randn({rows, in}, gen);
    }
    const Tensor targets =
        gpt ? ids({rows, cfg.seq_len}, nn::GptConfig{}.vocab, gen) : ids({rows}, data::FashionMnist::kClasses, gen);
    std::vector<double> fw, bw, act;
    for (int k = 0; k <= repeats; ++k) {
      Tensor in = x.detach();
      // A stage's input requires grad (the previous stage wants its gradient); ids do not.
      if (!first) in.set_requires_grad(true);
      const int64_t before = memory::live_bytes();
      auto t0 = Clock::now();
      Tensor y = block.forward(in);
      if (last) y = model->loss(y, targets);
      const double f = seconds_since(t0);
      const int64_t held = memory::live_bytes() - before;
      Tensor g = last ? Tensor() : Tensor::randn(y.shape(), gen);
      t0 = Clock::now();
      if (last) {
        y.backward();
      } else {
        y.backward(g);
      }
      const double b = seconds_since(t0);
      block.zero_grad();
      if (k == 0) continue;  // warm-up: first-touch allocations
      fw.push_back(f);
      bw.push_back(b);
      act.push_back(static_cast<double>(held));
    }
    e.times.forward.push_back(median(fw));
    e.times.backward.push_back(median(bw));
    e.act_bytes.push_back(median(act));
  }
  return e;
}

double measure_optimizer(const train::TrainConfig& cfg, int64_t params) {
  DT_CHECK(params > 0, "plan", "measure_optimizer: {} parameters", params);
  Generator gen(cfg.seed + 2);
  // Tensors of about a layer's size, as many as make `params`.
  const int64_t piece = std::min<int64_t>(params, 1 << 18);
  std::vector<Tensor> ps;
  for (int64_t have = 0; have < params; have += piece) {
    Tensor p = Tensor::randn({std::min(piece, params - have)}, gen);
    p.set_requires_grad(true);
    ps.push_back(p);
  }
  auto opt = train::build_optimizer(cfg, ps);
  std::vector<double> t;
  for (int k = 0; k < 6; ++k) {
    for (Tensor& p : ps) p.set_grad(Tensor::randn(p.shape(), gen, 1e-3f));
    const auto t0 = Clock::now();
    opt->step();
    opt->zero_grad();
    if (k > 0) t.push_back(seconds_since(t0));
  }
  return median(t) / static_cast<double>(params);
}

namespace {
bool same_key(const KernelEntry& a, const KernelEntry& b) {
  return a.model == b.model && a.rows == b.rows && a.tp == b.tp && a.threads == b.threads &&
         a.concurrency == b.concurrency;
}
}  // namespace

const KernelEntry* Calibration::find(const std::string& model, int64_t rows, int tp, int threads,
                                     int concurrency) const {
  KernelEntry key;
  key.model = model;
  key.rows = rows;
  key.tp = tp;
  key.threads = threads;
  key.concurrency = concurrency;
  for (const KernelEntry& e : kernels) {
    if (same_key(e, key)) return &e;
  }
  return nullptr;
}

void Calibration::put(KernelEntry entry) {
  for (KernelEntry& e : kernels) {
    if (same_key(e, entry)) {
      e = std::move(entry);
      return;
    }
  }
  kernels.push_back(std::move(entry));
}

nlohmann::json to_json(const Calibration& c) {
  nlohmann::json j{{"format", kFormat},
                   {"version", kVersion},
                   {"cores", c.cores},
                   {"shm", {{"alpha_us", c.shm.alpha_s * 1e6}, {"beta_ns_per_byte", c.shm.beta_s_per_byte * 1e9}}},
                   {"tcp", {{"alpha_us", c.tcp.alpha_s * 1e6}, {"beta_ns_per_byte", c.tcp.beta_s_per_byte * 1e9}}},
                   {"gamma_ns_per_byte", c.gamma_s_per_byte * 1e9},
                   {"memcpy_ns_per_byte", c.copy_s_per_byte * 1e9},
                   {"flops_per_s", c.flops_per_s},
                   {"optimizer_ns_per_param", c.optimizer_s_per_param * 1e9},
                   {"kernels", nlohmann::json::array()}};
  for (const KernelEntry& e : c.kernels) {
    j["kernels"].push_back({{"model", e.model},
                            {"rows", e.rows},
                            {"tp", e.tp},
                            {"threads", e.threads},
                            {"concurrency", e.concurrency},
                            {"forward_s", e.times.forward},
                            {"backward_s", e.times.backward},
                            {"act_bytes", e.act_bytes}});
  }
  return j;
}

Calibration calibration_from_json(const nlohmann::json& j, const std::string& where) {
  DT_CHECK(j.is_object() && j.value("format", "") == kFormat, "plan",
           "{}: not a calibration file (expected \"format\": \"{}\")", where, kFormat);
  DT_CHECK(j.value("version", 0) == kVersion, "plan", "{}: calibration version {}, this dtrain reads version {}", where,
           j.value("version", 0), kVersion);
  Calibration c;
  try {
    c.cores = j.at("cores").get<int>();
    c.shm = {j.at("shm").at("alpha_us").get<double>() * 1e-6, j.at("shm").at("beta_ns_per_byte").get<double>() * 1e-9};
    c.tcp = {j.at("tcp").at("alpha_us").get<double>() * 1e-6, j.at("tcp").at("beta_ns_per_byte").get<double>() * 1e-9};
    c.gamma_s_per_byte = j.at("gamma_ns_per_byte").get<double>() * 1e-9;
    c.copy_s_per_byte = j.at("memcpy_ns_per_byte").get<double>() * 1e-9;
    c.flops_per_s = j.at("flops_per_s").get<double>();
    c.optimizer_s_per_param = j.at("optimizer_ns_per_param").get<double>() * 1e-9;
    for (const auto& k : j.at("kernels")) {
      KernelEntry e;
      e.model = k.at("model").get<std::string>();
      e.rows = k.at("rows").get<int64_t>();
      e.tp = k.at("tp").get<int>();
      e.threads = k.at("threads").get<int>();
      e.concurrency = k.at("concurrency").get<int>();
      e.times.forward = k.at("forward_s").get<std::vector<double>>();
      e.times.backward = k.at("backward_s").get<std::vector<double>>();
      e.act_bytes = k.at("act_bytes").get<std::vector<double>>();
      DT_CHECK(e.times.forward.size() == e.times.backward.size(), "plan",
               "{}: kernel entry with {} forward and {} "
               "backward times",
               where, e.times.forward.size(), e.times.backward.size());
      c.kernels.push_back(std::move(e));
    }
  } catch (const nlohmann::json::exception& e) {
    DT_THROW("plan", "{}: {}", where, e.what());
  }
  DT_CHECK(c.cores >= 1 && c.flops_per_s > 0, "plan", "{}: cores {} and flops_per_s {} must be positive", where,
           c.cores, c.flops_per_s);
  return c;
}

Calibration load_calibration(const std::string& path) {
  std::ifstream in(path);
  DT_CHECK(in.good(), "plan", "--calibration {}: cannot open", path);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  DT_CHECK(!j.is_discarded(), "plan", "--calibration {}: not JSON", path);
  return calibration_from_json(j, path);
}

void save_calibration(const Calibration& c, const std::string& path) {
  write_file_atomic(path, to_json(c).dump(1) + "\n", "plan");
}

}  // namespace dtrain::plan
