#include "flight_records.h"

#include <dirent.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <regex>

namespace dtrain::launch {

std::vector<FlightRecord> read_flight_records(const std::string& dir) {
  std::vector<std::string> files;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.starts_with("rank-") && name.ends_with(".json")) files.push_back(name);
    }
    ::closedir(d);
  }
  std::sort(files.begin(), files.end(), [](const std::string& a, const std::string& b) {
    return std::strtol(a.c_str() + 5, nullptr, 10) < std::strtol(b.c_str() + 5, nullptr, 10);
  });
  std::vector<FlightRecord> out;
  for (const std::string& name : files) {
    const std::string path = fmt::format("{}/{}", dir, name);
    std::ifstream in(path);
    out.push_back({path, std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>())});
  }
  return out;
}

std::string flight_summary(const std::vector<FlightRecord>& records) {
  std::string out;
  for (const FlightRecord& record : records) {
    const std::string& path = record.path;
    try {
      const nlohmann::json j = nlohmann::json::parse(record.text);
      std::string line;
      for (const auto& g : j.at("groups")) {
        const auto& entries = g.at("entries");
        if (entries.empty()) continue;
        // The oldest operation that did not complete, else the last one.
        const nlohmann::json* pick = &entries.back();
        for (const auto& e : entries) {
          if (e.at("state") != "done") {
            pick = &e;
            break;
          }
        }
        const auto& e = *pick;
        const std::string state = e.at("state");
        const double started = e.at("started_ms_ago").is_number() ? e.at("started_ms_ago").get<double>() : 0.0;
        const double finished = e.at("finished_ms_ago").is_number() ? e.at("finished_ms_ago").get<double>() : 0.0;
        std::string what =
            fmt::format("{} #{} ({} bytes{}) on group '{}' (rank {} of {}, {})", e.at("op").get<std::string>(),
                        e.at("seq").get<uint64_t>(), e.at("bytes").get<uint64_t>(),
                        e.at("peer").get<int>() >= 0 ? fmt::format(", peer/root {}", e.at("peer").get<int>()) : "",
                        g.at("group").get<std::string>(), g.at("rank").get<int>(), g.at("size").get<int>(),
                        g.at("transport").get<std::string>());
        if (state == "done") {
          line += fmt::format("\n    last completed {}", what);
        } else {
          line += fmt::format("\n    {} {} after {:.0f} ms", state, what, std::max(0.0, started - finished));
          if (!e.at("error").get<std::string>().empty()) line += ": " + e.at("error").get<std::string>();
        }
      }
      out += fmt::format("  rank {}:{}\n", j.at("rank").get<std::string>(), line.empty() ? " no operations" : line);
    } catch (const std::exception& e) {
      out += fmt::format("  {}: unreadable flight record ({})\n", path, e.what());
    }
  }
  return out;
}

int silent_rank(const std::vector<FlightRecord>& records, bool* stalled) {
  static const std::regex silent("rank (\\d+) (sent no heartbeat|made no progress)");
  int found = -1;
  for (const FlightRecord& record : records) {
    std::smatch m;
    if (std::regex_search(record.text, m, silent)) {
      found = std::stoi(m[1].str());
      *stalled = m[2].str() == "made no progress";
    }
  }
  return found;
}

}  // namespace dtrain::launch
