#include "dtrain/train/config.h"

#include <fmt/ranges.h>
#include <toml++/toml.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <variant>

#include "dtrain/comm/mpi.h"
#include "dtrain/core/error.h"
#include "dtrain/parallel/ddp.h"

namespace dtrain::train {

namespace {

using Target = std::variant<std::string*, int64_t*, uint64_t*, int*, float*, double*, bool*, std::vector<int64_t>*>;

struct OptionSpec {
  const char* name;  // flag without dashes; the TOML key uses the same name with '_' for '-'
  Target target;
  const char* help;
  bool bare = false;  // a bool that may be given without a value (--profile, = --profile=true)
};

std::vector<OptionSpec> option_table(TrainConfig& c) {
  return {
      {"model", &c.model, "model: mlp | gpt"},
      {"hidden", &c.hidden, "MLP hidden widths, comma separated (default 1024,1024)"},
      {"layers", &c.layers, "GPT: transformer blocks"},
      {"heads", &c.heads, "GPT: attention heads (must divide --width)"},
      {"width", &c.width, "GPT: embedding width C"},
      {"seq-len", &c.seq_len, "GPT: context length T"},
      {"dropout", &c.dropout, "GPT: dropout probability"},
      {"data", &c.data,
       "data set: fashion-mnist[:DIR] (default for mlp) | text:PATH (file or folder; default for gpt: "
       "text:/usr/share/games/fortunes)"},
      {"val-fraction", &c.val_fraction, "text: fraction of the corpus held out for validation"},
      {"steps", &c.steps, "optimizer steps to run (overrides --epochs)"},
      {"epochs", &c.epochs, "passes over the training set (default 1)"},
      {"batch-size", &c.batch_size, "global batch size in samples (split over data-parallel ranks); gpt default 16"},
      {"optimizer", &c.optimizer, "optimizer: sgd | adamw"},
      {"optimizer-state", &c.optimizer_state,
       "AdamW's moments: f32 | int8 (8-bit codes with a scale per block of 256 values: about 4x less optimizer "
       "memory; --zero 0 only)"},
      {"offload", &c.offload,
       "keep AdamW's state in memory-mapped files under this directory (one subdirectory per rank), streamed "
       "through each step in 1 MiB chunks: resident memory holds a chunk of it, not all of it"},
      {"lr", &c.lr, "peak learning rate"},
      {"momentum", &c.momentum, "SGD momentum"},
      {"weight-decay", &c.weight_decay, "weight decay (decoupled for AdamW, L2 for SGD)"},
      {"beta1", &c.beta1, "AdamW beta1"},
      {"beta2", &c.beta2, "AdamW beta2"},
      {"eps", &c.eps, "AdamW epsilon"},
      {"lr-schedule", &c.lr_schedule, "learning-rate schedule: constant | cosine (after --warmup)"},
      {"warmup", &c.warmup, "linear warmup steps"},
      {"min-lr", &c.min_lr, "cosine schedule: final learning rate"},
      {"clip-grad", &c.clip_grad, "clip gradients to this global L2 norm (0 = off)"},
      {"dp", &c.dp, "data-parallel replicas; dtrain train starts dp x pp x tp local worker processes (alias -n)"},
      {"accumulate", &c.accumulate, "micro-steps per optimizer step; gradients sync only on the last"},
      {"zero", &c.zero,
       "ZeRO stage: 0 off, 1 shards optimizer state, 2 also gradients, 3 also parameters (gathered per block "
       "around its forward and backward)"},
      {"bucket-mb", &c.bucket_mb, "data parallel: gradient bucket size in MiB"},
      {"compress", &c.compress,
       "data parallel: gradient compression none | bf16 | fp16 | int8 | int4 (quantized inside the collective, "
       "error feedback) | powersgd:RANK (low rank, error feedback)"},
      {"overlap", &c.overlap, "data parallel: start each bucket's all_reduce during backward (false: after)"},
      {"share-memory", &c.share_memory,
       "data parallel, one host, --zero 0, 1 or 3: gradients reduced in place in shared memory (no staging "
       "copies, --zero 0/1); --zero 1 and 3 keep one copy of the parameters there (--zero 3: each rank's piece is "
       "its slice of it, nothing gathered)"},
      {"deterministic", &c.deterministic,
       "the same parameters bit for bit on any layout (--dp, --accumulate, --zero, --pp, elastic, transports) for "
       "the same global batch and micro-batch: gradients summed exactly in 64-bit fixed point "
       "(docs/determinism.md)",
       true},
      {"audit", &c.audit,
       "--deterministic: every K steps each data-parallel rank recomputes another rank's micro-batch and compares "
       "the gradient bit for bit; a mismatch stops the run naming the rank, step and tensor (0 = off)"},
      {"pp", &c.pp, "pipeline stages: the model's blocks cut into this many stages, one per process"},
      {"tp", &c.tp, "tensor-parallel ranks per stage (GPT: attention heads and MLP split, Megatron style)"},
      {"micro-batches", &c.micro_batches, "pipeline: micro-batches per step (per accumulation step)"},
      {"schedule", &c.schedule, "pipeline schedule: gpipe | 1f1b"},
      {"stages", &c.stages, "pipeline: blocks per stage by hand, e.g. 0-2,3-5 (default: balanced by cost and memory)"},
      {"recompute", &c.recompute, "pipeline: keep only stage inputs, recompute activations in backward"},
      {"memory-limit", &c.memory_limit,
       "bytes of parameters + gradients + optimizer state allowed per process (0 = no limit)"},
      {"checkpoint-dir", &c.checkpoint_dir,
       "write checkpoints here, and resume from the newest complete one found here at start"},
      {"checkpoint-every", &c.checkpoint_every, "steps between checkpoints (0 = none; needs --checkpoint-dir)"},
      {"keep", &c.keep, "complete checkpoints to keep"},
      {"checkpoint-async", &c.checkpoint_async,
       "snapshot checkpoints to memory and write them in the background (committed at the next one or at the end)"},
      {"max-restarts", &c.max_restarts,
       "when a worker fails, restart all workers from the last complete checkpoint up to this many times"},
      {"min-workers", &c.min_workers,
       "elastic: when a worker fails on two starts in a row, go on with fewer data-parallel replicas as long as "
       "this many processes remain (0 = never; global batch kept)"},
      {"timeout", &c.timeout, "seconds a collective or point-to-point call waits for its peers before it fails"},
      {"backend", &c.backend,
       "communication: auto (shared memory on one host, TCP between hosts) | shm | tcp | mpi (a job started by "
       "mpirun or srun: one process per rank, no dtrain launcher)"},
      {"heartbeat-timeout", &c.heartbeat_timeout,
       "seconds without a rank's heartbeat (dead, stopped, unreachable) before every rank stops with a report (0 = "
       "off)"},
      {"trace", &c.trace, "write a Chrome/Perfetto trace (JSON) of forward, backward, communication, optimizer"},
      {"seed", &c.seed, "random seed (initialisation, shuffling, dropout)"},
      {"threads", &c.threads, "BLAS threads per process"},
      {"precision", &c.precision,
       "matrix products: f32 | bf16 (operands rounded to bf16, sums in f32, on AMX or AVX512_BF16 through oneDNN; "
       "weights, gradients and optimizer state stay f32; a CPU without bf16 instructions runs the same arithmetic "
       "on f32 units and says so)"},
      {"log-every", &c.log_every, "steps between log lines and metrics records"},
      {"eval-batches", &c.eval_batches, "text: validation batches to evaluate (0 = the whole split)"},
      {"metrics", &c.metrics, "write JSON-lines metrics to this file"},
      {"save", &c.save, "save the trained model to this file"},
      {"progress", &c.progress, "progress bar on a terminal (--progress=false for plain log lines)"},
      {"profile", &c.profile,
       "time per op kind (matmul, layer norm, GELU, softmax, attention, cross-entropy, embedding, optimizer, "
       "gradient accumulation and zeroing, bucket copies, communication wait), printed at the end of the run and "
       "added to the final metrics record",
       true},
  };
}

// Upper bounds that keep the arithmetic on the options in range (sizes in elements, seconds
// in milliseconds, MiB in bytes, epochs times batches in steps).
constexpr int64_t kMaxDim = int64_t{1} << 24;
constexpr int64_t kMaxEpochs = 1000000;
constexpr double kMaxSeconds = 1e7;  // about 115 days
constexpr double kMaxBucketMb = 1 << 20;

std::string toml_key(const char* flag) {
  std::string k = flag;
  for (char& ch : k) {
    if (ch == '-') ch = '_';
  }
  return k;
}

// "an integer from MIN to MAX": the range of the option's C++ type.
template <typename T>
std::string integer_range() {
  return fmt::format("an integer from {} to {}", std::numeric_limits<T>::min(), std::numeric_limits<T>::max());
}

template <typename T>
T integer_value(const toml::node& node, const std::string& where) {
  auto v = node.value_exact<int64_t>();
  DT_CHECK(v.has_value(), "config", "{}: expected an integer", where);
  DT_CHECK(*v >= 0 || std::is_signed_v<T>, "config", "{}: expected a non-negative integer, got {}", where, *v);
  // A value out of the option's type would wrap around (dp = 4294967297 became 1 process).
  if constexpr (std::is_signed_v<T>) {
    DT_CHECK(*v >= std::numeric_limits<T>::min() && *v <= std::numeric_limits<T>::max(), "config",
             "{}: {} is out of range (expected {})", where, *v, integer_range<T>());
  }
  return static_cast<T>(*v);
}

double number_value(const toml::node& node, const std::string& where) {
  if (auto i = node.value_exact<int64_t>()) return static_cast<double>(*i);
  auto v = node.value_exact<double>();
  DT_CHECK(v.has_value(), "config", "{}: expected a number", where);
  DT_CHECK(std::isfinite(*v), "config", "{}: expected a finite number, got {}", where, *v);
  return *v;
}

// CLI11 reads integers with strtoll/strtoull: out-of-range values saturate, "-1" becomes
// 2^64-1 for an unsigned option and "010" is octal. This checks the text first (decimal, whole,
// in the option's range) and hands CLI11 the canonical decimal.
template <typename T>
CLI::Validator integer_flag() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        T v{};
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, v, 10);
        if (ec == std::errc::result_out_of_range) {
          return fmt::format("{} is out of range (expected {})", text, integer_range<T>());
        }
        if (ec != std::errc() || ptr != end || text.empty()) {
          return fmt::format("'{}' is not a decimal integer (expected {})", text, integer_range<T>());
        }
        text = std::to_string(v);  // what CLI11 converts next: no leading zero for it to read as octal
        return {};
      },
      "");
}

void assign(const Target& target, const toml::node& node, const std::string& where) {
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) {
          auto v = node.value_exact<std::string>();
          DT_CHECK(v.has_value(), "config", "{}: expected a string", where);
          *p = *v;
        } else if constexpr (std::is_same_v<T, bool>) {
          auto v = node.value_exact<bool>();
          DT_CHECK(v.has_value(), "config", "{}: expected true or false", where);
          *p = *v;
        } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
          const double v = number_value(node, where);
          DT_CHECK(std::fabs(v) <= std::numeric_limits<T>::max(), "config",
                   "{}: {} is out of range (at most {} in magnitude)", where, v, std::numeric_limits<T>::max());
          *p = static_cast<T>(v);
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          const toml::array* arr = node.as_array();
          DT_CHECK(arr != nullptr, "config", "{}: expected an array of integers such as [1024, 1024]", where);
          p->clear();
          for (size_t i = 0; i < arr->size(); ++i) {
            p->push_back(integer_value<int64_t>(*arr->get(i), fmt::format("{}[{}]", where, i)));
          }
        } else {
          *p = integer_value<T>(node, where);
        }
      },
      target);
}

}  // namespace

std::vector<OptionInfo> train_options() {
  TrainConfig scratch;
  std::vector<OptionInfo> out;
  for (const auto& spec : option_table(scratch)) {
    const OptionKind kind = std::visit(
        [](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::string>) return OptionKind::text;
          if constexpr (std::is_same_v<T, bool>) return OptionKind::boolean;
          if constexpr (std::is_floating_point_v<T>) return OptionKind::number;
          if constexpr (std::is_same_v<T, std::vector<int64_t>>) return OptionKind::integer_list;
          return OptionKind::integer;
        },
        spec.target);
    out.push_back({spec.name, kind});
  }
  return out;
}

std::string option_text(const TrainConfig& cfg, const std::string& name) {
  TrainConfig c = cfg;  // the table binds mutable fields
  for (const auto& spec : option_table(c)) {
    if (name != spec.name) continue;
    return std::visit(
        [](auto* p) -> std::string {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::string>) {
            return *p;
          } else if constexpr (std::is_same_v<T, bool>) {
            return *p ? "true" : "false";
          } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
            return fmt::format("{}", fmt::join(*p, ","));
          } else {
            return fmt::format("{}", *p);  // floats: the shortest text that reads back to the same value
          }
        },
        spec.target);
  }
  DT_THROW("config", "unknown option '{}'", name);
}

int64_t model_blocks(const TrainConfig& c) {
  return c.model == "gpt" ? c.layers + 2 : static_cast<int64_t>(c.hidden.size()) + 1;
}

void add_train_options(CLI::App& app, TrainConfig& cfg) {
  for (auto& spec : option_table(cfg)) {
    std::string flag = std::string("--") + spec.name;
    if (std::string(spec.name) == "dp") flag = "-n,--dp";
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          CLI::Option* opt = nullptr;
          if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
            opt = app.add_option(flag, *p, spec.help)
                      ->delimiter(',')
                      ->expected(1, 64)
                      ->transform(integer_flag<int64_t>());
          } else if constexpr (std::is_same_v<T, bool>) {
            opt = spec.bare ? app.add_flag(flag, *p, spec.help) : app.add_option(flag, *p, spec.help);
          } else if constexpr (std::is_integral_v<T>) {
            opt = app.add_option(flag, *p, spec.help)->transform(integer_flag<T>());
          } else {
            opt = app.add_option(flag, *p, spec.help);
          }
          opt->capture_default_str();
        },
        spec.target);
  }
  app.add_option("--config", cfg.config_file, "TOML file of options (keys as flags with '_' for '-'); flags win")
      ->check(CLI::ExistingFile);
}

void apply_config_file(CLI::App& app, TrainConfig& cfg) {
  for (auto& spec : option_table(cfg)) {
    if (app.count(std::string("--") + spec.name) > 0) cfg.given.insert(spec.name);
  }
  if (cfg.config_file.empty()) return;
  toml::table table;
  try {
    table = toml::parse_file(cfg.config_file);
  } catch (const toml::parse_error& e) {
    DT_THROW("config", "{}:{}:{}: {}", cfg.config_file, e.source().begin.line, e.source().begin.column,
             e.description());
  }
  auto specs = option_table(cfg);
  for (const auto& [key, node] : table) {
    const std::string k(key.str());
    const OptionSpec* spec = nullptr;
    for (const auto& s : specs) {
      if (toml_key(s.name) == k || s.name == k) spec = &s;
    }
    DT_CHECK(spec != nullptr, "config", "{}: unknown key '{}' (keys are the train flags, e.g. batch_size)",
             cfg.config_file, k);
    if (app.count(std::string("--") + spec->name) > 0) continue;  // the flag wins
    assign(spec->target, node, fmt::format("{}: key '{}'", cfg.config_file, k));
    cfg.given.insert(spec->name);
  }
}

void finalize(TrainConfig& c) {
  // NaN fails every comparison, so a check written as "error if x < 0" lets it through; an
  // infinity overflows the conversions to milliseconds and bytes. Refused for every option.
  for (const auto& spec : option_table(c)) {
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_floating_point_v<T>) {
            DT_CHECK(std::isfinite(*p), "config", "--{} {}: expected a finite number", spec.name, *p);
          }
        },
        spec.target);
  }
  DT_CHECK(c.model == "mlp" || c.model == "gpt", "config", "--model '{}': expected mlp or gpt", c.model);
  const bool gpt = c.model == "gpt";
  if (c.data.empty()) c.data = gpt ? "text:/usr/share/games/fortunes" : "fashion-mnist";
  if (gpt && c.given.count("batch-size") == 0) c.batch_size = 16;
  if (gpt && c.given.count("lr") == 0) c.lr = 3e-4f;
  DT_CHECK(c.data.rfind("fashion-mnist", 0) == 0 || c.data.rfind("text:", 0) == 0, "config",
           "--data '{}': expected fashion-mnist[:DIR] or text:PATH", c.data);
  DT_CHECK(!(gpt && c.data.rfind("fashion-mnist", 0) == 0), "config",
           "--model gpt needs a text corpus (--data text:PATH), got '{}'", c.data);
  DT_CHECK(!(!gpt && c.data.rfind("text:", 0) == 0), "config", "--model mlp trains on fashion-mnist, got '{}'", c.data);
  DT_CHECK(c.optimizer == "sgd" || c.optimizer == "adamw", "config", "--optimizer '{}': expected sgd or adamw",
           c.optimizer);
  DT_CHECK(c.optimizer_state == "f32" || c.optimizer_state == "int8", "config",
           "--optimizer-state '{}': expected f32 or int8", c.optimizer_state);
  DT_CHECK(c.optimizer_state == "f32" || c.optimizer == "adamw", "config",
           "--optimizer-state int8 quantizes AdamW's moments; --optimizer {} has none (use --optimizer adamw)",
           c.optimizer);
  DT_CHECK(c.optimizer_state == "f32" || c.zero == 0, "config",
           "--optimizer-state int8 with --zero {} is not supported yet: the 256-value quantization blocks would "
           "straddle the ZeRO shards' boundaries; use --zero 0 (or --optimizer-state f32)",
           c.zero);
  DT_CHECK(c.offload.empty() || c.optimizer == "adamw", "config",
           "--offload streams AdamW's state; --optimizer {} is not supported (use --optimizer adamw)", c.optimizer);
  DT_CHECK(c.precision == "f32" || c.precision == "bf16", "config", "--precision '{}': expected f32 or bf16",
           c.precision);
  DT_CHECK(c.lr_schedule == "constant" || c.lr_schedule == "cosine", "config",
           "--lr-schedule '{}': expected constant or cosine", c.lr_schedule);
  DT_CHECK(c.batch_size > 0, "config", "--batch-size must be positive, got {}", c.batch_size);
  DT_CHECK(c.steps >= 0 && c.epochs >= 0, "config", "--steps {} and --epochs {} must be non-negative", c.steps,
           c.epochs);
  DT_CHECK(c.epochs <= kMaxEpochs, "config", "--epochs {} is more than {}", c.epochs, kMaxEpochs);
  DT_CHECK(c.lr >= 0.0f, "config", "--lr must be non-negative, got {}", c.lr);
  DT_CHECK(c.min_lr >= 0.0f, "config", "--min-lr must be non-negative, got {}", c.min_lr);
  DT_CHECK(c.momentum >= 0.0f && c.momentum < 1.0f, "config", "--momentum {} not in [0, 1)", c.momentum);
  DT_CHECK(c.weight_decay >= 0.0f, "config", "--weight-decay must be non-negative, got {}", c.weight_decay);
  DT_CHECK(c.beta1 >= 0.0f && c.beta1 < 1.0f, "config", "--beta1 {} not in [0, 1)", c.beta1);
  DT_CHECK(c.beta2 >= 0.0f && c.beta2 < 1.0f, "config", "--beta2 {} not in [0, 1)", c.beta2);
  DT_CHECK(c.eps > 0.0f, "config", "--eps must be positive, got {}", c.eps);
  DT_CHECK(c.warmup >= 0, "config", "--warmup must be non-negative, got {}", c.warmup);
  DT_CHECK(c.clip_grad >= 0.0f, "config", "--clip-grad must be non-negative (0 = off), got {}", c.clip_grad);
  DT_CHECK(c.eval_batches >= 0, "config", "--eval-batches must be non-negative (0 = the whole split), got {}",
           c.eval_batches);
  DT_CHECK(c.min_workers >= 0, "config", "--min-workers must be non-negative (0 = never shrink), got {}",
           c.min_workers);
  DT_CHECK(c.threads >= 1 && c.threads <= 256, "config", "--threads {} out of range [1, 256]", c.threads);
  DT_CHECK(c.log_every >= 1, "config", "--log-every must be at least 1, got {}", c.log_every);
  DT_CHECK(c.dropout >= 0.0f && c.dropout < 1.0f, "config", "--dropout {} not in [0, 1)", c.dropout);
  DT_CHECK(c.val_fraction > 0.0 && c.val_fraction < 1.0, "config", "--val-fraction {} not in (0, 1)", c.val_fraction);
  DT_CHECK(c.dp >= 1 && c.dp <= 256, "config", "--dp {} out of range [1, 256]", c.dp);
  DT_CHECK(c.accumulate >= 1, "config", "--accumulate must be at least 1, got {}", c.accumulate);
  DT_CHECK(c.zero >= 0 && c.zero <= 3, "config", "--zero {}: expected 0, 1, 2 or 3", c.zero);
  // What ZeRO 3 does not compose with yet: refused by name, never run silently wrong.
  DT_CHECK(c.zero != 3 || c.compress == "none", "config",
           "--zero 3 with --compress {} is not supported yet (the compressed reduce-scatter keeps whole parameter "
           "buckets); use --zero 2, or drop --compress",
           c.compress);
  DT_CHECK(c.zero != 3 || !c.deterministic, "config",
           "--zero 3 with --deterministic is not supported yet (the exact sums keep whole parameter buckets); use "
           "--zero 2, or drop --deterministic");
  DT_CHECK(parallel::parse_compression(c.compress).powersgd_rank == 0 || c.zero == 0, "config",
           "--compress {} exchanges whole low-rank gradients: it needs --zero 0", c.compress);
  if (c.deterministic) {
    DT_CHECK(c.tp == 1, "config",
             "--deterministic with --tp {}: tensor parallelism splits the matrix products themselves, so their sums "
             "depend on the layout; drop --tp or --deterministic",
             c.tp);
    DT_CHECK(c.compress == "none", "config",
             "--deterministic with --compress {}: lossy compression depends on the layout (what each rank's "
             "encoding loses); drop --compress or --deterministic",
             c.compress);
    DT_CHECK(c.clip_grad == 0.0f, "config",
             "--deterministic with --clip-grad {}: the global norm is a float sum over ranks, stages or ZeRO pieces "
             "whose order depends on the layout; drop --clip-grad or --deterministic",
             c.clip_grad);
    DT_CHECK(c.pp == 1 || c.dropout == 0.0f, "config",
             "--deterministic with --pp {} and --dropout {}: the stages draw their masks in schedule order, not per "
             "micro-batch; use --dropout 0 or no --pp",
             c.pp, c.dropout);
  }
  DT_CHECK(c.audit >= 0, "config", "--audit must be non-negative (0 = off), got {}", c.audit);
  DT_CHECK(c.audit == 0 || c.deterministic, "config",
           "--audit {} compares recomputed gradients bit for bit: it needs --deterministic", c.audit);
  DT_CHECK(c.audit == 0 || (c.dp >= 2 && c.pp == 1), "config",
           "--audit {} recomputes another data-parallel rank's micro-batch: it needs --dp 2 or more (and no --pp)",
           c.audit);
  DT_CHECK(c.bucket_mb > 0.0 && c.bucket_mb <= kMaxBucketMb, "config", "--bucket-mb {} not in (0, {}]", c.bucket_mb,
           kMaxBucketMb);
  // Each factor bounded first: their product in int wrapped around (65536 x 65536 = 0 passed).
  const int64_t world = int64_t{c.dp} * std::clamp(c.pp, 0, 257) * std::clamp(c.tp, 0, 257);
  DT_CHECK(c.pp >= 1 && c.pp <= 256 && c.tp >= 1 && c.tp <= 256 && world <= 256, "config",
           "--dp {} x --pp {} x --tp {}: each must be at least 1 and the product at most 256 processes", c.dp, c.pp,
           c.tp);
  DT_CHECK(c.micro_batches >= 1, "config", "--micro-batches must be at least 1, got {}", c.micro_batches);
  DT_CHECK(c.micro_batches == 1 || c.pp > 1, "config",
           "--micro-batches {} needs pipeline stages (--pp 2 or more); without them use --accumulate", c.micro_batches);
  DT_CHECK(c.schedule == "gpipe" || c.schedule == "1f1b", "config", "--schedule '{}': expected gpipe or 1f1b",
           c.schedule);
  DT_CHECK(c.memory_limit >= 0, "config", "--memory-limit must be non-negative, got {}", c.memory_limit);
  int64_t per_step = 0;
  const bool huge = __builtin_mul_overflow(int64_t{c.dp}, c.accumulate, &per_step) ||
                    __builtin_mul_overflow(per_step, c.micro_batches, &per_step);
  DT_CHECK(!huge && c.batch_size % per_step == 0, "config",
           "--batch-size {} is not divisible by --dp {} x --accumulate {} x --micro-batches {} = {}: every rank and "
           "micro-batch must get the same number of samples",
           c.batch_size, c.dp, c.accumulate, c.micro_batches,
           huge ? std::string("more than 2^63") : std::to_string(per_step));
  const int64_t blocks = model_blocks(c);
  DT_CHECK(c.pp <= blocks, "config", "--pp {} stages but the {} model has only {} blocks to cut between", c.pp, c.model,
           blocks);
  if (c.tp > 1) {
    DT_CHECK(gpt, "config", "--tp {}: tensor parallelism splits the GPT's attention and MLP; --model {} has none", c.tp,
             c.model);
    DT_CHECK(c.heads % c.tp == 0, "config", "--heads {} is not divisible by --tp {}: each rank takes whole heads",
             c.heads, c.tp);
    DT_CHECK(c.width % c.tp == 0, "config", "--width {} is not divisible by --tp {}", c.width, c.tp);
  }
  DT_CHECK(c.checkpoint_every >= 0 && c.keep >= 1 && c.max_restarts >= 0, "config",
           "--checkpoint-every {}, --keep {}, --max-restarts {}: expected >= 0, >= 1, >= 0", c.checkpoint_every, c.keep,
           c.max_restarts);
  DT_CHECK(c.checkpoint_every == 0 || !c.checkpoint_dir.empty(), "config",
           "--checkpoint-every {} needs --checkpoint-dir", c.checkpoint_every);
  DT_CHECK(c.backend == "auto" || c.backend == "shm" || c.backend == "tcp" || c.backend == "mpi", "config",
           "--backend '{}': expected auto, shm, tcp or mpi", c.backend);
  DT_CHECK(c.backend != "mpi" || comm::mpi_built(), "config",
           "--backend mpi: dtrain was not built with MPI (scripts/install-deps installs Open MPI; then rebuild)");
  DT_CHECK(c.backend != "mpi" || (c.max_restarts == 0 && c.min_workers == 0), "config",
           "--backend mpi: restarts and elastic worlds need dtrain's launcher (mpirun starts the ranks once); use the "
           "default backend with --max-restarts / --min-workers");
  // Both become milliseconds: a positive timeout must be at least one, and neither may overflow.
  DT_CHECK(c.timeout >= 0.001 && c.timeout <= kMaxSeconds, "config", "--timeout {} not in [0.001, {}] (seconds)",
           c.timeout, kMaxSeconds);
  DT_CHECK(c.heartbeat_timeout == 0.0 || (c.heartbeat_timeout >= 0.001 && c.heartbeat_timeout <= kMaxSeconds), "config",
           "--heartbeat-timeout {}: expected 0 (off) or [0.001, {}] (seconds)", c.heartbeat_timeout, kMaxSeconds);
  DT_CHECK(c.max_restarts == 0 || !c.checkpoint_dir.empty(), "config",
           "--max-restarts {} needs --checkpoint-dir (a restart resumes from the last checkpoint)", c.max_restarts);
  DT_CHECK(c.zero == 0 || c.dp > 1, "config", "--zero {} shards over data-parallel ranks: it needs --dp 2 or more",
           c.zero);
  if (gpt) {
    DT_CHECK(c.layers > 0 && c.width > 0 && c.seq_len > 0 && c.heads > 0, "config",
             "--layers {}, --width {}, --seq-len {}, --heads {} must be positive", c.layers, c.width, c.seq_len,
             c.heads);
    DT_CHECK(c.layers <= kMaxDim && c.width <= kMaxDim && c.seq_len <= kMaxDim && c.heads <= kMaxDim, "config",
             "--layers {}, --width {}, --seq-len {}, --heads {}: each must be at most {}", c.layers, c.width, c.seq_len,
             c.heads, kMaxDim);
    DT_CHECK(c.width % c.heads == 0, "config", "--width {} is not divisible by --heads {}", c.width, c.heads);
  } else {
    for (int64_t h : c.hidden) {
      DT_CHECK(h > 0 && h <= kMaxDim, "config", "--hidden width {} not in [1, {}]", h, kMaxDim);
    }
  }
}

}  // namespace dtrain::train
