// The single-process training loop and the pieces it is made of (model, optimizer, data),
// exposed so that parallel trainers reuse them.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "dtrain/data/data.h"
#include "dtrain/nn/models.h"
#include "dtrain/optim/optim.h"
#include "dtrain/train/config.h"

namespace dtrain::train {

/// The configured model, or only blocks `range` of it (a pipeline stage, same values).
std::shared_ptr<nn::Model> build_model(const TrainConfig& cfg, nn::BlockRange range = {});
std::unique_ptr<optim::Optimizer> build_optimizer(const TrainConfig& cfg, std::vector<Tensor> params);
/// JSON text describing the model (kind and shape), stored in model files.
std::string model_metadata(const TrainConfig& cfg);

/// Training and evaluation data for a config.
struct DataSource {
  std::shared_ptr<data::Dataset> train;
  std::shared_ptr<data::Dataset> eval;
  std::shared_ptr<data::TextCorpus> corpus;  // keeps text splits alive
  int64_t tokens_per_sample = 0;             // seq_len for text, 0 for images
};
DataSource build_data(const TrainConfig& cfg);

struct TrainResult {
  int64_t steps = 0;
  int64_t epochs_started = 0;
  double train_time_s = 0.0;
  double samples_per_s = 0.0;
  double tokens_per_s = 0.0;
  double final_loss = 0.0;         // mean of the last log interval
  double test_accuracy = -1;       // classification
  double val_loss = -1;            // text
  double model_flops_per_s = 0.0;  // 3 x forward FLOPs per sample x samples/s
  /// The job's peak: processes x the measured FMA peak of --threads threads (tensor/peak.h).
  double peak_flops = 0.0;
  double mfu = 0.0;  // model_flops_per_s / peak_flops
  int64_t peak_rss = 0;
  std::string params_digest;
};

/// Evaluates: classification accuracy on `eval`, or mean validation loss on text. `forward`
/// replaces model.forward (a pipeline's forward_only: an undefined result means this rank does
/// not hold the output, and its return value is then meaningless).
double evaluate(nn::Model& model, const data::Dataset& eval, int64_t batch_size, int64_t max_batches,
                const std::function<Tensor(const Tensor&)>& forward = nullptr);

/// Trains one process end to end: progress, metrics, evaluation, --save.
TrainResult run_training(const TrainConfig& cfg);

}  // namespace dtrain::train
