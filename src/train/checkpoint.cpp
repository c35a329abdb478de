#include "dtrain/train/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "dtrain/core/error.h"
#include "dtrain/core/log.h"
#include "dtrain/train/model_io.h"

namespace dtrain::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "dtrain-checkpoint";
constexpr int kVersion = 2;  // 2: optimizer state per parameter name (any data-parallel layout)
constexpr size_t kHex = 64;  // SHA-256 as hex
constexpr const char* kOptimPrefix = "optimizer/";

std::string step_dir(const std::string& dir, int64_t step) { return fmt::format("{}/step-{:08d}", dir, step); }
std::string rank_file(int rank) { return fmt::format("rank-{}.dtm", rank); }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) return {};
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

std::vector<int64_t> checkpoint_steps(const std::string& dir) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() != 13 || name.rfind("step-", 0) != 0) continue;
    if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    steps.push_back(std::stoll(name.substr(5)));
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

std::string parse_manifest(const std::string& text, int64_t step, const nlohmann::json& compatible,
                           std::vector<ManifestFile>* files, nlohmann::json* layout) {
  if (text.empty()) return "no manifest (the write did not complete)";
  const nlohmann::json m = nlohmann::json::parse(text, nullptr, false);
  if (m.is_discarded() || !m.is_object()) return "manifest.json is not valid JSON";
  const auto format = m.find("format");
  const auto version = m.find("version");
  if (format == m.end() || *format != kFormat || version == m.end() || *version != kVersion) {
    return fmt::format("manifest.json is not a version {} {} manifest", kVersion, kFormat);
  }
  const auto s = m.find("step");
  if (s == m.end() || !s->is_number_integer() || s->get<int64_t>() != step) return "manifest.json names another step";
  const auto l = m.find("layout");
  if (l == m.end() || !l->is_object()) return "manifest.json has no layout";
  if (compatible.is_object()) {
    for (const auto& [key, want] : compatible.items()) {
      const auto got = l->find(key);
      if (got == l->end() || *got != want) {
        return fmt::format(
            "written with {} {}, this run has {} (only the data-parallel and pipeline layout may change)", key,
            got == l->end() ? "?" : got->dump(), want.dump());
      }
    }
  }
  const auto fl = m.find("files");
  if (fl == m.end() || !fl->is_array() || fl->empty()) return "manifest.json lists no files";
  std::vector<ManifestFile> out;
  for (const auto& f : *fl) {
    if (!f.is_object() || !f.contains("name") || !f["name"].is_string() || !f.contains("sha256") ||
        !f["sha256"].is_string() || f["sha256"].get<std::string>().size() != kHex) {
      return "manifest.json has a malformed file entry";
    }
    const std::string name = f["name"].get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name.find("..") != std::string::npos) {
      return fmt::format("manifest.json names a file outside the checkpoint: '{}'", name);
    }
    out.push_back({name, f["sha256"].get<std::string>()});
  }
  if (files != nullptr) *files = std::move(out);
  if (layout != nullptr) *layout = *l;
  return {};
}

std::string checkpoint_damage(const std::string& dir, int64_t step, const nlohmann::json& compatible,
                              nlohmann::json* layout) {
  const std::string sd = step_dir(dir, step);
  std::vector<ManifestFile> files;
  const std::string bad = parse_manifest(read_file(sd + "/manifest.json"), step, compatible, &files, layout);
  if (!bad.empty()) return bad;
  for (const ManifestFile& f : files) {
    const std::string bytes = read_file(sd + "/" + f.name);
    if (bytes.empty()) return fmt::format("{} is missing or empty", f.name);
    const std::string sum = sha256_hex(bytes.data(), bytes.size());
    if (sum != f.sha256) {
      return fmt::format("{} does not match its checksum (sha256 {} but the manifest says {})", f.name, sum, f.sha256);
    }
  }
  return {};
}

Checkpointer::Checkpointer(std::string dir, int keep, comm::Group* world, nlohmann::json layout)
    : dir_(std::move(dir)), keep_(keep), world_(world), layout_(std::move(layout)) {
  DT_CHECK(keep_ >= 1, "checkpoint", "--keep {} must be at least 1", keep_);
  std::error_code ec;
  fs::create_directories(dir_, ec);
  DT_CHECK(!ec && fs::is_directory(dir_), "checkpoint", "--checkpoint-dir {}: cannot create: {}", dir_, ec.message());
}

std::string Checkpointer::write_shard(const CheckpointShard& shard) const {
  const int rank = world_ != nullptr ? world_->rank() : 0;
  const std::string sd = step_dir(dir_, shard.step);
  std::error_code ec;
  fs::create_directories(sd, ec);
  DT_CHECK(!ec, "checkpoint", "{}: cannot create: {}", sd, ec.message());
  ModelFile file;
  nlohmann::json meta{{"step", shard.step},
                      {"rank", rank},
                      {"step_count", shard.step_count},
                      {"param_steps", shard.param_steps},
                      {"params", shard.params.size()}};
  file.metadata = meta.dump();
  file.tensors = shard.params;
  for (const auto& [name, t] : shard.optimizer) file.tensors.emplace_back(kOptimPrefix + name, t);
  const std::string bytes = encode_model(file);
  write_file_atomic(sd + "/" + rank_file(rank), bytes, "checkpoint");
  return sha256_hex(bytes.data(), bytes.size());
}

void Checkpointer::commit(int64_t step, const std::string& sum) {
  const int rank = world_ != nullptr ? world_->rank() : 0;
  const int world = world_ != nullptr ? world_->size() : 1;
  // Every rank's file is in place before rank 0 commits.
  std::vector<char> all(kHex * static_cast<size_t>(world));
  if (world_ != nullptr) {
    world_->all_gather(sum.data(), all.data(), kHex, comm::DataType::u8);
  } else {
    std::memcpy(all.data(), sum.data(), kHex);
  }
  if (rank == 0) {
    const std::string sd = step_dir(dir_, step);
    nlohmann::json m{{"format", kFormat},
                     {"version", kVersion},
                     {"step", step},
                     {"layout", layout_},
                     {"files", nlohmann::json::array()}};
    for (int r = 0; r < world; ++r) {
      m["files"].push_back({{"rank", r}, {"name", rank_file(r)}, {"sha256", std::string(all.data() + kHex * r, kHex)}});
    }
    write_file_atomic(sd + "/manifest.json", m.dump(1) + "\n", "checkpoint");
    verified_.insert(step);
    // Keep the newest `keep` complete checkpoints; anything older goes (complete or not). The
    // ones this process committed or loaded were checked already: their files are not read again.
    std::error_code ec;
    int complete = 0;
    for (int64_t s : checkpoint_steps(dir_)) {
      if (s > step) continue;  // a newer one (from a run that went further before it failed)
      if (complete < keep_ && (verified_.count(s) > 0 || checkpoint_damage(dir_, s, layout_).empty())) {
        verified_.insert(s);
        ++complete;
        continue;
      }
      if (complete >= keep_) {
        fs::remove_all(step_dir(dir_, s), ec);
        verified_.erase(s);
      }
    }
  }
  // Nobody moves on (and possibly crashes) before the commit is durable.
  if (world_ != nullptr) world_->barrier();
}

void Checkpointer::save(const CheckpointShard& shard, const std::function<void()>& before_commit) {
  finish();
  const std::string sum = write_shard(shard);
  if (before_commit) before_commit();
  commit(shard.step, sum);
}

void Checkpointer::save_async(CheckpointShard shard, std::function<void()> before_commit) {
  finish();
  // The snapshot: copies, so that training may change the parameters while the thread writes.
  for (auto& [name, t] : shard.params) t = t.clone();
  for (auto& [name, t] : shard.optimizer) t = t.clone();
  pending_ = std::make_unique<Pending>();
  pending_->step = shard.step;
  pending_->before_commit = std::move(before_commit);
  Pending* p = pending_.get();
  p->writer = std::thread([this, p, shard = std::move(shard)] {
    try {
      p->sum = write_shard(shard);
    } catch (...) {
      p->error = std::current_exception();
    }
  });
}

void Checkpointer::finish() {
  if (!pending_) return;
  std::unique_ptr<Pending> p = std::move(pending_);
  p->writer.join();
  if (p->error) std::rethrow_exception(p->error);
  if (p->before_commit) p->before_commit();
  commit(p->step, p->sum);
}

Checkpointer::~Checkpointer() {
  // An unfinished asynchronous write is abandoned uncommitted (the manifest is the commit).
  if (pending_ && pending_->writer.joinable()) pending_->writer.join();
}

std::optional<CheckpointFound> Checkpointer::latest(const nlohmann::json& compatible) {
  const int rank = world_ != nullptr ? world_->rank() : 0;
  int64_t chosen = -1;
  std::string foreign;
  if (rank == 0) {
    for (int64_t s : checkpoint_steps(dir_)) {
      const std::string damage = checkpoint_damage(dir_, s, compatible);
      if (damage.empty()) {
        chosen = s;
        break;
      }
      // A complete checkpoint of another model or optimizer is not damage: starting over next
      // to it (and pruning it later) would lose it, so that is an error.
      if (checkpoint_damage(dir_, s, nlohmann::json::object()).empty()) {
        foreign = fmt::format("{} holds a checkpoint this run cannot continue: {}; use another --checkpoint-dir",
                              step_dir(dir_, s), damage);
        chosen = -2;
        break;
      }
      DT_LOG_WARN("checkpoint {} is not usable: {}; trying an older one", step_dir(dir_, s), damage);
    }
  }
  if (world_ != nullptr) world_->broadcast(&chosen, 1, comm::DataType::i64, 0);
  DT_CHECK(chosen != -2, "checkpoint", "{}",
           rank == 0 ? foreign : "rank 0 found a checkpoint of another run (see its error)");
  if (chosen < 0) return std::nullopt;
  CheckpointFound found;
  found.step = chosen;
  const std::string bad =
      parse_manifest(read_file(step_dir(dir_, chosen) + "/manifest.json"), chosen, compatible, nullptr, &found.layout);
  DT_CHECK(bad.empty(), "checkpoint", "{}: {}", step_dir(dir_, chosen), bad);
  return found;
}

CheckpointShard Checkpointer::read(int64_t step, int rank) const {
  const std::string path = step_dir(dir_, step) + "/" + rank_file(rank);
  const ModelFile file = load_model(path);
  const nlohmann::json meta = nlohmann::json::parse(file.metadata, nullptr, false);
  DT_CHECK(meta.is_object() && meta.value("step", int64_t{-1}) == step && meta.value("rank", -1) == rank &&
               meta.contains("step_count") && meta.contains("param_steps") && meta["param_steps"].is_object() &&
               meta.contains("params"),
           "checkpoint", "{}: metadata does not describe rank {} at step {}", path, rank, step);
  CheckpointShard shard;
  shard.step = step;
  shard.step_count = meta["step_count"].get<int64_t>();
  shard.param_steps = meta["param_steps"].get<std::map<std::string, int64_t>>();
  const size_t n_params = meta["params"].get<size_t>();
  DT_CHECK(n_params <= file.tensors.size(), "checkpoint", "{}: {} parameters listed, {} tensors stored", path, n_params,
           file.tensors.size());
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    const auto& [name, t] = file.tensors[i];
    if (i < n_params) {
      shard.params.emplace_back(name, t);
    } else {
      DT_CHECK(name.rfind(kOptimPrefix, 0) == 0, "checkpoint", "{}: unexpected tensor '{}'", path, name);
      shard.optimizer.emplace_back(name.substr(std::strlen(kOptimPrefix)), t);
    }
  }
  return shard;
}

}  // namespace dtrain::train
