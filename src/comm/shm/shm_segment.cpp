// The shm transport's segment: creation, mapping, futexes and process liveness.
#include "shm_segment.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <utility>

#include "dtrain/core/error.h"

namespace dtrain::comm::shm {

namespace {

constexpr size_t kPage = 4096;

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

std::string errno_text(int err) { return fmt::format("{} (errno {})", std::strerror(err), err); }

// Closes the descriptor on every path; the mapping outlives it.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

char* map_fd(int fd, size_t bytes, const std::string& name) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    DT_THROW("comm", "shm: mmap of {} ({} bytes) failed: {}", name, bytes, errno_text(errno));
  }
  return static_cast<char*>(p);
}

// Creates `name` exclusively, sized and reserved, and maps it; unlinks it again on failure.
// `what` says what the bytes are for in the error.
char* create_mapped(const std::string& name, size_t bytes, const std::string& what) {
  Fd fd{::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)};
  if (fd.fd < 0) DT_THROW("comm", "shm: shm_open({}, O_CREAT|O_EXCL) failed: {}", name, errno_text(errno));
  try {
    if (::ftruncate(fd.fd, static_cast<off_t>(bytes)) != 0) {
      DT_THROW("comm", "shm: ftruncate({}, {} bytes) failed: {}", name, bytes, errno_text(errno));
    }
    // Reserve the pages now: on a full /dev/shm a write to a sparse page would be a SIGBUS.
    if (int err = ::posix_fallocate(fd.fd, 0, static_cast<off_t>(bytes)); err != 0) {
      DT_THROW("comm", "shm: cannot reserve {} bytes for {} ({}): {}; is /dev/shm full?", bytes, name, what,
               errno_text(err));
    }
    return map_fd(fd.fd, bytes, name);
  } catch (...) {
    unlink_segment(name);
    throw;
  }
}

}  // namespace

SegmentLayout::SegmentLayout(int world_size, size_t bytes_per_ring, size_t bytes_per_stage)
    : size(world_size),
      ring_bytes(bytes_per_ring),
      stage_bytes(bytes_per_stage),
      pairs(static_cast<size_t>(world_size) * static_cast<size_t>(world_size - 1)) {
  ranks_offset = round_up(sizeof(SegmentHeader), kLine);
  rings_offset = round_up(ranks_offset + static_cast<size_t>(size) * sizeof(RankSlot), kLine);
  data_offset = round_up(rings_offset + pairs * sizeof(RingCtl), kPage);
  stage_offset = data_offset + pairs * ring_bytes;
  total_bytes = stage_offset + static_cast<size_t>(size) * 2 * stage_bytes;
}

Segment Segment::create(const std::string& name, int size, size_t ring_bytes, size_t stage_bytes) {
  SegmentLayout layout(size, ring_bytes, stage_bytes);
  char* base = create_mapped(
      name, layout.total_bytes,
      fmt::format("{} ranks, {} byte rings; DTRAIN_SHM_RING_BYTES and DTRAIN_SHM_STAGE_BYTES set smaller rings and "
                  "staging slots",
                  size, ring_bytes));
  try {
    Segment seg(base, layout);
    // The file is zero-filled; construct the control area's objects in place.
    auto* h = new (base) SegmentHeader{};
    for (int r = 0; r < size; ++r) new (&seg.rank(r)) RankSlot{};
    for (int s = 0; s < size; ++s) {
      for (int d = 0; d < size; ++d) {
        if (s != d) new (&seg.ring_ctl(s, d)) RingCtl{};
      }
    }
    h->version = kVersion;
    h->size = static_cast<uint32_t>(size);
    h->ring_bytes = ring_bytes;
    h->stage_bytes = stage_bytes;
    h->total_bytes = layout.total_bytes;
    h->abort_state.store(kNotAborted, std::memory_order_relaxed);
    std::atomic_ref<uint64_t>(h->magic).store(kMagic, std::memory_order_release);
    return seg;
  } catch (...) {
    unlink_segment(name);  // `seg` unmapped it
    throw;
  }
}

Segment Segment::open(const std::string& name, int size) {
  Fd fd{::shm_open(name.c_str(), O_RDWR, 0)};
  if (fd.fd < 0) {
    const int err = errno;
    DT_THROW("comm", "shm: shm_open({}) failed: {}{}", name, errno_text(err),
             err == ENOENT ? "; rank 0 already unlinked it (it gave up, or the store prefix was reused)" : "");
  }
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) DT_THROW("comm", "shm: fstat({}) failed: {}", name, errno_text(errno));
  const auto file_bytes = static_cast<size_t>(st.st_size);
  if (file_bytes < sizeof(SegmentHeader)) {
    DT_THROW("comm", "shm: segment {} has {} bytes, less than its {} byte header", name, file_bytes,
             sizeof(SegmentHeader));
  }
  char* base = map_fd(fd.fd, file_bytes, name);
  auto* h = reinterpret_cast<SegmentHeader*>(base);
  const uint64_t magic = std::atomic_ref<uint64_t>(h->magic).load(std::memory_order_acquire);
  std::string problem;
  if (magic != kMagic) {
    problem = fmt::format("bad magic {:#x} (expected {:#x})", magic, kMagic);
  } else if (h->version != kVersion) {
    problem = fmt::format("version {} (expected {})", h->version, kVersion);
  } else if (h->size != static_cast<uint32_t>(size)) {
    problem = fmt::format("was created for {} ranks but this rank expects {}", h->size, size);
  } else if (h->ring_bytes < kMinRingBytes || h->ring_bytes > kMaxRingBytes ||
             (h->ring_bytes & (h->ring_bytes - 1)) != 0) {
    problem =
        fmt::format("ring size {} is not a power of two in [{}, {}]", h->ring_bytes, kMinRingBytes, kMaxRingBytes);
  } else if (h->stage_bytes < kMinStageBytes || h->stage_bytes > kMaxStageBytes ||
             (h->stage_bytes & (h->stage_bytes - 1)) != 0) {
    problem = fmt::format("staging size {} is not a power of two in [{}, {}]", h->stage_bytes, kMinStageBytes,
                          kMaxStageBytes);
  } else if (SegmentLayout layout(size, h->ring_bytes, h->stage_bytes);
             layout.total_bytes != file_bytes || h->total_bytes != file_bytes) {
    problem = fmt::format("has {} bytes but its layout needs {}", file_bytes, layout.total_bytes);
  }
  if (!problem.empty()) {
    ::munmap(base, file_bytes);
    DT_THROW("comm", "shm: segment {} {}", name, problem);
  }
  return Segment(base, SegmentLayout(size, h->ring_bytes, h->stage_bytes));
}

Segment::Segment(Segment&& other) noexcept : base_(std::exchange(other.base_, nullptr)), layout_(other.layout_) {}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    if (base_ != nullptr) ::munmap(base_, layout_.total_bytes);
    base_ = std::exchange(other.base_, nullptr);
    layout_ = other.layout_;
  }
  return *this;
}

Segment::~Segment() {
  if (base_ != nullptr) ::munmap(base_, layout_.total_bytes);
}

Mapping Mapping::create(const std::string& name, size_t bytes) {
  return Mapping(create_mapped(name, std::max<size_t>(bytes, 1), "shared memory"), std::max<size_t>(bytes, 1));
}

Mapping Mapping::open(const std::string& name, size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  Fd fd{::shm_open(name.c_str(), O_RDWR, 0)};
  if (fd.fd < 0) DT_THROW("comm", "shm: shm_open({}) failed: {}", name, errno_text(errno));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) DT_THROW("comm", "shm: fstat({}) failed: {}", name, errno_text(errno));
  if (static_cast<size_t>(st.st_size) != bytes) {
    DT_THROW("comm", "shm: shared memory {} has {} bytes but this rank expects {} (ranks asked for different sizes)",
             name, st.st_size, bytes);
  }
  return Mapping(map_fd(fd.fd, bytes, name), bytes);
}

Mapping::Mapping(Mapping&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

Mapping::~Mapping() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
}

void unlink_segment(const std::string& name) noexcept { (void)::shm_unlink(name.c_str()); }

std::string make_segment_name(const std::string& prefix) {
  std::string clean;
  for (char c : prefix) {
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
    clean.push_back(ok ? c : '_');
    if (clean.size() >= 64) break;
  }
  std::random_device rd;
  const uint64_t random = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return fmt::format("/dtrain-{}-{}-{:016x}", clean, ::getpid(), random);
}

namespace {

size_t power_of_two_from_env(const char* var, size_t fallback, size_t lo, size_t hi) {
  const char* text = std::getenv(var);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < lo || v > hi || (v & (v - 1)) != 0) {
    DT_THROW("comm", "{}='{}' must be a power of two between {} and {}", var, text, lo, hi);
  }
  return static_cast<size_t>(v);
}

}  // namespace

size_t ring_bytes_from_env() {
  return power_of_two_from_env("DTRAIN_SHM_RING_BYTES", kDefaultRingBytes, kMinRingBytes, kMaxRingBytes);
}

size_t default_stage_bytes(int size, int cores, size_t shm_free_bytes) {
  if (size <= cores) return kDefaultStageBytes;
  const size_t slots = static_cast<size_t>(size) * 2;
  return shm_free_bytes / 4 >= slots * kOversubscribedStageBytes ? kOversubscribedStageBytes : kDefaultStageBytes;
}

int job_cores() {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  int cores = ::sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  if (const char* all = std::getenv("DTRAIN_JOB_CPUS"); all != nullptr && std::atoi(all) > 0) cores = std::atoi(all);
  return cores;
}

size_t stage_bytes_from_env(int size) {
  // 0: not set (a set value is a power of two of at least kMinStageBytes).
  if (const size_t set = power_of_two_from_env("DTRAIN_SHM_STAGE_BYTES", 0, kMinStageBytes, kMaxStageBytes); set != 0) {
    return set;
  }
  struct statvfs fs {};
  const size_t free_bytes =
      ::statvfs("/dev/shm", &fs) == 0 ? static_cast<size_t>(fs.f_bavail) * static_cast<size_t>(fs.f_frsize) : 0;
  return default_stage_bytes(size, job_cores(), free_bytes);
}

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, Duration timeout) {
  if (timeout.count() <= 0) return;
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000) * 1000000L;
  // EAGAIN (value changed), EINTR and ETIMEDOUT all mean: go and look again.
  (void)::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>& word) {
  word.fetch_add(1, std::memory_order_seq_cst);
  (void)::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

namespace {

// Reads /proc/<pid>/stat: state letter and start time. False if the file cannot be read.
bool read_proc_stat(pid_t pid, char* state, uint64_t* start_time) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[1024];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  // "pid (comm) S ppid ... starttime(22) ..."; comm may hold spaces and parentheses.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr || p[1] != ' ') return false;
  p += 2;
  *state = *p;
  // Field 3 is the state; skip fields 3..21 to reach field 22.
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p, ' ');
    if (p == nullptr) return false;
    ++p;
  }
  *start_time = std::strtoull(p, nullptr, 10);
  return true;
}

}  // namespace

uint64_t process_start_time(pid_t pid) {
  char state = 0;
  uint64_t start = 0;
  return read_proc_stat(pid, &state, &start) ? start : 0;
}

bool process_alive(pid_t pid, uint64_t start_time) {
  if (pid <= 0) return true;
  char state = 0;
  uint64_t start = 0;
  if (read_proc_stat(pid, &state, &start)) {
    if (state == 'Z' || state == 'X' || state == 'x') return false;
    return start_time == 0 || start == start_time;
  }
  // No /proc entry (or no /proc at all): ask the kernel directly.
  return !(::kill(pid, 0) != 0 && errno == ESRCH);
}

const char* gone_reason(const RankSlot& slot) {
  if (slot.departed.load(std::memory_order_acquire) != 0) return "closed its transport";
  const pid_t pid = slot.pid.load(std::memory_order_acquire);
  if (pid != ::getpid() && !process_alive(pid, slot.start_time.load(std::memory_order_relaxed))) return "died";
  return nullptr;
}

}  // namespace dtrain::comm::shm
