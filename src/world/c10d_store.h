#pragma once

// The job's store (store/client.h) as the c10d::Store that Gloo, NCCL and
// World::store() users expect. Each instance is one connection; clone()
// (LibTorch 2.5 on) opens another.

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "store/client.h"

namespace lockstep::detail {

class C10dStore : public c10d::Store {
 public:
  /// Connects to `endpoint` (retrying at most `timeout`); throws
  /// store::StoreError.
  C10dStore(store::Endpoint endpoint, std::chrono::milliseconds timeout);

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key,
                                  const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  /// Waits for the key as long as the store's timeout, as c10d's do.
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  // An override from LibTorch 2.5 on (pure there), a plain method before:
  // written without the keyword so that one source builds on both.
  c10::intrusive_ptr<c10d::Store> clone();

  store::StoreClient& client() {
    return *client_;
  }

 private:
  store::Endpoint endpoint_;
  std::chrono::milliseconds connect_timeout_;
  std::unique_ptr<store::StoreClient> client_;
};

} // namespace lockstep::detail
