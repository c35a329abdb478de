#include "dtrain/core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <string>

namespace dtrain {

std::shared_ptr<spdlog::logger> logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stderr_color_mt("dtrain");
    l->set_pattern("%^[%Y-%m-%d %H:%M:%S.%e] [%l]%$ %v");
    const char* level = std::getenv("DTRAIN_LOG_LEVEL");
    l->set_level(level != nullptr ? spdlog::level::from_str(level) : spdlog::level::info);
    return l;
  }();
  return instance;
}

}  // namespace dtrain
