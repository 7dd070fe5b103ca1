#include "world/c10d_store.h"

#include "common/wording.h"

namespace lockstep::detail {
namespace {

std::vector<uint8_t> bytes(const std::string& text) {
  return {text.begin(), text.end()};
}

std::string text(const std::vector<uint8_t>& value) {
  return {value.begin(), value.end()};
}

// c10d's timeouts read "timed out", which lockstep's own messages tell
// from other failures by.
[[noreturn]] void timed_out(const std::vector<std::string>& keys, std::chrono::milliseconds wait) {
  std::string names;
  for (const auto& key : keys) {
    names += (names.empty() ? "'" : ", '") + key + "'";
  }
  throw store::StoreError("the store timed out after " + seconds(wait) + " waiting for " + names);
}

} // namespace

C10dStore::C10dStore(store::Endpoint endpoint, std::chrono::milliseconds timeout)
    : c10d::Store(timeout),
      endpoint_(std::move(endpoint)),
      connect_timeout_(timeout),
      client_(std::make_unique<store::StoreClient>(endpoint_, timeout)) {}

void C10dStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  client_->set(key, text(value));
}

std::vector<uint8_t> C10dStore::compareSet(const std::string& key,
                                           const std::vector<uint8_t>& expected,
                                           const std::vector<uint8_t>& desired) {
  return bytes(client_->compare_set(key, text(expected), text(desired)));
}

std::vector<uint8_t> C10dStore::get(const std::string& key) {
  auto value = client_->wait_get(key, timeout_);
  if (!value) {
    timed_out({key}, timeout_);
  }
  return bytes(*value);
}

int64_t C10dStore::add(const std::string& key, int64_t value) {
  return client_->add(key, value);
}

bool C10dStore::deleteKey(const std::string& key) {
  return client_->erase(key);
}

bool C10dStore::check(const std::vector<std::string>& keys) {
  return client_->check(keys);
}

int64_t C10dStore::getNumKeys() {
  return client_->num_keys();
}

void C10dStore::wait(const std::vector<std::string>& keys) {
  wait(keys, timeout_);
}

void C10dStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  if (!client_->wait(keys, timeout)) {
    timed_out(keys, timeout);
  }
}

c10::intrusive_ptr<c10d::Store> C10dStore::clone() {
  auto copy = c10::make_intrusive<C10dStore>(endpoint_, connect_timeout_);
  copy->setTimeout(timeout_);
  return copy;
}

} // namespace lockstep::detail
