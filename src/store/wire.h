#pragma once

// The job store's wire format, shared by its server and its clients: each
// message is a 4-byte little-endian length, then that many bytes. A
// request's first byte is its operation, a response's its status; the
// fields that follow are integers (little-endian) and strings (a 4-byte
// length, then the bytes). A reader never trusts a length: a message that
// does not parse is refused, whoever sent it.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace lockstep::store {

/// No message may be larger: a length beyond it is garbage, not a value.
constexpr uint32_t kMaxMessage = 64u << 20;

enum class Op : uint8_t {
  Ping = 1,
  Set = 2,
  Get = 3,        // the value now, or Missing
  WaitGet = 4,    // the value once it exists (parked), or Timeout
  Add = 5,
  CompareSet = 6, // c10d's semantics: the stored value after the call
  Delete = 7,
  DeletePrefix = 8,
  Check = 9,
  Wait = 10,      // until every key exists (parked), or Timeout
  NumKeys = 11,
  // The liveness of the job's processes (liveness_table.h).
  Hello = 12,     // this connection beats for a slot
  Watch = 13,     // a beat; answered once the view changes, or at its wait
  Report = 14,    // an observer says a process failed
  Goodbye = 15,   // the beating process ends cleanly
  Progress = 16,  // every slot's progress, for judging a hang
  Note = 17,      // a line every watcher receives (an epoch given up)
  Stats = 18,     // what the store holds (ServerStats)
  GetPrefix = 19, // every key under a prefix, with its value
  // Where the store has the job's secret, a connection proves it holds it
  // before any other operation but a ping.
  Challenge = 20, // a nonce of this connection's
  Prove = 21,     // prove(secret, "store|" + nonce)
};

enum class Status : uint8_t {
  Ok = 0,
  Missing = 1,
  Timeout = 2,
  Refused = 3,
  Unproven = 4, // the connection has not proven that it holds the job's secret
  Invalid = 255,
};

/// The greeting a server answers a Ping with: a peer that does not is no
/// job store.
constexpr const char* kGreeting = "lockstep-store 1";

class Writer {
 public:
  explicit Writer(uint8_t head) {
    bytes_.assign(4, '\0');
    bytes_.push_back(static_cast<char>(head));
  }
  Writer& u8(uint8_t value) {
    bytes_.push_back(static_cast<char>(value));
    return *this;
  }
  Writer& u32(uint32_t value) {
    for (int i = 0; i < 4; ++i) {
      bytes_.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
    }
    return *this;
  }
  Writer& i64(int64_t value) {
    auto bits = static_cast<uint64_t>(value);
    for (int i = 0; i < 8; ++i) {
      bytes_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
    }
    return *this;
  }
  Writer& str(const std::string& value) {
    u32(static_cast<uint32_t>(value.size()));
    bytes_ += value;
    return *this;
  }
  /// The framed message.
  std::string finish() {
    auto length = static_cast<uint32_t>(bytes_.size() - 4);
    for (int i = 0; i < 4; ++i) {
      bytes_[i] = static_cast<char>((length >> (8 * i)) & 0xff);
    }
    return std::move(bytes_);
  }

 private:
  std::string bytes_;
};

/// Raised by Reader on a message that does not parse.
class Malformed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Reader {
 public:
  /// Over a message's body (after its length).
  Reader(const char* data, size_t size) : data_(data), size_(size) {}
  uint8_t u8() {
    need(1);
    return static_cast<uint8_t>(data_[pos_++]);
  }
  uint32_t u32() {
    need(4);
    uint32_t value = 0;
    for (int i = 0; i < 4; ++i) {
      value |= static_cast<uint32_t>(static_cast<uint8_t>(data_[pos_++])) << (8 * i);
    }
    return value;
  }
  int64_t i64() {
    need(8);
    uint64_t value = 0;
    for (int i = 0; i < 8; ++i) {
      value |= static_cast<uint64_t>(static_cast<uint8_t>(data_[pos_++])) << (8 * i);
    }
    return static_cast<int64_t>(value);
  }
  std::string str() {
    uint32_t length = u32();
    need(length);
    std::string value(data_ + pos_, length);
    pos_ += length;
    return value;
  }
  /// A count of items that each take at least `item_bytes`: refused when
  /// the message cannot hold that many.
  uint32_t count(size_t item_bytes) {
    uint32_t n = u32();
    if (item_bytes > 0 && n > (size_ - pos_) / item_bytes) {
      throw Malformed("a count larger than the message");
    }
    return n;
  }
  bool done() const {
    return pos_ == size_;
  }

 private:
  void need(size_t n) {
    if (n > size_ - pos_) {
      throw Malformed("a field runs past the end of the message");
    }
  }
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
};

/// The length of a framed message whose first 4 bytes are `head`.
inline uint32_t frame_length(const char* head) {
  uint32_t length = 0;
  for (int i = 0; i < 4; ++i) {
    length |= static_cast<uint32_t>(static_cast<uint8_t>(head[i])) << (8 * i);
  }
  return length;
}

} // namespace lockstep::store
