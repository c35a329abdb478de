// Errors: one exception type carrying a component tag, raised through DT_CHECK-style
// macros that capture file and line and format the offending values.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace dtrain {

/// Every error dtrain raises at an API boundary. what() reads
/// "[component] message (file:line)" so a user sees where and what.
class Error : public std::runtime_error {
 public:
  Error(std::string component, const std::string& message, const char* file, int line);
  const std::string& component() const { return component_; }
  const std::string& message() const { return message_; }

 private:
  std::string component_;
  std::string message_;
};

namespace detail {
[[noreturn]] void throw_error(const char* component, const char* file, int line, const std::string& message);
}  // namespace detail

}  // namespace dtrain

/// Throws dtrain::Error("[comp] <formatted message>") when cond is false.
#define DT_CHECK(cond, comp, ...)                                                          \
  do {                                                                                     \
    if (!(cond)) [[unlikely]] {                                                            \
      ::dtrain::detail::throw_error(comp, __FILE__, __LINE__, ::fmt::format(__VA_ARGS__)); \
    }                                                                                      \
  } while (0)

#define DT_THROW(comp, ...) ::dtrain::detail::throw_error(comp, __FILE__, __LINE__, ::fmt::format(__VA_ARGS__))
