#include "store/server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <ctime>
#include <cstring>
#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <utility>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "store/liveness_table.h"
#include "store/wire.h"
#include "world/job_secret.h"

namespace lockstep::store {
namespace {

using Clock = std::chrono::steady_clock;

// How often silence is judged: a verdict comes at most this late.
constexpr auto kExpiryTick = std::chrono::milliseconds(10);
// How long accepting pauses when the process is out of descriptors.
constexpr auto kAcceptPause = std::chrono::milliseconds(100);
// The longest wait or heartbeat timeout a client may ask for.
constexpr auto kLongestWait = std::chrono::milliseconds(24 * 3600 * 1000);
// A watch is answered at least this often, whatever it asked.
constexpr auto kLongestWatch = std::chrono::seconds(60);

enum class Park { None, Keys, Get, Watch };

// Answered on the store's own thread, so this is the store's CPU time.
int64_t thread_cpu_us() {
  timespec now{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<int64_t>(now.tv_sec) * 1000000 + now.tv_nsec / 1000;
}

struct Connection {
  uint64_t id = 0;
  int fd = -1;
  std::string in;
  size_t in_pos = 0;
  std::string out;
  size_t out_pos = 0;
  bool writing = false;
  bool closing = false;
  Park park = Park::None;
  std::vector<std::string> keys;
  uint64_t since = 0;
  bool has_deadline = false;
  std::multimap<Clock::time_point, uint64_t>::iterator deadline;
  // The slot it beats for (Hello), and whether it said goodbye.
  int slot = -1;
  int incarnation = -1;
  // Where the store has a secret: the nonce it was challenged with, and
  // whether it proved the secret over it.
  std::string nonce;
  bool proven = false;
};

std::string answer(Status status) {
  return Writer(static_cast<uint8_t>(status)).finish();
}

} // namespace

struct StoreServer::Impl {
  ServerOptions options;
  int listener = -1;
  int epoll = -1;
  int wake = -1;
  std::atomic<bool> stopping{false};

  std::map<std::string, std::string> data;
  int64_t key_bytes = 0;
  // A set: a thousand waiters on one key each give up at their own time.
  std::unordered_map<std::string, std::unordered_set<uint64_t>> key_waiters;
  std::set<uint64_t> watchers;
  std::multimap<Clock::time_point, uint64_t> deadlines;
  struct Delayed {
    Clock::time_point due;
    uint64_t connection;
    std::string bytes;
  };
  std::deque<Delayed> delayed;
  std::unordered_map<uint64_t, std::unique_ptr<Connection>> connections;
  std::vector<uint64_t> closing; // marked by close_later, closed by reap
  uint64_t next_id = 2; // 0: the listener, 1: the wake-up
  LivenessTable liveness;
  uint64_t notified = 0;
  Clock::time_point next_expiry{};
  std::optional<Clock::time_point> listener_paused_until;
  int64_t operations = 0;
  int64_t key_operations = 0;
  int64_t unproven = 0;
  Clock::time_point next_unproven_log{};

  explicit Impl(ServerOptions options_in) : options(std::move(options_in)) {
    std::string error;
    listener = listen_on(options.endpoint, error);
    if (listener < 0) {
      throw std::runtime_error(error);
    }
    // A connection or more per process of the job: the default soft
    // limit (1024) is a few hundred ranks.
    rlimit files{};
    if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
      files.rlim_cur = files.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &files);
    }
    epoll = ::epoll_create1(EPOLL_CLOEXEC);
    wake = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    watch_listener();
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.u64 = 1;
    ::epoll_ctl(epoll, EPOLL_CTL_ADD, wake, &event);
  }

  void watch_listener() {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.u64 = 0;
    ::epoll_ctl(epoll, EPOLL_CTL_ADD, listener, &event);
  }

  ~Impl() {
    // The listener first: a client whose connection closes must find
    // nothing listening here any more (it then looks for a successor).
    ::close(listener);
    for (auto& [id, connection] : connections) {
      ::close(connection->fd);
    }
    ::close(epoll);
    ::close(wake);
    if (options.endpoint.kind == Endpoint::Kind::Unix) {
      ::unlink(options.endpoint.path.c_str());
    }
  }

  void run() {
    std::vector<epoll_event> events(256);
    while (!stopping) {
      int ready = ::epoll_wait(epoll, events.data(), static_cast<int>(events.size()),
                               wait_ms());
      for (int i = 0; i < ready; ++i) {
        uint64_t id = events[i].data.u64;
        if (id == 0) {
          accept_all();
        } else if (id == 1) {
          uint64_t ignored;
          [[maybe_unused]] auto got = ::read(wake, &ignored, sizeof(ignored));
        } else if (auto* connection = find(id)) {
          if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
            receive(*connection);
          }
          if (!connection->closing && (events[i].events & EPOLLOUT)) {
            flush(*connection);
          }
        }
      }
      auto now = Clock::now();
      if (now >= next_expiry) {
        liveness.expire(now);
        next_expiry = now + kExpiryTick;
      }
      expire_parked(now);
      if (listener_paused_until && now >= *listener_paused_until) {
        listener_paused_until.reset();
        watch_listener();
      }
      if (liveness.version() != notified) {
        notify_watchers();
      }
      send_delayed(now);
      reap();
    }
  }

  int wait_ms() const {
    auto now = Clock::now();
    auto next = next_expiry;
    if (!deadlines.empty()) {
      next = std::min(next, deadlines.begin()->first);
    }
    if (!delayed.empty()) {
      next = std::min(next, delayed.front().due);
    }
    if (listener_paused_until) {
      next = std::min(next, *listener_paused_until);
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count();
    return static_cast<int>(std::max<int64_t>(0, left + 1));
  }

  Connection* find(uint64_t id) {
    auto found = connections.find(id);
    return found == connections.end() ? nullptr : found->second.get();
  }

  void accept_all() {
    while (true) {
      int fd = ::accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          // The listener stays readable: without a pause this loop would
          // spin. The clients retry their connect.
          listener_paused_until = Clock::now() + kAcceptPause;
          ::epoll_ctl(epoll, EPOLL_CTL_DEL, listener, nullptr);
        }
        return;
      }
      if (options.endpoint.kind == Endpoint::Kind::Tcp) {
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        // A host that lost power never closes its connections: the kernel
        // probes an idle one after a minute and drops it after 5 misses.
        int idle = 60, interval = 10, count = 5;
        ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
        ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
        ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
        ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
      }
      auto connection = std::make_unique<Connection>();
      connection->id = next_id++;
      connection->fd = fd;
      epoll_event event{};
      event.events = EPOLLIN | EPOLLRDHUP;
      event.data.u64 = connection->id;
      ::epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &event);
      connections.emplace(connection->id, std::move(connection));
    }
  }

  void receive(Connection& connection) {
    char buffer[65536];
    while (true) {
      ssize_t got = ::read(connection.fd, buffer, sizeof(buffer));
      if (got > 0) {
        connection.in.append(buffer, static_cast<size_t>(got));
        if (static_cast<size_t>(got) < sizeof(buffer)) {
          break; // level-triggered: anything left is announced again
        }
        continue;
      }
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) {
        break;
      }
      close_later(connection); // closed by the peer, or broken
      break;
    }
    process(connection);
  }

  // Serves the connection's requests in order, until one parks.
  void process(Connection& connection) {
    while (connection.park == Park::None && !connection.closing) {
      size_t available = connection.in.size() - connection.in_pos;
      if (available < 4) {
        break;
      }
      uint32_t length = frame_length(connection.in.data() + connection.in_pos);
      if (length == 0 || length > kMaxMessage) {
        close_later(connection); // garbage: this peer is no client of ours
        break;
      }
      if (available < 4 + static_cast<size_t>(length)) {
        break;
      }
      Reader request(connection.in.data() + connection.in_pos + 4, length);
      connection.in_pos += 4 + length;
      try {
        serve(connection, request);
      } catch (const Malformed&) {
        send(connection, answer(Status::Invalid));
        close_later(connection);
      }
      ++operations;
    }
    if (connection.in_pos > 0 && connection.in_pos == connection.in.size()) {
      connection.in.clear();
      connection.in_pos = 0;
    } else if (connection.in_pos > 65536) {
      connection.in.erase(0, connection.in_pos);
      connection.in_pos = 0;
    }
  }

  // At most a day: a deadline of now + any i64 would overflow.
  std::chrono::milliseconds read_wait(Reader& request) {
    return std::chrono::milliseconds(std::clamp<int64_t>(request.i64(), 0, kLongestWait.count()));
  }

  void park(Connection& connection, Park kind, std::chrono::milliseconds wait) {
    connection.park = kind;
    connection.has_deadline = wait.count() > 0;
    if (connection.has_deadline) {
      connection.deadline = deadlines.emplace(Clock::now() + wait, connection.id);
    }
  }

  // Whether `connection` may run `op`: one that has not proven the job's
  // secret (where the store has one) may only ping and prove it.
  bool admitted(Connection& connection, Op op) {
    if (options.secret.empty() || connection.proven || op == Op::Ping ||
        op == Op::Challenge || op == Op::Prove) {
      return true;
    }
    send(connection, answer(Status::Unproven));
    refused_unproven("an operation (" + std::to_string(static_cast<int>(op)) + ")");
    return false;
  }

  // Logged at most once a second, with how many since: a stranger that
  // keeps trying fills no disk.
  void refused_unproven(const std::string& what) {
    ++unproven;
    auto now = Clock::now();
    if (now < next_unproven_log) {
      return;
    }
    std::fprintf(stderr, "lockstep: the job's store at %s refused %s of a process that did not "
                 "prove that it holds the job secret (%lld refusal(s) so far)\n",
                 options.endpoint.describe().c_str(), what.c_str(),
                 static_cast<long long>(unproven));
    next_unproven_log = now + std::chrono::seconds(1);
  }

  void serve(Connection& connection, Reader& request) {
    auto op = static_cast<Op>(request.u8());
    if (!admitted(connection, op)) {
      return;
    }
    switch (op) {
      case Op::Challenge:
      case Op::Prove:
      case Op::Ping:
      case Op::Hello:
      case Op::Watch:
      case Op::Report:
      case Op::Goodbye:
      case Op::Progress:
      case Op::Note:
      case Op::Stats:
        break;
      default:
        ++key_operations;
    }
    switch (op) {
      case Op::Ping:
        send(connection, Writer(0).str(kGreeting).finish());
        return;
      case Op::Challenge:
        connection.nonce = options.secret.empty() ? "" : detail::random_nonce();
        send(connection, Writer(0).str(connection.nonce).finish());
        return;
      case Op::Prove: {
        auto proof = request.str();
        connection.proven = options.secret.empty() ||
            (!connection.nonce.empty() &&
             detail::proven(options.secret, "store|" + connection.nonce, proof));
        connection.nonce.clear(); // one proof per challenge
        if (!connection.proven) {
          refused_unproven("a proof");
        }
        send(connection, answer(connection.proven ? Status::Ok : Status::Unproven));
        return;
      }
      case Op::Set: {
        auto key = request.str();
        put(key, request.str());
        send(connection, answer(Status::Ok));
        return;
      }
      case Op::Get: {
        auto found = data.find(request.str());
        send(connection, found == data.end() ? answer(Status::Missing)
                                             : Writer(0).str(found->second).finish());
        return;
      }
      case Op::WaitGet: {
        auto key = request.str();
        auto wait = read_wait(request);
        auto found = data.find(key);
        if (found != data.end()) {
          send(connection, Writer(0).str(found->second).finish());
          return;
        }
        connection.keys = {key};
        key_waiters[key].insert(connection.id);
        park(connection, Park::Get, wait);
        return;
      }
      case Op::Add: {
        auto key = request.str();
        int64_t delta = request.i64();
        int64_t value = 0;
        auto found = data.find(key);
        if (found != data.end()) {
          try {
            value = std::stoll(found->second);
          } catch (const std::exception&) {
            send(connection, answer(Status::Invalid));
            return;
          }
        }
        value += delta;
        put(key, std::to_string(value));
        send(connection, Writer(0).i64(value).finish());
        return;
      }
      case Op::CompareSet: {
        auto key = request.str();
        auto expected = request.str();
        auto desired = request.str();
        auto found = data.find(key);
        std::string stored;
        if (found == data.end()) {
          stored = expected.empty() ? desired : expected;
          if (expected.empty()) {
            put(key, desired);
          }
        } else if (found->second == expected) {
          put(key, desired);
          stored = desired;
        } else {
          stored = found->second;
        }
        send(connection, Writer(0).str(stored).finish());
        return;
      }
      case Op::Delete: {
        bool existed = erase(request.str());
        send(connection, Writer(0).u8(existed ? 1 : 0).finish());
        return;
      }
      case Op::DeletePrefix: {
        auto prefix = request.str();
        int64_t count = 0;
        for (auto it = data.lower_bound(prefix);
             it != data.end() && it->first.compare(0, prefix.size(), prefix) == 0;) {
          key_bytes -= static_cast<int64_t>(it->first.size() + it->second.size());
          it = data.erase(it);
          ++count;
        }
        send(connection, Writer(0).i64(count).finish());
        return;
      }
      case Op::Check:
      case Op::Wait: {
        uint32_t n = request.count(4);
        std::vector<std::string> keys;
        for (uint32_t i = 0; i < n; ++i) {
          keys.push_back(request.str());
        }
        bool all = present(keys);
        if (op == Op::Check) {
          send(connection, Writer(0).u8(all ? 1 : 0).finish());
          return;
        }
        auto wait = read_wait(request);
        if (all) {
          send(connection, answer(Status::Ok));
          return;
        }
        for (const auto& key : keys) {
          if (data.count(key) == 0) {
            key_waiters[key].insert(connection.id);
          }
        }
        connection.keys = std::move(keys);
        park(connection, Park::Keys, wait);
        return;
      }
      case Op::GetPrefix: {
        auto prefix = request.str();
        Writer out(0);
        uint32_t count = 0;
        auto first = data.lower_bound(prefix);
        for (auto it = first;
             it != data.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
          ++count;
        }
        out.u32(count);
        for (auto it = first; count-- > 0; ++it) {
          out.str(it->first).str(it->second);
        }
        send(connection, out.finish());
        return;
      }
      case Op::NumKeys:
        send(connection, Writer(0).i64(static_cast<int64_t>(data.size())).finish());
        return;
      case Op::Hello: {
        int slot = static_cast<int>(request.u32());
        int incarnation = static_cast<int>(request.u32());
        auto timeout = read_wait(request);
        auto identity = request.str();
        auto newer = liveness.hello(slot, incarnation, timeout, identity, connection.id,
                                    Clock::now());
        if (newer) {
          send(connection, Writer(static_cast<uint8_t>(Status::Refused)).i64(*newer).finish());
          return;
        }
        connection.slot = slot;
        connection.incarnation = incarnation;
        send(connection, answer(Status::Ok));
        return;
      }
      case Op::Watch: {
        int64_t progress = request.i64();
        connection.since = static_cast<uint64_t>(request.i64());
        auto wait = std::min<std::chrono::milliseconds>(read_wait(request), kLongestWatch);
        auto timeout = read_wait(request);
        if (connection.slot >= 0) {
          liveness.beat(connection.slot, connection.incarnation, progress, timeout,
                        Clock::now());
        }
        if (liveness.version() > connection.since) {
          answer_watch(connection);
          return;
        }
        watchers.insert(connection.id);
        park(connection, Park::Watch, std::max(wait, std::chrono::milliseconds(1)));
        return;
      }
      case Op::Report: {
        int slot = static_cast<int>(request.u32());
        int incarnation = static_cast<int>(request.u32());
        liveness.report(slot, incarnation, request.str());
        send(connection, answer(Status::Ok));
        return;
      }
      case Op::Goodbye: {
        int slot = static_cast<int>(request.u32());
        int incarnation = static_cast<int>(request.u32());
        liveness.end(slot, incarnation, request.i64());
        send(connection, answer(Status::Ok));
        return;
      }
      case Op::Progress: {
        Writer out(0);
        liveness.write_progress(Clock::now(), out);
        send(connection, out.finish());
        return;
      }
      case Op::Note:
        liveness.note(request.str());
        send(connection, answer(Status::Ok));
        return;
      case Op::Stats:
        send(connection, Writer(0)
                             .i64(static_cast<int64_t>(data.size()))
                             .i64(key_bytes)
                             .i64(static_cast<int64_t>(connections.size()))
                             .i64(operations)
                             .i64(static_cast<int64_t>(liveness.slots()))
                             .i64(thread_cpu_us())
                             .i64(key_operations)
                             .finish());
        return;
    }
    send(connection, answer(Status::Invalid));
    close_later(connection);
  }

  bool present(const std::vector<std::string>& keys) const {
    for (const auto& key : keys) {
      if (data.count(key) == 0) {
        return false;
      }
    }
    return true;
  }

  void put(const std::string& key, std::string value) {
    auto found = data.find(key);
    if (found == data.end()) {
      key_bytes += static_cast<int64_t>(key.size() + value.size());
      data.emplace(key, std::move(value));
      wake_waiters(key);
      return;
    }
    key_bytes += static_cast<int64_t>(value.size()) - static_cast<int64_t>(found->second.size());
    found->second = std::move(value);
  }

  bool erase(const std::string& key) {
    auto found = data.find(key);
    if (found == data.end()) {
      return false;
    }
    key_bytes -= static_cast<int64_t>(found->first.size() + found->second.size());
    data.erase(found);
    return true;
  }

  void wake_waiters(const std::string& key) {
    auto found = key_waiters.find(key);
    if (found == key_waiters.end()) {
      return;
    }
    auto ids = std::move(found->second);
    key_waiters.erase(found);
    for (auto id : ids) {
      auto* connection = find(id);
      if (connection == nullptr || connection->closing ||
          (connection->park != Park::Keys && connection->park != Park::Get) ||
          !present(connection->keys)) {
        continue;
      }
      auto park = connection->park;
      std::string value = park == Park::Get ? data[connection->keys[0]] : std::string();
      unpark(*connection);
      send(*connection, park == Park::Get ? Writer(0).str(value).finish() : answer(Status::Ok));
      process(*connection);
    }
  }

  // Forgets every trace of the connection's wait: nothing that was waited
  // for in vain stays behind.
  void unpark(Connection& connection) {
    if (connection.park == Park::Watch) {
      watchers.erase(connection.id);
    }
    if (connection.park == Park::Keys || connection.park == Park::Get) {
      for (const auto& key : connection.keys) {
        auto found = key_waiters.find(key);
        if (found == key_waiters.end()) {
          continue;
        }
        auto& ids = found->second;
        ids.erase(connection.id);
        if (ids.empty()) {
          key_waiters.erase(found);
        }
      }
      connection.keys.clear();
    }
    if (connection.has_deadline) {
      deadlines.erase(connection.deadline);
    }
    connection.park = Park::None;
    connection.has_deadline = false;
  }

  void answer_watch(Connection& connection) {
    Writer out(0);
    liveness.write_view(connection.since, out);
    send(connection, out.finish());
  }

  void notify_watchers() {
    notified = liveness.version();
    std::vector<uint64_t> ids(watchers.begin(), watchers.end());
    for (auto id : ids) {
      auto* connection = find(id);
      if (connection == nullptr || connection->park != Park::Watch ||
          connection->since >= notified) {
        continue;
      }
      unpark(*connection);
      answer_watch(*connection);
      process(*connection);
    }
  }

  void expire_parked(Clock::time_point now) {
    while (!deadlines.empty() && deadlines.begin()->first <= now) {
      auto* connection = find(deadlines.begin()->second);
      if (connection == nullptr || !connection->has_deadline ||
          connection->deadline != deadlines.begin()) {
        deadlines.erase(deadlines.begin()); // an invariant's guard: never loops
        continue;
      }
      auto park = connection->park;
      unpark(*connection);
      if (park == Park::Watch) {
        answer_watch(*connection);
      } else {
        send(*connection, answer(Status::Timeout));
      }
      process(*connection);
    }
  }

  void send(Connection& connection, std::string bytes) {
    if (options.added_latency.count() > 0) {
      delayed.push_back({Clock::now() + options.added_latency, connection.id, std::move(bytes)});
      return;
    }
    connection.out += bytes;
    flush(connection);
  }

  void send_delayed(Clock::time_point now) {
    while (!delayed.empty() && delayed.front().due <= now) {
      auto item = std::move(delayed.front());
      delayed.pop_front();
      if (auto* connection = find(item.connection)) {
        connection->out += item.bytes;
        flush(*connection);
      }
    }
  }

  void flush(Connection& connection) {
    while (connection.out_pos < connection.out.size()) {
      ssize_t sent = ::send(connection.fd, connection.out.data() + connection.out_pos,
                            connection.out.size() - connection.out_pos, MSG_NOSIGNAL);
      if (sent > 0) {
        connection.out_pos += static_cast<size_t>(sent);
        continue;
      }
      if (sent < 0 && (errno == EAGAIN || errno == EINTR)) {
        break;
      }
      close_later(connection);
      return;
    }
    bool pending = connection.out_pos < connection.out.size();
    if (!pending) {
      connection.out.clear();
      connection.out_pos = 0;
    }
    if (pending != connection.writing) {
      connection.writing = pending;
      epoll_event event{};
      event.events = EPOLLIN | EPOLLRDHUP | (pending ? static_cast<uint32_t>(EPOLLOUT) : 0u);
      event.data.u64 = connection.id;
      ::epoll_ctl(epoll, EPOLL_CTL_MOD, connection.fd, &event);
    }
  }

  // Only the connections marked are visited: a pass over every connection
  // after every request made a step of N members cost O(N^2).
  void close_later(Connection& connection) {
    if (!connection.closing) {
      connection.closing = true;
      closing.push_back(connection.id);
    }
  }

  void reap() {
    for (auto id : std::exchange(closing, {})) {
      auto found = connections.find(id);
      if (found == connections.end()) {
        continue;
      }
      auto& connection = *found->second;
      if (connection.slot >= 0) {
        liveness.lost(connection.slot, connection.incarnation, connection.id);
      }
      unpark(connection);
      ::epoll_ctl(epoll, EPOLL_CTL_DEL, connection.fd, nullptr);
      ::close(connection.fd);
      connections.erase(found);
    }
  }
};

StoreServer::StoreServer(ServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

StoreServer::~StoreServer() {
  stop();
}

const Endpoint& StoreServer::endpoint() const {
  return impl_->options.endpoint;
}

void StoreServer::preload(std::map<std::string, std::string> keys) {
  if (thread_.joinable()) {
    throw std::logic_error("StoreServer::preload after start()");
  }
  impl_->data = std::move(keys);
}

void StoreServer::start() {
  thread_ = std::thread([this] { impl_->run(); });
}

void StoreServer::stop() {
  if (!impl_) {
    return;
  }
  impl_->stopping = true;
  uint64_t one = 1;
  [[maybe_unused]] auto written = ::write(impl_->wake, &one, sizeof(one));
  if (thread_.joinable()) {
    thread_.join();
  }
}

} // namespace lockstep::store
