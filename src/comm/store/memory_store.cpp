// In-process store for ranks running as threads.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <condition_variable>
#include <map>
#include <mutex>

#include "dtrain/comm/store.h"

namespace dtrain::comm {

namespace {

class MemoryStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      data_[key] = value;
    }
    cv_.notify_all();
  }

  std::string get(const std::string& key, Duration timeout) override {
    wait({key}, timeout);
    std::lock_guard<std::mutex> lock(mu_);
    return data_.at(key);
  }

  std::optional<std::string> try_get(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = data_.find(key);
    if (it == data_.end()) return std::nullopt;
    return it->second;
  }

  int64_t add(const std::string& key, int64_t delta) override {
    int64_t v = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = data_.find(key);
      if (it != data_.end()) v = std::stoll(it->second);
      v += delta;
      data_[key] = std::to_string(v);
    }
    cv_.notify_all();
    return v;
  }

  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    std::string result;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = data_.find(key);
      const std::string current = it == data_.end() ? "" : it->second;
      if (current == expected) {
        data_[key] = desired;
        result = desired;
      } else {
        result = current;
      }
    }
    cv_.notify_all();
    return result;
  }

  void wait(const std::vector<std::string>& keys, Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    const bool ok = cv_.wait_for(lock, timeout, [&] {
      for (const auto& k : keys) {
        if (data_.count(k) == 0) return false;
      }
      return true;
    });
    if (!ok) {
      std::vector<std::string> missing;
      for (const auto& k : keys) {
        if (data_.count(k) == 0) missing.push_back(k);
      }
      throw CommError(
          "store.wait", 0, {},
          fmt::format("timed out after {} ms waiting for keys: {}", timeout.count(), fmt::join(missing, ", ")),
          __FILE__, __LINE__);
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> data_;
};

}  // namespace

std::shared_ptr<Store> make_memory_store() { return std::make_shared<MemoryStore>(); }

}  // namespace dtrain::comm
