// Files written safely: created exclusively under an unpredictable name in the target's own
// directory (never through a symlink planted at a predictable name), then renamed over the
// target, so a reader sees the old file or the new one and another user who can write the
// directory cannot redirect the write. Every failure names the path and the system's reason.
#pragma once

#include <string>

namespace dtrain {

/// Writes `bytes` to `path` atomically: a new file `DIR/.NAME.XXXXXX` (O_EXCL | O_NOFOLLOW, mode
/// 0644 less the umask), fsynced, renamed over `path` (a symlink at `path` is replaced, its
/// target untouched), then the directory fsynced. `component` tags the error.
void write_file_atomic(const std::string& path, const std::string& bytes, const char* component = "io");

/// Opens `path` for writing a stream (truncating a regular file that is there) without following
/// a symlink at its last component and refusing anything but a regular file; returns the fd
/// (O_CLOEXEC). Throws naming the path when it cannot.
int open_output_file(const std::string& path, const char* component = "io", bool append = false);

/// Checks at start that `path` can be written later (its directory exists and takes a new
/// file; `path` is not a directory), so a long run does not fail, or lose its output, at the
/// end. `what` names the option in the error ("--save").
void check_output_path(const std::string& path, const char* what, const char* component = "io");

/// Opens `path` as open_output_file does (appending: nothing is truncated) and takes an
/// exclusive flock on it without waiting; -1 when another process holds the lock. The kernel
/// drops the lock when the fd closes or the process ends, however it ends.
int open_locked_file(const std::string& path, const char* component = "io");

/// Writes all of `bytes` to `fd` (retrying short writes and EINTR); throws naming `path`.
void write_all(int fd, const std::string& bytes, const std::string& path, const char* component = "io");

/// Reads a regular file whole into `bytes`: returns "" when it was read, else why not (the
/// system's reason, "is a directory", "not a regular file" or "read failed: ..."). `*missing`:
/// it does not exist; `*opened`: the open succeeded (the reason is then the file's, not the
/// path's). Never throws, never blocks on a FIFO.
std::string read_regular_file(const std::string& path, std::string* bytes, bool* missing = nullptr,
                              bool* opened = nullptr);

/// 0 when a new file can be created in `dir` (an mkstemp probe, removed at once), else errno.
int probe_writable(const std::string& dir);

/// The directory part of `path` ("." for a bare name, "/" for a file at the root).
std::string parent_directory(const std::string& path);

}  // namespace dtrain
