#include "same_options.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>
#include <vector>

#include "dtrain/core/error.h"

namespace dtrain::train {

nlohmann::json run_options(const TrainConfig& c) {
  return nlohmann::json{{"model", c.model},
                        {"hidden", c.hidden},
                        {"layers", c.layers},
                        {"heads", c.heads},
                        {"width", c.width},
                        {"seq-len", c.seq_len},
                        {"dropout", c.dropout},
                        {"val-fraction", c.val_fraction},
                        {"steps", c.steps},
                        {"epochs", c.epochs},
                        {"batch-size", c.batch_size},
                        {"optimizer", c.optimizer},
                        {"optimizer-state", c.optimizer_state},
                        {"lr", c.lr},
                        {"momentum", c.momentum},
                        {"weight-decay", c.weight_decay},
                        {"beta1", c.beta1},
                        {"beta2", c.beta2},
                        {"eps", c.eps},
                        {"lr-schedule", c.lr_schedule},
                        {"warmup", c.warmup},
                        {"min-lr", c.min_lr},
                        {"clip-grad", c.clip_grad},
                        {"dp", c.dp},
                        {"accumulate", c.accumulate},
                        {"zero", c.zero},
                        {"bucket-mb", c.bucket_mb},
                        {"overlap", c.overlap},
                        {"share-memory", c.share_memory},
                        {"compress", c.compress},
                        {"deterministic", c.deterministic},
                        {"audit", c.audit},
                        {"pp", c.pp},
                        {"tp", c.tp},
                        {"micro-batches", c.micro_batches},
                        {"schedule", c.schedule},
                        {"stages", c.stages},
                        {"recompute", c.recompute},
                        {"memory-limit", c.memory_limit},
                        {"checkpoint-dir", c.checkpoint_dir},
                        {"checkpoint-every", c.checkpoint_every},
                        {"keep", c.keep},
                        {"checkpoint-async", c.checkpoint_async},
                        {"timeout", c.timeout},
                        {"backend", c.backend},
                        {"heartbeat-timeout", c.heartbeat_timeout},
                        {"seed", c.seed},
                        {"precision", c.precision},
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
    options.push_back(nlohmann::json::parse(
        all.substr(longest * static_cast<size_t>(r), lengths[static_cast<size_t>(r)]), nullptr, false));
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

}  // namespace dtrain::train
