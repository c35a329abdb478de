// FileStore: one file per key in a directory, for ranks that share a file system.
//
// Key k lives in "k.<percent-encoded k>" (bytes outside [A-Za-z0-9_-] become %XX), or in
// "h.<sha256 hex of k>" when that name would be too long for a file name. Values are written
// to a dot-file and renamed into place, so a reader sees the old value or the new one, never a
// torn one. Writers (set, add, compare_set) of key k hold flock on ".lock.<file name of k>" so
// that add and compare_set are atomic across threads and processes (each call opens its own
// descriptor, and flock locks are per open file). The lock is per key: a process stopped or
// hung while it writes one key (a SIGSTOP, a debugger) holds up the writers of that key only,
// not every rank's heartbeat. Threads of one process first queue on a mutex per lock file,
// shared by all handles, so only processes contend on the (polled) flock. get and wait poll
// with a backoff from 1 ms to 50 ms.
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "../tcp/net.h"
#include "auth.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm {

namespace {

constexpr Duration kPollFirst{1};
constexpr Duration kPollMax{50};
// Lock holders only rename a small file; a holder stuck this long (a stopped process, a dead
// NFS server) is reported instead of waited for forever.
constexpr Duration kLockTimeout{60'000};
constexpr size_t kMaxFileName = 200;

std::string sha256_hex(const std::string& data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  DT_CHECK(EVP_Digest(data.data(), data.size(), digest, &len, EVP_sha256(), nullptr) == 1, "comm", "SHA-256 failed");
  return auth::to_hex(digest, len);
}

std::string file_name(const std::string& key) {
  std::string name = "k.";
  for (const char ch : key) {
    const auto c = static_cast<unsigned char>(ch);
    const bool plain =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
    if (plain) {
      name.push_back(ch);
    } else {
      name += fmt::format("%{:02X}", c);
    }
    if (name.size() > kMaxFileName) return "h." + sha256_hex(key);
  }
  return name;
}

// One mutex per lock file for every handle in this process; `canonical_path` names the file
// whatever path the handle was opened with. Entries of released locks are dropped as they go.
std::shared_ptr<std::timed_mutex> process_lock_for(const std::string& canonical_path) {
  static std::mutex registry_mu;
  static std::map<std::string, std::weak_ptr<std::timed_mutex>> registry;
  std::lock_guard<std::mutex> lock(registry_mu);
  for (auto it = registry.begin(); it != registry.end();) it = it->second.expired() ? registry.erase(it) : ++it;
  auto& slot = registry[canonical_path];
  auto mu = slot.lock();
  if (!mu) {
    mu = std::make_shared<std::timed_mutex>();
    slot = mu;
  }
  return mu;
}

std::string canonical_dir(const std::string& dir) {
  std::error_code ec;
  const std::string canonical = std::filesystem::weakly_canonical(dir, ec).string();
  return ec ? dir : canonical;
}

std::string join_keys(const std::vector<std::string>& keys) {
  std::vector<std::string> shown;
  shown.reserve(keys.size());
  for (const auto& k : keys) shown.push_back(net::printable(k));
  return fmt::format("{}", fmt::join(shown, ", "));
}

class FileStore : public Store {
 public:
  explicit FileStore(std::string dir) : dir_(std::move(dir)), canonical_dir_(canonical_dir(dir_)) {}

  void set(const std::string& key, const std::string& value) override {
    Lock lock(*this, "store.set", key);
    write_atomic("store.set", key, value);
  }

  std::string get(const std::string& key, Duration timeout) override {
    const Deadline deadline = deadline_after(timeout);
    Duration delay = kPollFirst;
    for (;;) {
      if (auto v = read("store.get", key)) return std::move(*v);
      const Deadline now = Clock::now();
      if (now >= deadline) throw_timeout("store.get", timeout, {key});
      std::this_thread::sleep_for(std::min<Clock::duration>(delay, deadline - now));
      delay = std::min(delay * 2, kPollMax);
    }
  }

  std::optional<std::string> try_get(const std::string& key) override { return read("store.try_get", key); }

  int64_t add(const std::string& key, int64_t delta) override {
    Lock lock(*this, "store.add", key);
    int64_t current = 0;
    if (auto v = read("store.add", key)) {
      const char* end = v->data() + v->size();
      const auto [ptr, ec] = std::from_chars(v->data(), end, current);
      if (v->empty() || ec != std::errc() || ptr != end) {
        fail("store.add",
             fmt::format("the value of key '{}' is not an integer: '{}'", net::printable(key), net::printable(*v)));
      }
    }
    int64_t result = 0;
    if (__builtin_add_overflow(current, delta, &result)) {
      fail("store.add", fmt::format("{} + {} overflows int64 (key '{}')", current, delta, net::printable(key)));
    }
    write_atomic("store.add", key, std::to_string(result));
    return result;
  }

  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    Lock lock(*this, "store.compare_set", key);
    std::string current = read("store.compare_set", key).value_or("");
    if (current != expected) return current;
    write_atomic("store.compare_set", key, desired);
    return desired;
  }

  void wait(const std::vector<std::string>& keys, Duration timeout) override {
    const Deadline deadline = deadline_after(timeout);
    Duration delay = kPollFirst;
    for (;;) {
      std::vector<std::string> missing;
      for (const auto& k : keys) {
        if (!exists(k)) missing.push_back(k);
      }
      if (missing.empty()) return;
      const Deadline now = Clock::now();
      if (now >= deadline) throw_timeout("store.wait", timeout, missing);
      std::this_thread::sleep_for(std::min<Clock::duration>(delay, deadline - now));
      delay = std::min(delay * 2, kPollMax);
    }
  }

 private:
  // The key's mutex in this process, then flock(LOCK_EX) on "<dir>/.lock.<file name of key>",
  // both with a timeout.
  class Lock {
   public:
    Lock(const FileStore& store, const char* op, const std::string& key)
        : Lock(store, op, LockFile{".lock." + file_name(key)}) {}

   private:
    struct LockFile {
      std::string name;
    };
    Lock(const FileStore& store, const char* op, const LockFile& file)
        : process_lock_(process_lock_for(store.canonical_dir_ + "/" + file.name)),
          thread_lock_(*process_lock_, std::defer_lock) {
      const std::string path = store.dir_ + "/" + file.name;
      const Deadline deadline = deadline_after(kLockTimeout);
      if (!thread_lock_.try_lock_until(deadline)) {
        store.fail(op,
                   fmt::format("could not lock {} within {} ms: another thread holds it", path, kLockTimeout.count()));
      }
      fd_.reset(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
      if (!fd_) store.fail_errno(op, "open", path);
      auto delay = std::chrono::microseconds(20);
      for (int attempt = 0;; ++attempt) {
        if (::flock(fd_.get(), LOCK_EX | LOCK_NB) == 0) return;
        if (errno == EINTR) continue;
        if (errno != EWOULDBLOCK) store.fail_errno(op, "flock", path);
        if (Clock::now() >= deadline) {
          store.fail(
              op, fmt::format("could not lock {} within {} ms: another process holds it", path, kLockTimeout.count()));
        }
        if (attempt < 8) {
          std::this_thread::yield();
        } else {
          std::this_thread::sleep_for(delay);
          delay = std::min(delay * 2, std::chrono::microseconds(2000));
        }
      }
    }
    // Closing the descriptor releases the flock (members are destroyed in reverse order).

    std::shared_ptr<std::timed_mutex> process_lock_;
    std::unique_lock<std::timed_mutex> thread_lock_;
    net::Fd fd_;
  };

  std::string path_of(const std::string& key) const { return dir_ + "/" + file_name(key); }

  bool exists(const std::string& key) const {
    struct stat st {};
    const std::string path = path_of(key);
    if (::stat(path.c_str(), &st) == 0) return true;
    if (errno != ENOENT) fail_errno("store.wait", "stat", path);
    return false;
  }

  std::optional<std::string> read(const char* op, const std::string& key) const {
    const std::string path = path_of(key);
    net::Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) {
      if (errno == ENOENT) return std::nullopt;
      fail_errno(op, "open", path);
    }
    std::string value;
    char buf[64 << 10];
    for (;;) {
      const ssize_t n = ::read(fd.get(), buf, sizeof(buf));
      if (n > 0) {
        value.append(buf, static_cast<size_t>(n));
      } else if (n == 0) {
        return value;
      } else if (errno != EINTR) {
        fail_errno(op, "read", path);
      }
    }
  }

  void write_atomic(const char* op, const std::string& key, const std::string& value) const {
    static std::atomic<uint64_t> counter{0};
    uint8_t nonce[8];
    auth::random_bytes(nonce, sizeof(nonce));
    const std::string tmp =
        fmt::format("{}/.tmp.{}.{}.{}", dir_, ::getpid(), counter.fetch_add(1), auth::to_hex(nonce, sizeof(nonce)));
    const std::string path = path_of(key);
    {
      net::Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
      if (!fd) fail_errno(op, "open", tmp);
      const char* p = value.data();
      size_t left = value.size();
      while (left > 0) {
        const ssize_t n = ::write(fd.get(), p, left);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
          const int err = errno;
          ::unlink(tmp.c_str());
          errno = err;
          fail_errno(op, "write", tmp);
        }
        p += n;
        left -= static_cast<size_t>(n);
      }
      if (::close(fd.release()) != 0) {  // NFS reports write-back errors at close
        const int err = errno;
        ::unlink(tmp.c_str());
        errno = err;
        fail_errno(op, "close", tmp);
      }
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      errno = err;
      fail_errno(op, "rename", path);
    }
  }

  [[noreturn]] void throw_timeout(const char* op, Duration timeout, const std::vector<std::string>& keys) const {
    fail(op, fmt::format("timed out after {} ms waiting for keys: {}", timeout.count(), join_keys(keys)));
  }

  [[noreturn]] void fail(const char* op, const std::string& what) const {
    throw CommError(op, 0, {}, fmt::format("file store {}: {}", dir_, what), __FILE__, __LINE__);
  }

  [[noreturn]] void fail_errno(const char* op, const char* syscall, const std::string& path) const {
    fail(op, fmt::format("{} {}: {}", syscall, path, std::strerror(errno)));
  }

  std::string dir_;
  std::string canonical_dir_;
};

}  // namespace

std::shared_ptr<Store> make_file_store(const std::string& directory) {
  if (directory.empty()) throw CommError("store.open", 0, {}, "file store: empty directory name", __FILE__, __LINE__);
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec || !std::filesystem::is_directory(directory, ec)) {
    throw CommError(
        "store.open", 0, {},
        fmt::format("file store {}: cannot create the directory: {}", directory, ec ? ec.message() : "not a directory"),
        __FILE__, __LINE__);
  }
  return std::make_shared<FileStore>(directory);
}

}  // namespace dtrain::comm
