#include "world/job_secret.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <c10/util/Exception.h>

namespace lockstep::detail {
namespace {

std::string hex(const unsigned char* bytes, size_t length) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < length; ++i) {
    out += digits[bytes[i] >> 4];
    out += digits[bytes[i] & 15];
  }
  return out;
}

} // namespace

std::string prove(const std::string& secret, const std::string& message) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  auto* made = HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
                    reinterpret_cast<const unsigned char*>(message.data()), message.size(),
                    digest, &length);
  TORCH_INTERNAL_ASSERT(made != nullptr, "HMAC-SHA256 failed");
  return hex(digest, length);
}

bool proven(const std::string& secret, const std::string& message, const std::string& proof) {
  std::string expected = prove(secret, message);
  return proof.size() == expected.size() &&
      CRYPTO_memcmp(proof.data(), expected.data(), expected.size()) == 0;
}

std::string random_nonce() {
  unsigned char bytes[16];
  TORCH_INTERNAL_ASSERT(RAND_bytes(bytes, sizeof(bytes)) == 1, "no random bytes");
  return hex(bytes, sizeof(bytes));
}

} // namespace lockstep::detail
