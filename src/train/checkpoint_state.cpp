#include "checkpoint_state.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"

namespace dtrain::train {

using checkpoint::CheckpointShard;

// Checkpoints hold the optimizer state per parameter name ("exp_avg/h0.qkv.weight"), whole
// even under ZeRO, so that another data-parallel or pipeline layout can load it.
CheckpointShard checkpoint_shard(int64_t step, const nn::Model& model, const optim::Optimizer& optimizer,
                                 const parallel::DataParallel* ddp) {
  CheckpointShard shard;
  shard.step = step;
  shard.params = model.named_parameters();
  const bool zero = ddp != nullptr && ddp->sharded();
  if (ddp != nullptr && ddp->shards_parameters()) {
    // ZeRO 3: the parameters are pieces; the checkpoint holds them whole (collective).
    std::vector<Tensor> whole = ddp->gather_pieces(ddp->optimizer_params());
    for (size_t k = 0; k < shard.params.size(); ++k) shard.params[k].second = whole[k];
  }
  const size_t slots = optimizer.params().size();
  // state() names are "KIND.INDEX" over the optimizer's parameters (ZeRO: bucket pieces).
  std::map<std::string, std::vector<Tensor>> kinds;
  for (const auto& [name, t] : optimizer.state()) {
    const size_t dot = name.rfind('.');
    DT_CHECK(dot != std::string::npos, "checkpoint", "optimizer state '{}' has no index", name);
    // 8-bit codes and their per-block scales cannot be cut into and joined from ZeRO pieces.
    DT_CHECK(!zero || t.dtype() == DType::f32, "checkpoint",
             "optimizer state '{}' is {}: a ZeRO-sharded optimizer's state must be f32 to be saved", name,
             dtype_name(t.dtype()));
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

namespace {

// What the writer's first replica saved, merged over its stages, by name.
struct Saved {
  std::map<std::string, Tensor> params, state;
  std::map<std::string, int64_t> steps;
  int64_t step_count = 0;
};

// The shards of the writer's stages with tensor-parallel coordinate `tp`.
Saved read_first_replica(const checkpoint::Checkpointer& ckpt, const checkpoint::CheckpointFound& found, int tp) {
  const nlohmann::json& lay = found.layout;
  const parallel::MeshShape old{lay.at("dp").get<int>(), lay.at("pp").get<int>(), lay.at("tp").get<int>()};
  Saved saved;
  for (int s = 0; s < old.pp; ++s) {
    CheckpointShard shard = ckpt.read(found.step, parallel::mesh_rank(old, {0, s, tp}));
    for (auto& [name, t] : shard.params) saved.params[name] = t;
    for (auto& [name, t] : shard.optimizer) saved.state[name] = t;
    for (auto& [name, n] : shard.param_steps) saved.steps[name] = n;
    saved.step_count = shard.step_count;
  }
  return saved;
}

void load_parameters(const Saved& saved, std::vector<nn::NamedTensor>& named, parallel::DataParallel* ddp,
                     const parallel::MeshCoord& coord, int64_t step) {
  // Ranks that share one copy of the parameters (ZeRO-1 on one host): the first writes it, and
  // the others wait for it below instead of writing the same bytes at the same time.
  const bool shared = ddp != nullptr && ddp->shares_parameters();
  const bool pieces = ddp != nullptr && ddp->shards_parameters();
  std::vector<Tensor> whole;
  for (auto& [name, p] : named) {
    auto it = saved.params.find(name);
    DT_CHECK(it != saved.params.end() && it->second.shape() == p.shape(), "train",
             "checkpoint step {} has no parameter '{}' of shape {}", step, name, shape_str(p.shape()));
    if (pieces) {
      whole.push_back(it->second);
    } else if (!shared || coord.dp == 0) {
      p.copy_from(it->second);
    }
  }
  if (pieces) {
    // ZeRO 3: this rank keeps its pieces of the saved values.
    const std::vector<Tensor> mine = ddp->scatter_pieces(whole);
    const std::vector<Tensor> dst = ddp->optimizer_params();
    for (size_t j = 0; j < dst.size(); ++j) Tensor(dst[j]).copy_from(mine[j]);
    if (shared) ddp->gather_parameters();  // one host: the pieces are slices of one copy; a barrier
    return;
  }
  if (shared) ddp->gather_parameters();  // in shared memory, a barrier
}

void load_optimizer_state(const Saved& saved, const std::vector<nn::NamedTensor>& named, optim::Optimizer& optimizer,
                          parallel::DataParallel* ddp) {
  // The state kinds, and per kind one tensor per parameter of this rank (undefined: none).
  std::map<std::string, std::vector<Tensor>> kinds;
  for (const auto& [key, t] : saved.state) {
    if (key.starts_with("comm/")) continue;  // compression state: per rank, restored by the caller
    const size_t slash = key.find('/');
    kinds[key.substr(0, slash)].resize(named.size());
  }
  for (auto& [kind, v] : kinds) {
    for (size_t k = 0; k < named.size(); ++k) {
      auto it = saved.state.find(kind + "/" + named[k].first);
      if (it != saved.state.end()) v[k] = it->second;
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
  std::vector<int64_t> counters{saved.step_count};
  if (!saved.steps.empty()) {
    counters.resize(1 + optimizer.params().size(), 0);
    for (size_t k = 0; k < named.size(); ++k) {
      const size_t slot = zero ? ddp->piece_holding(k) : k;
      const auto it = saved.steps.find(named[k].first);
      counters[1 + slot] = std::max(counters[1 + slot], it != saved.steps.end() ? it->second : 0);
    }
  }
  optimizer.load_state(loaded, counters);
}

}  // namespace

void restore_checkpoint(const checkpoint::Checkpointer& ckpt, const checkpoint::CheckpointFound& found,
                        nn::Model& model, optim::Optimizer& optimizer, parallel::DataParallel* ddp,
                        const parallel::MeshCoord& coord) {
  const Saved saved = read_first_replica(ckpt, found, coord.tp);
  auto named = model.named_parameters();
  NoGradGuard no_grad;
  load_parameters(saved, named, ddp, coord, found.step);
  load_optimizer_state(saved, named, optimizer, ddp);
}

}  // namespace dtrain::train
