#pragma once

// Proofs that a process holds the job's secret, without the secret on the
// wire: HMAC-SHA256 over what is being claimed and a nonce of the job's.

#include <cstddef>
#include <string>

namespace lockstep::detail {

/// HMAC-SHA256 of `message` keyed with `secret`, as hex.
std::string prove(const std::string& secret, const std::string& message);

/// Whether `proof` is prove(secret, message), compared in constant time.
bool proven(const std::string& secret, const std::string& message, const std::string& proof);

/// 16 random bytes as hex.
std::string random_nonce();

/// SHA-256 over bytes added in turn, as hex.
class Digest {
 public:
  Digest();
  ~Digest();
  Digest(const Digest&) = delete;
  Digest& operator=(const Digest&) = delete;
  void add(const void* data, size_t size);
  std::string finish();

 private:
  void* context_;
};

} // namespace lockstep::detail
