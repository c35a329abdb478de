// Logging through spdlog to stderr; level from DTRAIN_LOG_LEVEL (trace..critical, off).
#pragma once

#include <spdlog/spdlog.h>

#include <memory>

namespace dtrain {
std::shared_ptr<spdlog::logger> logger();
}  // namespace dtrain

#define DT_LOG_INFO(...) ::dtrain::logger()->info(__VA_ARGS__)
#define DT_LOG_WARN(...) ::dtrain::logger()->warn(__VA_ARGS__)
#define DT_LOG_ERROR(...) ::dtrain::logger()->error(__VA_ARGS__)
#define DT_LOG_DEBUG(...) ::dtrain::logger()->debug(__VA_ARGS__)
