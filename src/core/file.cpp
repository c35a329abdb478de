#include "dtrain/core/file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "dtrain/core/error.h"

namespace dtrain {

void write_all(int fd, const std::string& bytes, const std::string& path, const char* component) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    DT_CHECK(n > 0, component, "{}: write failed: {}", path, n < 0 ? std::strerror(errno) : "no progress");
    done += static_cast<size_t>(n);
  }
}

std::string read_regular_file(const std::string& path, std::string* bytes, bool* missing, bool* opened) {
  bytes->clear();
  if (missing != nullptr) *missing = false;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (opened != nullptr) *opened = fd >= 0;
  if (fd < 0) {
    if (missing != nullptr) *missing = errno == ENOENT;
    return std::strerror(errno);
  }
  std::string why;
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    why = std::strerror(errno);
  } else if (S_ISDIR(st.st_mode)) {
    why = "is a directory";
  } else if (!S_ISREG(st.st_mode)) {
    why = "not a regular file";
  } else {
    (void)::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    bytes->resize(static_cast<size_t>(st.st_size) + 1);
    size_t done = 0;
    while (true) {
      if (done == bytes->size()) bytes->resize(done + 65536);
      const ssize_t n = ::read(fd, bytes->data() + done, bytes->size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        why = fmt::format("read failed: {}", std::strerror(errno));
        break;
      }
      if (n == 0) break;
      done += static_cast<size_t>(n);
    }
    bytes->resize(why.empty() ? done : 0);
  }
  ::close(fd);
  return why;
}

int probe_writable(const std::string& dir) {
  std::string probe = (dir == "/" ? "/" : dir + "/") + ".dtrain-probe.XXXXXX";
  const int fd = ::mkostemp(probe.data(), O_CLOEXEC);
  if (fd < 0) return errno;
  ::close(fd);
  ::unlink(probe.c_str());
  return 0;
}

std::string parent_directory(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

void write_file_atomic(const std::string& path, const std::string& bytes, const char* component) {
  DT_CHECK(!path.empty() && path.back() != '/', component, "'{}' is not a file name", path);
  const std::string dir = parent_directory(path);
  const size_t slash = path.rfind('/');
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  // mkstemp: O_CREAT | O_EXCL with a random suffix, so a planted file or symlink is never opened.
  std::string tmp = (dir == "/" ? "/" : dir + "/") + "." + base + ".XXXXXX";
  const int fd = ::mkostemp(tmp.data(), O_CLOEXEC);
  DT_CHECK(fd >= 0, component, "{}: cannot create a file in {}: {}", path, dir, std::strerror(errno));
  try {
    const mode_t mask = ::umask(0);
    ::umask(mask);
    DT_CHECK(::fchmod(fd, 0644 & ~mask) == 0, component, "{}: chmod failed: {}", tmp, std::strerror(errno));
    write_all(fd, bytes, tmp, component);
    DT_CHECK(::fsync(fd) == 0, component, "{}: fsync failed: {}", tmp, std::strerror(errno));
    DT_CHECK(::close(fd) == 0, component, "{}: close failed: {}", tmp, std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    DT_THROW(component, "{}: cannot replace it (rename from {}): {}", path, tmp, std::strerror(err));
  }
  // fsync the directory so the rename itself survives a crash.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void check_output_path(const std::string& path, const char* what, const char* component) {
  DT_CHECK(!path.empty() && path.back() != '/', component, "{} '{}': not a file name", what, path);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    DT_CHECK(!S_ISDIR(st.st_mode), component, "{} {}: is a directory", what, path);
  }
  const std::string dir = parent_directory(path);
  const int err = probe_writable(dir);
  DT_CHECK(err == 0, component, "{} {}: cannot write in {}: {}", what, path, dir, std::strerror(err));
}

int open_output_file(const std::string& path, const char* component, bool append) {
  DT_CHECK(!path.empty(), component, "empty output file name");
  const int flags = O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | (append ? O_APPEND : 0);
  const int fd = ::open(path.c_str(), flags, 0644);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP) DT_THROW(component, "{}: is a symbolic link; refusing to write through it", path);
    DT_THROW(component, "{}: cannot open for writing: {}", path, std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    DT_THROW(component, "{}: not a regular file; refusing to write to it", path);
  }
  // O_NONBLOCK only kept a FIFO from blocking the open; a regular file ignores it, drop it anyway.
  (void)::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  if (!append && ::ftruncate(fd, 0) != 0) {
    const int err = errno;
    ::close(fd);
    DT_THROW(component, "{}: cannot truncate: {}", path, std::strerror(err));
  }
  return fd;
}

int open_locked_file(const std::string& path, const char* component) {
  const int fd = open_output_file(path, component, /*append=*/true);
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return fd;
  const int err = errno;
  ::close(fd);
  if (err == EWOULDBLOCK) return -1;
  DT_THROW(component, "{}: cannot lock: {}", path, std::strerror(err));
}

}  // namespace dtrain
