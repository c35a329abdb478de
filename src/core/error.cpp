#include "dtrain/core/error.h"

#include <cstring>

namespace dtrain {

namespace {
const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash != nullptr ? slash + 1 : path;
}
}  // namespace

Error::Error(std::string component, const std::string& message, const char* file, int line)
    : std::runtime_error(fmt::format("[{}] {} ({}:{})", component, message, base_name(file), line)),
      component_(std::move(component)),
      message_(message) {}

namespace detail {
void throw_error(const char* component, const char* file, int line, const std::string& message) {
  throw Error(component, message, file, line);
}
}  // namespace detail

}  // namespace dtrain
