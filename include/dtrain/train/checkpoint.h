// Checkpoints that survive crashes.
//
// Layout on disk: DIR/step-00000012/ holds one file per rank (rank-R.dtm, the model-file
// format: the rank's parameters, its optimizer state and counters in the metadata, SHA-256 at
// the end) and manifest.json: step, layout, and every file's SHA-256. Every file is written to
// a temporary name, fsynced and renamed, then the directory is fsynced; rank 0 writes the
// manifest only after every rank's file is in place, so the manifest is the commit point: a
// step directory without a valid manifest is incomplete and never loaded.
//
// Loading takes the newest step whose manifest parses and whose files all match their
// checksums; a damaged or incomplete newer one is skipped with a warning that names the damage.
// The layout (dp, pp, tp, zero, model) must match the run's (resharding comes later).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/group.h"
#include "dtrain/nn/module.h"

namespace dtrain::train {

/// One rank's part of a checkpoint.
struct CheckpointShard {
  int64_t step = 0;                        // optimizer steps completed
  std::vector<nn::NamedTensor> params;     // this rank's parameters (its stage, its shard)
  std::vector<nn::NamedTensor> optimizer;  // its optimizer's state()
  std::vector<int64_t> counters;           // its optimizer's counters()
};

class Checkpointer {
 public:
  /// `world` may be null (one process). `layout` is compared on load (JSON object).
  Checkpointer(std::string dir, int keep, comm::Group* world, nlohmann::json layout);

  /// Collective. `before_commit` runs on every rank after its file is written and before the
  /// manifest (fault injection: a crash there must leave the previous checkpoint in charge).
  void save(const CheckpointShard& shard, const std::function<void()>& before_commit = nullptr);

  /// Collective: this rank's shard of the newest complete checkpoint, or nothing.
  std::optional<CheckpointShard> load_latest();

  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  int keep_;
  comm::Group* world_;
  nlohmann::json layout_;
};

/// A file a manifest lists.
struct ManifestFile {
  std::string name;
  std::string sha256;
};
/// Checks a manifest's text for `step` and `layout`; empty when valid (and fills `files`),
/// else what is wrong. Never throws on malformed input.
std::string parse_manifest(const std::string& text, int64_t step, const nlohmann::json& layout,
                           std::vector<ManifestFile>* files);

/// Step directories under `dir`, newest first (for tools and tests).
std::vector<int64_t> checkpoint_steps(const std::string& dir);
/// Checks one step's manifest and files; empty when complete, else what is wrong.
std::string checkpoint_damage(const std::string& dir, int64_t step, const nlohmann::json& layout);

}  // namespace dtrain::train
