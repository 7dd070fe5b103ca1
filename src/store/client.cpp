#include "store/client.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <cstring>
#include <thread>

#include "store/wire.h"
#include "world/job_secret.h"

namespace lockstep::store {
namespace {

using Clock = std::chrono::steady_clock;

std::string seconds_text(std::chrono::milliseconds duration) {
  auto tenths = (duration.count() + 50) / 100;
  return std::to_string(tenths / 10) + (tenths % 10 ? "." + std::to_string(tenths % 10) : "") +
      " s";
}

int ms_until(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(
      std::clamp<int64_t>(left.count(), 0, std::numeric_limits<int>::max()));
}

Status status_of(const std::string& body) {
  return static_cast<Status>(static_cast<uint8_t>(body[0]));
}

Reader fields(const std::string& body) {
  return Reader(body.data() + 1, body.size() - 1);
}

} // namespace

StoreClient::StoreClient(Endpoint endpoint, std::chrono::milliseconds timeout)
    : endpoint_(std::move(endpoint)), candidates_(endpoint_.candidates()), timeout_(timeout) {
  connect(Clock::now() + timeout_);
}

StoreClient::~StoreClient() {
  disconnect();
}

std::chrono::milliseconds StoreClient::timeout() const {
  return timeout_;
}

void StoreClient::set_timeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  timeout_ = timeout;
}

void StoreClient::set_move_wait(std::chrono::milliseconds wait) {
  std::lock_guard<std::mutex> lock(mutex_);
  move_wait_ = wait;
}

const Endpoint& StoreClient::serving() const {
  return candidates_[serving_];
}

void StoreClient::connect(Clock::time_point deadline, bool retry) {
  if (candidates_.size() == 1) {
    connect_to_candidate(0, deadline, retry);
    return;
  }
  // The one served last first, then the others in the job's order, until
  // one answers as a store with the job's secret; in rounds, since a
  // successor takes over a moment after its predecessor is gone.
  constexpr auto kOneTry = std::chrono::seconds(1);
  std::string causes;
  bool unproven = false; // a store with another secret answered
  bool other = false;    // and one did not answer at all
  while (true) {
    causes.clear();
    unproven = other = false;
    for (size_t k = 0; k < candidates_.size(); ++k) {
      size_t candidate = k == 0 ? serving_ : (k <= serving_ ? k - 1 : k);
      try {
        connect_to_candidate(candidate, std::min(deadline, Clock::now() + kOneTry), false);
        if (candidate != serving_) {
          serving_ = candidate;
          ++moves_;
        }
        return;
      } catch (const StoreError& e) {
        // (A store with another secret too: another job's, at an address
        // of this job's list, is not this job's store.)
        causes += std::string(causes.empty() ? "" : "; ") + e.what();
        (dynamic_cast<const UnprovenError*>(&e) != nullptr ? unproven : other) = true;
      }
    }
    // (`retry` or not: a successor is awaited until the deadline either
    // way, unless another thread interrupts this client meanwhile.)
    bool interrupted;
    {
      std::lock_guard<std::mutex> lock(fd_mutex_);
      interrupted = interrupted_;
    }
    if (interrupted || Clock::now() + std::chrono::milliseconds(100) >= deadline) {
      if (unproven && !other) {
        throw UnprovenError("no store of the job answers (" + causes + ")");
      }
      throw StoreError("no store of the job answers (" + causes + ")");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void StoreClient::connect_to_candidate(size_t index, Clock::time_point deadline, bool retry) {
  const Endpoint& endpoint = candidates_[index];
  std::string error;
  int fd = connect_to(endpoint, deadline, error, retry);
  if (fd < 0) {
    throw StoreError("cannot reach the store at " + endpoint.describe() + ": " + error);
  }
  {
    std::lock_guard<std::mutex> lock(fd_mutex_);
    fd_ = fd;
  }
  if (endpoint.secret.empty()) {
    return;
  }
  // Over a nonce of the store's: a proof seen on the wire proves nothing
  // on another connection.
  Status proved = Status::Invalid;
  try {
    auto challenge = exchange(Writer(static_cast<uint8_t>(Op::Challenge)).finish(), {});
    if (status_of(challenge) == Status::Ok) {
      auto nonce = fields(challenge).str();
      proved = status_of(exchange(Writer(static_cast<uint8_t>(Op::Prove))
                                      .str(detail::prove(endpoint.secret, "store|" + nonce))
                                      .finish(),
                                  {}));
    }
  } catch (const Malformed&) {
  }
  if (proved != Status::Ok) {
    disconnect();
    if (proved == Status::Unproven) {
      throw UnprovenError("the store at " + endpoint.describe() + " holds another job secret "
                          "than this process's");
    }
    throw StoreError("the store at " + endpoint.describe() + " did not answer a proof of the "
                     "job secret: is it a lockstep store?");
  }
}

void StoreClient::disconnect() {
  std::lock_guard<std::mutex> lock(fd_mutex_);
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void StoreClient::interrupt() {
  std::lock_guard<std::mutex> lock(fd_mutex_);
  interrupted_ = true;
  if (fd_ >= 0) {
    ::shutdown(fd_, SHUT_RDWR);
  }
}

std::string StoreClient::call(const std::string& request, std::chrono::milliseconds wait) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fd_ < 0) {
    // Once: the store answered before, and one that refuses now is gone
    // (a successor, where the job has them, may have taken over).
    connect(Clock::now() + (candidates_.size() > 1 ? move_wait_.value_or(timeout_) : timeout_),
            /*retry=*/false);
  }
  std::string body;
  try {
    closed_by_store_ = false;
    body = exchange(request, wait);
  } catch (const StoreError&) {
    // Only where the store closed the connection (its process is gone)
    // and another store of the job answers now: there the request is
    // asked again, since what the gone one held is gone with it. Never
    // twice of the same store (an add would count twice).
    bool interrupted;
    {
      std::lock_guard<std::mutex> fd_lock(fd_mutex_);
      interrupted = interrupted_;
    }
    if (candidates_.size() == 1 || !closed_by_store_ || interrupted) {
      throw;
    }
    size_t before = serving_;
    connect(Clock::now() + move_wait_.value_or(timeout_), /*retry=*/false);
    if (serving_ == before) {
      disconnect();
      throw;
    }
    body = exchange(request, wait);
  }
  if (status_of(body) == Status::Unproven) {
    throw UnprovenError("the store at " + serving().describe() + " requires the job secret, "
                        "and this process did not prove it");
  }
  return body;
}

std::string StoreClient::exchange(const std::string& request, std::chrono::milliseconds wait) {
  auto deadline = Clock::now() + wait + timeout_;
  auto fail = [&](const std::string& why) {
    disconnect();
    throw StoreError("the store at " + serving().describe() + " " + why);
  };
  size_t sent = 0;
  while (sent < request.size()) {
    pollfd writable{fd_, POLLOUT, 0};
    if (::poll(&writable, 1, ms_until(deadline)) != 1) {
      fail("did not take a request within " + seconds_text(timeout_));
    }
    ssize_t n = ::send(fd_, request.data() + sent, request.size() - sent,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      continue;
    }
    if (n <= 0) {
      closed_by_store_ = true;
      fail(std::string("closed the connection: ") + std::strerror(errno));
    }
    sent += static_cast<size_t>(n);
  }
  std::string body;
  char head[4];
  size_t want = sizeof(head);
  size_t got = 0;
  bool in_head = true;
  while (true) {
    char* into = in_head ? head + got : body.data() + got;
    if (got == want) {
      if (!in_head) {
        break;
      }
      uint32_t length = frame_length(head);
      if (length == 0 || length > kMaxMessage) {
        fail("sent an answer that does not parse: is it a lockstep store?");
      }
      in_head = false;
      body.resize(length);
      want = length;
      got = 0;
      continue;
    }
    pollfd readable{fd_, POLLIN, 0};
    if (::poll(&readable, 1, ms_until(deadline)) != 1) {
      fail("did not answer within " + seconds_text(wait + timeout_));
    }
    ssize_t n = ::recv(fd_, into, want - got, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      continue;
    }
    if (n <= 0) {
      closed_by_store_ = true;
      fail("closed the connection");
    }
    got += static_cast<size_t>(n);
  }
  if (status_of(body) == Status::Invalid) {
    fail("refused the request as malformed");
  }
  return body;
}

std::string StoreClient::ping() {
  auto body = call(Writer(static_cast<uint8_t>(Op::Ping)).finish(), {});
  auto in = fields(body);
  std::string greeting;
  try {
    greeting = in.str();
  } catch (const Malformed&) {
  }
  if (greeting != kGreeting) {
    disconnect();
    throw StoreError("the peer at " + serving().describe() + " is not a lockstep store");
  }
  return greeting;
}

void StoreClient::set(const std::string& key, const std::string& value) {
  call(Writer(static_cast<uint8_t>(Op::Set)).str(key).str(value).finish(), {});
}

std::optional<std::string> StoreClient::get(const std::string& key) {
  auto body = call(Writer(static_cast<uint8_t>(Op::Get)).str(key).finish(), {});
  if (status_of(body) == Status::Missing) {
    return std::nullopt;
  }
  auto in = fields(body);
  return in.str();
}

std::optional<std::string> StoreClient::wait_get(const std::string& key,
                                                 std::chrono::milliseconds wait) {
  auto body = call(Writer(static_cast<uint8_t>(Op::WaitGet)).str(key).i64(wait.count()).finish(),
                   wait);
  if (status_of(body) == Status::Timeout) {
    return std::nullopt;
  }
  auto in = fields(body);
  return in.str();
}

int64_t StoreClient::add(const std::string& key, int64_t delta) {
  auto body = call(Writer(static_cast<uint8_t>(Op::Add)).str(key).i64(delta).finish(), {});
  auto in = fields(body);
  return in.i64();
}

std::string StoreClient::compare_set(const std::string& key, const std::string& expected,
                                     const std::string& desired) {
  auto body = call(
      Writer(static_cast<uint8_t>(Op::CompareSet)).str(key).str(expected).str(desired).finish(),
      {});
  auto in = fields(body);
  return in.str();
}

std::vector<std::pair<std::string, std::string>> StoreClient::get_prefix(
    const std::string& prefix) {
  auto body = call(Writer(static_cast<uint8_t>(Op::GetPrefix)).str(prefix).finish(), {});
  auto in = fields(body);
  std::vector<std::pair<std::string, std::string>> found;
  uint32_t count = in.count(8);
  for (uint32_t i = 0; i < count; ++i) {
    auto key = in.str();
    found.emplace_back(std::move(key), in.str());
  }
  return found;
}

bool StoreClient::erase(const std::string& key) {
  auto body = call(Writer(static_cast<uint8_t>(Op::Delete)).str(key).finish(), {});
  auto in = fields(body);
  return in.u8() != 0;
}

int64_t StoreClient::erase_prefix(const std::string& prefix) {
  auto body = call(Writer(static_cast<uint8_t>(Op::DeletePrefix)).str(prefix).finish(), {});
  auto in = fields(body);
  return in.i64();
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  Writer request(static_cast<uint8_t>(Op::Check));
  request.u32(static_cast<uint32_t>(keys.size()));
  for (const auto& key : keys) {
    request.str(key);
  }
  auto body = call(request.finish(), {});
  auto in = fields(body);
  return in.u8() != 0;
}

bool StoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds wait) {
  Writer request(static_cast<uint8_t>(Op::Wait));
  request.u32(static_cast<uint32_t>(keys.size()));
  for (const auto& key : keys) {
    request.str(key);
  }
  request.i64(wait.count());
  return status_of(call(request.finish(), wait)) == Status::Ok;
}

int64_t StoreClient::num_keys() {
  auto body = call(Writer(static_cast<uint8_t>(Op::NumKeys)).finish(), {});
  auto in = fields(body);
  return in.i64();
}

std::optional<int> StoreClient::hello(int slot, int incarnation,
                                      std::chrono::milliseconds heartbeat_timeout,
                                      const std::string& identity) {
  auto body = call(Writer(static_cast<uint8_t>(Op::Hello))
                       .u32(static_cast<uint32_t>(slot))
                       .u32(static_cast<uint32_t>(incarnation))
                       .i64(heartbeat_timeout.count())
                       .str(identity)
                       .finish(),
                   {});
  if (status_of(body) == Status::Refused) {
    auto in = fields(body);
    return static_cast<int>(in.i64());
  }
  return std::nullopt;
}

ViewChange StoreClient::watch(int64_t progress, uint64_t since, std::chrono::milliseconds wait,
                              std::chrono::milliseconds heartbeat_timeout) {
  auto body = call(Writer(static_cast<uint8_t>(Op::Watch))
                       .i64(progress)
                       .i64(static_cast<int64_t>(since))
                       .i64(wait.count())
                       .i64(heartbeat_timeout.count())
                       .finish(),
                   wait);
  auto in = fields(body);
  return ViewChange::read(in);
}

void StoreClient::report(int slot, int incarnation, const std::string& why) {
  call(Writer(static_cast<uint8_t>(Op::Report))
           .u32(static_cast<uint32_t>(slot))
           .u32(static_cast<uint32_t>(incarnation))
           .str(why)
           .finish(),
       {});
}

void StoreClient::note(const std::string& text) {
  call(Writer(static_cast<uint8_t>(Op::Note)).str(text).finish(), {});
}

void StoreClient::goodbye(int slot, int incarnation, int64_t progress) {
  call(Writer(static_cast<uint8_t>(Op::Goodbye))
           .u32(static_cast<uint32_t>(slot))
           .u32(static_cast<uint32_t>(incarnation))
           .i64(progress)
           .finish(),
       {});
}

std::vector<SlotProgress> StoreClient::progress() {
  auto body = call(Writer(static_cast<uint8_t>(Op::Progress)).finish(), {});
  auto in = fields(body);
  return read_progress(in);
}

ServerStats StoreClient::stats() {
  auto body = call(Writer(static_cast<uint8_t>(Op::Stats)).finish(), {});
  auto in = fields(body);
  ServerStats stats;
  stats.keys = in.i64();
  stats.key_bytes = in.i64();
  stats.connections = in.i64();
  stats.operations = in.i64();
  stats.slots = in.i64();
  stats.cpu_us = in.i64();
  stats.key_operations = in.i64();
  return stats;
}

} // namespace lockstep::store
