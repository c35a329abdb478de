// Job files (job_file.h) and finding them (status.h's find_jobs).
#include "job_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "dtrain/core/file.h"
#include "dtrain/core/log.h"

namespace dtrain::launch {

namespace {

// Creates `dir` (mode 0700) if needed; "" when it is ours and closed to others, else why not.
std::string private_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return std::strerror(errno);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return std::strerror(errno);
  if (!S_ISDIR(st.st_mode)) return "not a directory";
  if (st.st_uid != ::getuid()) return "owned by another user";
  if ((st.st_mode & 077) != 0) return "readable by other users";
  return "";
}

// `dir` (jobs/, private) and its parent (dtrain/: this user's, written by nobody else), made if needed.
std::string make_jobs_dir(const std::string& dir) {
  const std::string jobs_parent = parent_directory(dir);   // .../dtrain
  const std::string base = parent_directory(jobs_parent);  // $XDG_RUNTIME_DIR or ~/.cache
  if (::mkdir(base.c_str(), 0700) != 0 && errno != EEXIST) return base + ": " + std::strerror(errno);
  if (::mkdir(jobs_parent.c_str(), 0700) != 0 && errno != EEXIST) return jobs_parent + ": " + std::strerror(errno);
  struct stat st {};
  if (::lstat(jobs_parent.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid() ||
      (st.st_mode & 022) != 0) {
    return jobs_parent + ": not a directory of this user that only it can write";
  }
  if (std::string why = private_dir(dir); !why.empty()) return dir + ": " + why;
  return "";
}

}  // namespace

std::string jobs_dir() {
  const char* runtime = std::getenv("XDG_RUNTIME_DIR");
  if (runtime != nullptr && *runtime == '/') return std::string(runtime) + "/dtrain/jobs";
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr && *home == '/' ? home : "/tmp") + "/.cache/dtrain/jobs";
}

JobFile::JobFile(const JobInfo& job) {
  const std::string dir = jobs_dir();
  if (const std::string why = make_jobs_dir(dir); !why.empty()) {
    DT_LOG_WARN("dtrain launch: no job file for dtrain status ({})", why);
    return;
  }
  const nlohmann::json j{{"pid", job.pid},       {"addr", job.addr},       {"port", job.port},
                         {"secret", job.secret}, {"command", job.command}, {"started", job.started}};
  const std::string path = dir + "/" + std::to_string(job.pid) + ".json";
  std::string tmpl = dir + "/." + std::to_string(job.pid) + ".XXXXXX";
  const int fd = ::mkostemp(tmpl.data(), O_CLOEXEC);  // mode 0600
  if (fd < 0) {
    DT_LOG_WARN("dtrain launch: no job file for dtrain status ({}: {})", dir, std::strerror(errno));
    return;
  }
  try {
    write_all(fd, j.dump() + "\n", tmpl, "launch");
  } catch (const std::exception& e) {
    ::close(fd);
    ::unlink(tmpl.c_str());
    DT_LOG_WARN("dtrain launch: no job file for dtrain status ({})", e.what());
    return;
  }
  ::close(fd);
  if (::rename(tmpl.c_str(), path.c_str()) != 0) {
    ::unlink(tmpl.c_str());
    return;
  }
  path_ = path;
}

JobFile::~JobFile() {
  if (!path_.empty()) ::unlink(path_.c_str());
}

std::vector<JobInfo> find_jobs() {
  std::vector<JobInfo> out;
  const std::string dir = jobs_dir();
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name[0] != '.' && name.ends_with(".json")) names.push_back(name);
  }
  ::closedir(d);
  for (const std::string& name : names) {
    std::string path = dir;
    path += '/';
    path += name;
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::getuid() || (st.st_mode & 077) != 0) {
      continue;  // not a job file of ours as we write them
    }
    std::string text;
    if (!read_regular_file(path, &text).empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (!j.is_object()) continue;
    JobInfo job;
    try {
      job.pid = j.at("pid").get<int>();
      job.addr = j.at("addr").get<std::string>();
      job.port = j.at("port").get<int>();
      job.secret = j.at("secret").get<std::string>();
      job.command = j.value("command", "");
      job.started = j.value("started", 0.0);
    } catch (const std::exception&) {
      continue;
    }
    job.path = path;
    if (job.pid <= 0 || (::kill(job.pid, 0) != 0 && errno == ESRCH)) {
      ::unlink(path.c_str());  // its launcher is gone (killed before it could remove the file)
      continue;
    }
    out.push_back(std::move(job));
  }
  std::sort(out.begin(), out.end(), [](const JobInfo& a, const JobInfo& b) { return a.started < b.started; });
  return out;
}

}  // namespace dtrain::launch
