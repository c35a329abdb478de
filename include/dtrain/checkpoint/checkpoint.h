// Checkpoints that survive crashes.
//
// Layout on disk: DIR/step-00000012/ holds one file per rank (rank-R.dtm, the model-file
// format: the rank's parameters, its optimizer state and counters in the metadata, SHA-256 at
// the end) and manifest.json: step, layout, and every file's SHA-256. Every file is written to
// a temporary name, fsynced and renamed, then the directory is fsynced; rank 0 writes the
// manifest only after every rank's file is in place, so the manifest is the commit point: a
// step directory without a valid manifest is incomplete and never loaded.
//
// Loading takes the newest step whose manifest parses, has every field of the type it is read
// as, and whose files all match their checksums; a damaged or incomplete newer one is skipped
// with a warning that names the damage and the file. The model, optimizer and tp must match the
// run's; the data-parallel and pipeline layout may change.
//
// DIR/.lock belongs to the run that writes DIR: its lead rank holds an exclusive flock on it
// (and has written its pid there) for the Checkpointer's lifetime, so a second run on the same
// directory is refused at start; the kernel releases it when the process ends, killed or not.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/group.h"
#include "dtrain/nn/module.h"

namespace dtrain::checkpoint {

/// One rank's part of a checkpoint, in a form that does not depend on the data-parallel layout
/// (so that it can be loaded into another one).
struct CheckpointShard {
  int64_t step = 0;                     // optimizer steps completed
  std::vector<nn::NamedTensor> params;  // this rank's parameters (its stage, its shard)
  /// Optimizer state per parameter, named "KIND/PARAM" (e.g. "exp_avg/h0.qkv.weight"), shaped
  /// like the parameter (whole, even under ZeRO).
  std::vector<nn::NamedTensor> optimizer;
  int64_t step_count = 0;                      // the optimizer's steps
  std::map<std::string, int64_t> param_steps;  // per-parameter step counts (AdamW), by name
};

/// Where the newest complete checkpoint is, and the layout that wrote it.
// Not a real escape: its implicit noexcept constructor reaches nlohmann::json's noexcept default
// constructor, whose throw is for value kinds other than null.
// NOLINTNEXTLINE(bugprone-exception-escape)
struct CheckpointFound {
  int64_t step = 0;
  nlohmann::json layout;
};

class Checkpointer {
 public:
  /// Collective. `world` may be null (one process). `layout` goes into every manifest (JSON
  /// object; its dp, pp and tp are integers). Creates `dir` when it does not exist; throws
  /// dtrain::Error naming it when it is not a directory, cannot be listed or written, or (rank
  /// 0) is locked by another run.
  Checkpointer(std::string dir, int keep, comm::Group* world, nlohmann::json layout);

  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  /// Collective. `before_commit` runs on every rank after its file is written and before the
  /// manifest (fault injection: a crash there must leave the previous checkpoint in charge).
  void save(const CheckpointShard& shard, const std::function<void()>& before_commit = nullptr);
  /// Copies the shard and writes it on a background thread, so that training goes on while the
  /// disk works; the commit (collective) happens at the next save or finish(). A crash before
  /// that loses this checkpoint, never an earlier one.
  void save_async(CheckpointShard shard, std::function<void()> before_commit = nullptr);
  /// Collective when a save_async is pending: waits for its file and commits it.
  void finish();

  /// Collective: the newest complete checkpoint whose layout agrees with this run's on the
  /// keys of `compatible` (e.g. model, optimizer, tp), or nothing.
  std::optional<CheckpointFound> latest(const nlohmann::json& compatible);
  /// The shard rank `rank` wrote at `step` (any rank may read any shard).
  CheckpointShard read(int64_t step, int rank) const;

  const std::string& dir() const { return dir_; }

 private:
  struct Pending {
    int64_t step = 0;
    std::thread writer;
    std::string sum;
    std::exception_ptr error;
    std::function<void()> before_commit;
  };
  std::string write_shard(const CheckpointShard& shard) const;
  void commit(int64_t step, const std::string& sum);
  void open_dir(bool lead);  // creates, lists and probes the directory; `lead` takes the lock
  void close_lock();

  std::string dir_;
  int keep_;
  comm::Group* world_;
  nlohmann::json layout_;
  std::unique_ptr<Pending> pending_;
  std::set<int64_t> verified_;  // rank 0: complete steps of this layout, known without rereading
  int lock_fd_ = -1;            // rank 0: DIR/.lock, flocked
};

/// A file a manifest lists.
struct ManifestFile {
  std::string name;
  std::string sha256;
};
/// Checks a manifest's text for `step` and a layout that agrees with `compatible` on its keys;
/// empty when valid (and fills `files` and `layout`), else what is wrong. Valid means: every
/// field of the type it is read as, layout dp, pp and tp integers in [1, 256], and one file per
/// rank, in rank order, named rank-R.dtm. Never throws on malformed input.
std::string parse_manifest(const std::string& text, int64_t step, const nlohmann::json& compatible,
                           std::vector<ManifestFile>* files, nlohmann::json* layout = nullptr);

/// Step directories under `dir`, newest first (for tools and tests); none when `dir` does not
/// exist. Throws dtrain::Error naming `dir` when it cannot be listed.
std::vector<int64_t> checkpoint_steps(const std::string& dir);
/// Checks one step's manifest and files; empty when complete, else what is wrong.
std::string checkpoint_damage(const std::string& dir, int64_t step, const nlohmann::json& compatible,
                              nlohmann::json* layout = nullptr);

}  // namespace dtrain::checkpoint
