#include "dtrain/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "dtrain/checkpoint/model_io.h"
#include "dtrain/core/error.h"
#include "dtrain/core/file.h"
#include "dtrain/core/log.h"

namespace dtrain::checkpoint {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "dtrain-checkpoint";
constexpr int kVersion = 2;  // 2: optimizer state per parameter name (any data-parallel layout)
constexpr size_t kHex = 64;  // SHA-256 as hex
constexpr const char* kOptimPrefix = "optimizer/";

std::string step_dir(const std::string& dir, int64_t step) { return fmt::format("{}/step-{:08d}", dir, step); }
std::string rank_file(int rank) { return fmt::format("rank-{}.dtm", rank); }

constexpr int kMaxRanks = 256;  // finalize()'s bound on dp x pp x tp

// The file's text, or empty when it cannot be read (callers report empty as missing).
std::string read_file(const std::string& path) {
  std::string bytes;
  read_regular_file(path, &bytes);
  return bytes;
}

// The metadata of a shard, from the model-file header (model_io.cpp: magic "DTRAINMD", u32
// version, u32 metadata length, metadata) without decoding its tensors; empty when cut short.
std::string shard_metadata(const std::string& bytes) {
  constexpr size_t kHeader = 16;
  if (bytes.size() < kHeader || bytes.compare(0, 8, "DTRAINMD") != 0) return {};
  uint32_t len = 0;
  std::memcpy(&len, bytes.data() + 12, sizeof(len));
  if (len > bytes.size() - kHeader) return {};
  return bytes.substr(kHeader, len);
}

// What is wrong with a shard's metadata (parsed JSON) for `rank` at `step`; empty when it has
// every field read() uses, of the type it is read as.
std::string shard_metadata_damage(const nlohmann::json& meta, int64_t step, int rank) {
  if (!meta.is_object()) return "its metadata is not a JSON object";
  auto integer = [&](const char* key) { return meta.contains(key) && meta[key].is_number_integer(); };
  if (!integer("step") || meta["step"].get<int64_t>() != step) {
    return fmt::format("its metadata names step {}, not {}", meta.value("step", nlohmann::json()).dump(), step);
  }
  if (!integer("rank") || meta["rank"].get<int64_t>() != rank) {
    return fmt::format("its metadata names rank {}, not {}", meta.value("rank", nlohmann::json()).dump(), rank);
  }
  if (!integer("step_count") || meta["step_count"].get<int64_t>() < 0) {
    return fmt::format("its metadata's step_count is {}, expected a non-negative integer",
                       meta.value("step_count", nlohmann::json()).dump());
  }
  if (!meta.contains("params") || !meta["params"].is_number_unsigned()) {
    return fmt::format("its metadata's params is {}, expected a non-negative integer",
                       meta.value("params", nlohmann::json()).dump());
  }
  const auto ps = meta.find("param_steps");
  if (ps == meta.end() || !ps->is_object()) return "its metadata has no param_steps object";
  for (const auto& [name, n] : ps->items()) {
    if (!n.is_number_integer()) {
      return fmt::format("its metadata's param_steps[\"{}\"] is {}, expected an integer", name, n.dump());
    }
  }
  return {};
}

}  // namespace

std::vector<int64_t> checkpoint_steps(const std::string& dir) {
  std::vector<int64_t> steps;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  // Not there yet: no checkpoints. Anything else (a file, no permission) must not read as
  // "no checkpoints": the run would start over from step 0 and prune the ones it cannot see.
  if (ec == std::errc::no_such_file_or_directory) return steps;
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() != 13 || name.rfind("step-", 0) != 0) continue;
    if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    steps.push_back(std::stoll(name.substr(5)));
  }
  DT_CHECK(!ec, "checkpoint", "checkpoint dir {}: cannot list it: {}", dir, ec.message());
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
  // The layout fields a resume reads as integers (dp x pp x tp ranks wrote the files).
  int64_t ranks = 1;
  for (const char* key : {"dp", "pp", "tp"}) {
    const auto v = l->find(key);
    if (v == l->end() || !v->is_number_integer() || v->get<int64_t>() < 1 || v->get<int64_t>() > kMaxRanks) {
      return fmt::format("manifest.json: layout field \"{}\" is {}, expected an integer from 1 to {}", key,
                         v == l->end() ? "missing" : v->dump(), kMaxRanks);
    }
    ranks *= v->get<int64_t>();
  }
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
  if (static_cast<int64_t>(fl->size()) != ranks) {
    return fmt::format("manifest.json lists {} files, but its layout (dp x pp x tp) has {} ranks", fl->size(), ranks);
  }
  std::vector<ManifestFile> out;
  for (const auto& f : *fl) {
    if (!f.is_object() || !f.contains("name") || !f["name"].is_string() || !f.contains("sha256") ||
        !f["sha256"].is_string() || f["sha256"].get<std::string>().size() != kHex ||
        (f.contains("rank") && (!f["rank"].is_number_integer() || f["rank"].get<int64_t>() != std::ssize(out)))) {
      return fmt::format("manifest.json has a malformed file entry: {}", f.dump());
    }
    const std::string name = f["name"].get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name.find("..") != std::string::npos) {
      return fmt::format("manifest.json names a file outside the checkpoint: '{}'", name);
    }
    // Rank r's file is read by that name (read()), so that is the one the checksum must cover.
    if (name != rank_file(static_cast<int>(out.size()))) {
      return fmt::format("manifest.json lists '{}' where rank {}'s file {} belongs", name, out.size(),
                         rank_file(static_cast<int>(out.size())));
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
  std::string text;
  bool missing = false;
  const std::string unreadable = read_regular_file(sd + "/manifest.json", &text, &missing);
  if (!unreadable.empty() && !missing) return fmt::format("manifest.json: {}", unreadable);
  std::string bad = parse_manifest(text, step, compatible, &files, layout);
  if (!bad.empty()) return bad;
  for (size_t r = 0; r < files.size(); ++r) {
    const ManifestFile& f = files[r];
    std::string bytes;
    const std::string why = read_regular_file(sd + "/" + f.name, &bytes, &missing);
    if (!why.empty() && !missing) return fmt::format("{}: {}", f.name, why);
    if (bytes.empty()) return fmt::format("{} is missing or empty", f.name);
    const std::string sum = sha256_hex(bytes.data(), bytes.size());
    if (sum != f.sha256) {
      return fmt::format("{} does not match its checksum (sha256 {} but the manifest says {})", f.name, sum, f.sha256);
    }
    // Checksummed, so written as it is; its metadata is checked all the same, so that read()
    // of a step found here cannot fail on it.
    const nlohmann::json meta = nlohmann::json::parse(shard_metadata(bytes), nullptr, false);
    const std::string meta_bad = shard_metadata_damage(meta, step, static_cast<int>(r));
    if (!meta_bad.empty()) return fmt::format("{}: {}", f.name, meta_bad);
  }
  return {};
}

Checkpointer::Checkpointer(std::string dir, int keep, comm::Group* world, nlohmann::json layout)
    : dir_(std::move(dir)), keep_(keep), world_(world), layout_(std::move(layout)) {
  DT_CHECK(keep_ >= 1, "checkpoint", "--keep {} must be at least 1", keep_);
  const int rank = world_ != nullptr ? world_->rank() : 0;
  // Every rank checks the directory (each writes its own file there), then they agree, so that
  // one rank's refusal stops all of them here rather than at a collective further on.
  std::exception_ptr error;
  try {
    open_dir(rank == 0);
  } catch (...) {
    error = std::current_exception();
  }
  if (world_ != nullptr) {
    const uint8_t mine = error ? 1 : 0;
    std::vector<uint8_t> all(static_cast<size_t>(world_->size()));
    world_->all_gather(&mine, all.data(), 1, comm::DataType::u8);
    const auto first = std::find(all.begin(), all.end(), uint8_t{1});
    if (!error && first != all.end()) {
      close_lock();
      DT_THROW("checkpoint", "checkpoint dir {}: rank {} cannot use it (see its error)", dir_, first - all.begin());
    }
  }
  if (error) {
    close_lock();
    std::rethrow_exception(error);
  }
}

void Checkpointer::open_dir(bool lead) {
  struct stat st {};
  if (::stat(dir_.c_str(), &st) == 0) {
    DT_CHECK(S_ISDIR(st.st_mode), "checkpoint", "--checkpoint-dir {}: exists and is not a directory", dir_);
  } else {
    std::error_code ec;
    fs::create_directories(dir_, ec);
    DT_CHECK(!ec, "checkpoint", "--checkpoint-dir {}: cannot create it: {}", dir_, ec.message());
  }
  (void)checkpoint_steps(dir_);  // listable, or an error naming the dir and the reason
  // Writable now, not only at the first checkpoint hours later.
  const int err = probe_writable(dir_);
  DT_CHECK(err == 0, "checkpoint", "--checkpoint-dir {}: cannot write in it: {}", dir_, std::strerror(err));
  if (!lead) return;
  // One run per directory: two would prune and overwrite each other's steps. The kernel drops
  // the lock when the process ends however it ends, so a restart after a kill takes it again.
  const std::string path = dir_ + "/.lock";
  lock_fd_ = open_locked_file(path, "checkpoint");
  if (lock_fd_ < 0) {
    std::ifstream in(path);  // the holder's pid (only read: a symlink swapped in since does no harm)
    long pid = 0;
    in >> pid;
    DT_THROW("checkpoint", "checkpoint dir {} is in use by another run ({})", dir_,
             pid > 0 ? fmt::format("pid {}", pid) : std::string("its pid is not written yet"));
  }
  DT_CHECK(::ftruncate(lock_fd_, 0) == 0, "checkpoint", "{}: cannot truncate: {}", path, std::strerror(errno));
  write_all(lock_fd_, fmt::format("{}\n", ::getpid()), path, "checkpoint");
}

void Checkpointer::close_lock() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
  lock_fd_ = -1;
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
  close_lock();
}

std::optional<CheckpointFound> Checkpointer::latest(const nlohmann::json& compatible) {
  const int rank = world_ != nullptr ? world_->rank() : 0;
  int64_t chosen = -1;
  std::string foreign;
  if (rank == 0) {
    std::vector<int64_t> steps;
    try {
      steps = checkpoint_steps(dir_);
    } catch (const Error& e) {
      foreign = e.message();  // every rank must hear of it, not wait in the broadcast below
      chosen = -2;
    }
    for (int64_t s : steps) {
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
           rank == 0 ? foreign : "rank 0 cannot resume from the checkpoint dir (see its error)");
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
  const std::string bad = shard_metadata_damage(meta, step, rank);
  DT_CHECK(bad.empty(), "checkpoint", "{}: {}", path, bad);
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

}  // namespace dtrain::checkpoint
