// Training configuration: one struct, filled from defaults, then a TOML file, then flags
// (flags win). The option table in config.cpp is the single source for --help, the TOML
// keys and the README.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace dtrain::train {

struct TrainConfig {
  // model
  std::string model = "mlp";                   // mlp | gpt
  std::vector<int64_t> hidden = {1024, 1024};  // MLP widths
  int64_t layers = 4, heads = 4, width = 128, seq_len = 128;
  float dropout = 0.0f;
  // data
  std::string data;  // fashion-mnist[:DIR] | text:PATH; empty = the model's default
  double val_fraction = 0.1;
  // schedule
  int64_t steps = 0;        // total optimizer steps; 0 = use epochs
  int64_t epochs = 0;       // 0 and steps 0 = 1 epoch
  int64_t batch_size = 64;  // global batch
  // optimisation
  std::string optimizer = "adamw";      // sgd | adamw
  std::string optimizer_state = "f32";  // AdamW's moments: f32 | int8 (block-wise 8-bit, about 4x smaller)
  std::string offload;                  // AdamW's state in memory-mapped files under this directory (empty: memory)
  float lr = 1e-3f;
  float momentum = 0.9f;
  float weight_decay = 0.0f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  std::string lr_schedule = "constant";  // constant | cosine
  int64_t warmup = 0;
  float min_lr = 0.0f;
  float clip_grad = 0.0f;  // 0 = off
  // parallelism
  int dp = 1;                     // data-parallel ranks (local processes started by dtrain launch)
  int64_t accumulate = 1;         // micro-steps per optimizer step (no gradient sync before the last)
  int zero = 0;                   // ZeRO stage: 0, 1 (optimizer state sharded), 2 (also gradients)
  double bucket_mb = 25.0;        // gradient bucket size, MiB
  bool overlap = true;            // start bucket all_reduces during backward
  bool share_memory = true;       // --zero 0/1 on one host: gradient slots (--zero 1: and parameters) in shared memory
  std::string compress = "none";  // gradient compression: none | bf16 | fp16 | int8 | int4 | powersgd:RANK
  bool deterministic = false;     // exact, layout-independent gradient sums (docs/determinism.md)
  int64_t audit = 0;              // --deterministic: every K steps a rank recomputes another's micro-batch (0: off)
  int pp = 1;                     // pipeline stages
  int tp = 1;                     // tensor-parallel ranks per stage
  int64_t micro_batches = 1;      // pipeline micro-batches per accumulation step
  std::string schedule = "1f1b";  // pipeline schedule: gpipe | 1f1b
  std::string stages;             // blocks per stage by hand, "0-3,4-7" (empty: balanced)
  bool recompute = false;         // pipeline: recompute activations in backward
  int64_t memory_limit = 0;       // bytes of parameters + gradients + optimizer state per process (0: none)
  std::string checkpoint_dir;     // checkpoints (resumed from automatically when present)
  int64_t checkpoint_every = 0;   // steps between checkpoints (0: none)
  int keep = 3;                   // complete checkpoints kept
  bool checkpoint_async = false;  // write checkpoints on a background thread (commit at the next one)
  int max_restarts = 0;           // dtrain train's own launcher restarts the workers this often
  int min_workers = 0;            // elastic: go on with fewer data-parallel replicas, down to this many processes
  double timeout = 300.0;         // seconds a collective or point-to-point call may wait
  std::string backend = "auto";   // auto | shm | tcp | mpi (a job started by mpirun or srun)
  double heartbeat_timeout = 10.0;  // seconds without a rank's heartbeat before the job stops (0: off)
  std::string trace;                // Chrome/Perfetto trace file (rank 0 gathers every rank's events and writes it)
  // run
  uint64_t seed = 0;
  int threads = 1;
  std::string precision = "f32";  // products: f32 | bf16 (bf16 operands, f32 sums; f32 weights and state)
  int64_t log_every = 50;
  int64_t eval_batches = 0;  // text: validation batches (0 = whole validation split)
  std::string metrics;       // JSON-lines file
  std::string save;          // model file
  std::string config_file;
  bool progress = true;  // progress bar when stderr is a terminal
  bool profile = false;  // time per op kind, printed at the end and in the final record
  /// Names of the options set by a flag or the config file (the rest keep defaults).
  std::set<std::string> given;
};

/// Registers every training option on `app` (a CLI11 subcommand) bound to `cfg`.
void add_train_options(CLI::App& app, TrainConfig& cfg);
/// Reads cfg.config_file (TOML) into the fields whose flags were not given on the command
/// line. Unknown keys, values of the wrong type, integers out of the option's type and
/// non-finite numbers are errors naming the file, key and value.
void apply_config_file(CLI::App& app, TrainConfig& cfg);
/// Fills model-dependent defaults (data set) and checks ranges and the parallel layout (before
/// any process starts): every number finite, every option in its meaningful range, dp x pp x tp
/// at most 256; throws dtrain::Error naming the option and its value.
void finalize(TrainConfig& cfg);
/// Processes the run needs: dp x pp x tp (after finalize(), which bounds it to 256).
inline int world_size(const TrainConfig& cfg) { return cfg.dp * cfg.pp * cfg.tp; }
/// Blocks of the configured model (the units pipeline stages are cut between).
int64_t model_blocks(const TrainConfig& cfg);

/// What an option of the table takes, for tools that set options by name (dtrain sweep).
enum class OptionKind { text, integer, number, boolean, integer_list };
struct OptionInfo {
  std::string name;  // as a flag, without the dashes: "weight-decay"
  OptionKind kind;
};
/// Every option of the table, in its order (--config is not one of them).
std::vector<OptionInfo> train_options();
/// The value of option `name` in `cfg` as the text its flag takes back (`--NAME=TEXT`): numbers
/// in their shortest exact form, true|false, lists comma separated. Throws for an unknown name.
std::string option_text(const TrainConfig& cfg, const std::string& name);

}  // namespace dtrain::train
