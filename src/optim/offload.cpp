#include "dtrain/optim/offload.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "dtrain/core/error.h"

namespace dtrain::optim {

namespace {

// One mapped file (already unlinked: nothing is left behind, even by a killed process);
// unmapped and closed with the last tensor that borrows it.
struct Mapping {
  std::string path;
  void* data = MAP_FAILED;
  size_t bytes = 0;
  int fd = -1;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (data != MAP_FAILED) ::munmap(data, bytes);
    if (fd >= 0) ::close(fd);
  }
};

class FileStorage : public StateStorage {
 public:
  explicit FileStorage(std::string dir) : dir_(std::move(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    DT_CHECK(!ec && std::filesystem::is_directory(dir_), "optim", "--offload {}: cannot create the directory ({})",
             dir_, ec ? ec.message() : "not a directory");
  }

  Tensor allocate(const std::string& name, const Shape& shape, DType dtype) override {
    auto m = std::make_shared<Mapping>();
    m->path = dir_ + "/" + name + ".state";
    m->bytes = std::max<size_t>(static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype), 1);
    m->fd = ::open(m->path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    DT_CHECK(m->fd >= 0, "optim", "--offload: cannot create {}: {}", m->path, std::strerror(errno));
    ::unlink(m->path.c_str());  // the open descriptor and the mapping keep it
    // A sparse file of zeros: blocks are allocated as the step writes them.
    DT_CHECK(::ftruncate(m->fd, static_cast<off_t>(m->bytes)) == 0, "optim",
             "--offload: cannot size {} to {} bytes: {}", m->path, m->bytes, std::strerror(errno));
    m->data = ::mmap(nullptr, m->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, m->fd, 0);
    DT_CHECK(m->data != MAP_FAILED, "optim", "--offload: cannot map {} ({} bytes): {}", m->path, m->bytes,
             std::strerror(errno));
    void* data = m->data;
    return Tensor::borrow(data, shape, std::move(m), dtype);
  }

  void release(void* data, size_t bytes) override {
    // Whole pages inside the range only: a page shared with the next chunk stays.
    const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const auto begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
    const auto end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
    if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }

 private:
  std::string dir_;
};

}  // namespace

std::shared_ptr<StateStorage> offload_storage(const std::string& dir) { return std::make_shared<FileStorage>(dir); }

}  // namespace dtrain::optim
