#include "dtrain/train/trainer.h"

#include <chrono>
#include <cmath>

#include <nlohmann/json.hpp>

#include "dtrain/core/error.h"
#include "dtrain/core/log.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/train/metrics.h"
#include "dtrain/train/model_io.h"

namespace dtrain::train {

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

TrainResult run_training(const TrainConfig& cfg) {
  set_num_threads(cfg.threads);
  DataSource src = build_data(cfg);
  auto model = build_model(cfg);
  auto optimizer = build_optimizer(cfg, model->parameters());
  const int64_t batch = cfg.batch_size;
  data::ShardedSampler sampler(src.train->size(), 0, 1, cfg.seed, /*shuffle=*/true);
  const int64_t steps_per_epoch = sampler.per_rank() / batch;
  DT_CHECK(steps_per_epoch > 0, "train", "--batch-size {} is larger than the training set ({} samples)", batch,
           src.train->size());
  const int64_t total_steps = cfg.steps > 0 ? cfg.steps : steps_per_epoch * std::max<int64_t>(cfg.epochs, 1);
  optim::LrSchedule sched{cfg.lr, cfg.lr_schedule == "cosine" ? cfg.min_lr : cfg.lr, cfg.warmup, total_steps,
                          cfg.lr_schedule == "cosine"};

  const bool text = src.tokens_per_sample > 0;
  const char* unit = text ? "tok" : "samples";
  DT_LOG_INFO("training {} ({} parameters) on {} ({} samples), {} steps of batch {}, {} per epoch", cfg.model,
              model->num_parameters(), cfg.data, src.train->size(), total_steps, batch, steps_per_epoch);
  MetricsWriter metrics = cfg.metrics.empty() ? MetricsWriter() : MetricsWriter(cfg.metrics);
  Progress progress(total_steps, cfg.log_every, cfg.progress);

  TrainResult result;
  double train_time = 0.0;
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
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<int64_t> idx(epoch_indices.begin() + pos, epoch_indices.begin() + pos + batch);
    data::Batch b = src.train->get(idx);
    optimizer->set_lr(sched.at(step));
    Tensor loss = model->loss(model->forward(b.x), b.y);
    loss.backward();
    if (cfg.clip_grad > 0.0f) optim::clip_grad_norm(optimizer->params(), cfg.clip_grad);
    optimizer->step();
    optimizer->zero_grad();
    train_time += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const float l = loss.item();
    DT_CHECK(std::isfinite(l), "train", "loss is {} at step {} (lr {}): training diverged", l, step + 1,
             optimizer->lr());
    interval_loss += l;
    ++interval_steps;
    const double samples = static_cast<double>((step + 1) * batch);
    const double rate = text ? samples * static_cast<double>(src.tokens_per_sample) / train_time : samples / train_time;
    progress.update(step + 1, epoch + 1, l, optimizer->lr(), rate, unit);
    if ((step + 1) % cfg.log_every == 0 || step + 1 == total_steps) {
      result.final_loss = interval_loss / static_cast<double>(interval_steps);
      metrics.write({{"event", "log"},
                     {"step", step + 1},
                     {"epoch", epoch + 1},
                     {"loss", result.final_loss},
                     {"lr", optimizer->lr()},
                     {text ? "tokens_per_s" : "samples_per_s", rate}});
      interval_loss = 0.0;
      interval_steps = 0;
    }
  }
  progress.finish();

  result.steps = total_steps;
  result.epochs_started = epoch + 1;
  result.train_time_s = train_time;
  result.samples_per_s = static_cast<double>(total_steps * batch) / train_time;
  result.tokens_per_s = result.samples_per_s * static_cast<double>(src.tokens_per_sample);
  result.model_flops_per_s =
      3.0 * model->flops_per_sample() * (text ? result.tokens_per_s : result.samples_per_s);
  if (text) {
    result.val_loss = evaluate(*model, *src.eval, batch, cfg.eval_batches);
  } else {
    result.test_accuracy = evaluate(*model, *src.eval, 1000, 0);
  }
  result.peak_rss = peak_rss_bytes();
  result.params_digest = params_digest(model->named_parameters());

  nlohmann::json final_record{{"event", "final"},
                              {"model", cfg.model},
                              {"steps", result.steps},
                              {"epochs", result.epochs_started},
                              {"batch_size", batch},
                              {"train_loss", result.final_loss},
                              {"train_time_s", result.train_time_s},
                              {"samples_per_s", result.samples_per_s},
                              {"model_flops_per_s", result.model_flops_per_s},
                              {"peak_rss_bytes", result.peak_rss},
                              {"params", model->num_parameters()},
                              {"params_digest", result.params_digest}};
  if (text) {
    final_record["tokens_per_s"] = result.tokens_per_s;
    final_record["val_loss"] = result.val_loss;
  } else {
    final_record["test_accuracy"] = result.test_accuracy;
  }
  metrics.write(final_record);
  if (!cfg.save.empty()) save_model(cfg.save, ModelFile{model_metadata(cfg), model->named_parameters()});
  return result;
}

}  // namespace dtrain::train
