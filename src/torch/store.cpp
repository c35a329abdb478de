// Stores in both directions: dtrain's groups meeting in torch's store, and torch's rendezvous
// meeting in dtrain launch's authenticated store.
#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "dtrain/torch/process_group.h"

namespace dtrain::torch_backend {
namespace {

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string string_of(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

// dtrain's Store interface over a c10d::Store. c10d's get() waits with the store's own
// timeout, so a get with a deadline is a wait() followed by a get(); c10d's errors (a
// timeout, a lost connection) become CommError as dtrain's stores raise them.
class C10dBackedStore final : public comm::Store {
 public:
  explicit C10dBackedStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  void set(const std::string& key, const std::string& value) override {
    guard("set", key, [&] { store_->set(key, bytes_of(value)); });
  }
  std::string get(const std::string& key, comm::Duration timeout) override {
    std::string value;
    guard("get", key, [&] {
      store_->wait({key}, timeout);
      value = string_of(store_->get(key));
    });
    return value;
  }
  std::optional<std::string> try_get(const std::string& key) override {
    std::optional<std::string> value;
    guard("try_get", key, [&] {
      if (store_->check({key})) value = string_of(store_->get(key));
    });
    return value;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    int64_t value = 0;
    guard("add", key, [&] { value = store_->add(key, delta); });
    return value;
  }
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    std::string value;
    guard("compare_set", key,
          [&] { value = string_of(store_->compareSet(key, bytes_of(expected), bytes_of(desired))); });
    return value;
  }
  void wait(const std::vector<std::string>& keys, comm::Duration timeout) override {
    try {
      store_->wait(keys, timeout);
    } catch (const std::exception& e) {
      std::vector<std::string> missing;
      try {
        for (const auto& k : keys) {
          if (!store_->check({k})) missing.push_back(k);
        }
      } catch (const std::exception&) {
        missing = keys;
      }
      throw comm::CommError("store wait", 0, {},
                            fmt::format("torch store: keys {} missing after {} ms: {}", fmt::join(missing, ", "),
                                        timeout.count(), e.what()),
                            __FILE__, __LINE__);
    }
  }

 private:
  template <typename F>
  void guard(const char* op, const std::string& key, F&& f) {
    try {
      f();
    } catch (const comm::CommError&) {
      throw;
    } catch (const std::exception& e) {
      throw comm::CommError(fmt::format("store {}", op), 0, {}, fmt::format("torch store, key '{}': {}", key, e.what()),
                            __FILE__, __LINE__);
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
};

// A c10d::Store over a dtrain Store: what torch's rendezvous (env://) uses under dtrain
// launch, whose authenticated store holds MASTER_PORT.
class DtrainBackedStore final : public c10d::Store {
 public:
  DtrainBackedStore(std::shared_ptr<comm::Store> store, std::chrono::milliseconds timeout)
      : c10d::Store(timeout), store_(std::move(store)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override { store_->set(key, string_of(value)); }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    return bytes_of(store_->compare_set(key, string_of(expected), string_of(desired)));
  }
  std::vector<uint8_t> get(const std::string& key) override { return bytes_of(store_->get(key, timeout_)); }
  int64_t add(const std::string& key, int64_t value) override { return store_->add(key, value); }
  bool deleteKey(const std::string& key) override {
    TORCH_CHECK(false, "dtrain store: deleteKey('", key, "') is not supported (dtrain's store never deletes keys)");
  }
  bool check(const std::vector<std::string>& keys) override {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return store_->try_get(k).has_value(); });
  }
  int64_t getNumKeys() override { TORCH_CHECK(false, "dtrain store: getNumKeys() is not supported"); }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  std::shared_ptr<comm::Store> store_;
};

}  // namespace

std::shared_ptr<comm::Store> wrap_c10d_store(c10::intrusive_ptr<c10d::Store> store) {
  return std::make_shared<C10dBackedStore>(std::move(store));
}

c10::intrusive_ptr<c10d::Store> wrap_dtrain_store(std::shared_ptr<comm::Store> store,
                                                  std::chrono::milliseconds timeout) {
  return c10::make_intrusive<DtrainBackedStore>(std::move(store), timeout);
}

}  // namespace dtrain::torch_backend
