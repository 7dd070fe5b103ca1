#include "world/job_secret.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <stdexcept>

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
  if (made == nullptr) {
    throw std::runtime_error("HMAC-SHA256 failed");
  }
  return hex(digest, length);
}

bool proven(const std::string& secret, const std::string& message, const std::string& proof) {
  std::string expected = prove(secret, message);
  return proof.size() == expected.size() &&
      CRYPTO_memcmp(proof.data(), expected.data(), expected.size()) == 0;
}

std::string Digest::finish() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(context_), digest, &length) != 1) {
    throw std::runtime_error("SHA-256 failed");
  }
  return hex(digest, length);
}

Digest::Digest() : context_(EVP_MD_CTX_new()) {
  if (context_ == nullptr ||
      EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(context_), EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("SHA-256 failed");
  }
}

Digest::~Digest() {
  EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(context_));
}

void Digest::add(const void* data, size_t size) {
  EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(context_), data, size);
}

std::string random_nonce() {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
    throw std::runtime_error("no random bytes");
  }
  return hex(bytes, sizeof(bytes));
}

} // namespace lockstep::detail
