#pragma once

// Where a job store listens: a Unix socket in a folder only its user can
// enter (a job on one host: no socket another machine can reach), or a TCP
// address (a job across hosts).

#include <chrono>
#include <string>
#include <vector>

namespace lockstep::store {

struct Endpoint {
  enum class Kind { Unix, Tcp } kind = Kind::Unix;
  std::string path;  // Unix
  std::string host;  // Tcp
  int port = 0;      // Tcp; 0 to listen on a free port
  /// The job's secret, or "": a client proves that it holds it on
  /// connecting (never sending it). Not part of to_string(), which may be
  /// printed and is passed to other processes.
  std::string secret;
  /// Where the job's store is served once this one is gone, in order
  /// (lockstep-run --store-successors: node 1's address, then node 2's):
  /// a client whose store closed its connection, or refuses, tries them.
  /// Part of to_string(), after commas.
  std::vector<Endpoint> successors;

  static Endpoint unix_socket(std::string path);
  static Endpoint tcp(std::string host, int port);
  /// "unix:PATH" or "tcp:HOST:PORT", then its successors after commas
  /// ("tcp:A:P,tcp:B:Q"), as to_string() writes it; throws
  /// std::invalid_argument otherwise.
  static Endpoint parse(const std::string& text);
  std::string to_string() const;
  /// For messages: the path, or "host:port" (of this one, not of its
  /// successors).
  std::string describe() const;
  /// This one and its successors, in order, each with the secret.
  std::vector<Endpoint> candidates() const;
};

/// What one connection attempt says of whoever is at an endpoint.
enum class Presence {
  /// Something listens (whether a store or not, the caller asks it).
  Listening,
  /// Its host answers that nothing listens there: whatever served there is
  /// gone (not merely out of reach).
  Refused,
  /// No answer within the time given (a host that is down, or cut off: the
  /// two cannot be told apart from here).
  Silent,
};

/// One connection attempt to `endpoint`, closed at once, within `within`.
Presence presence(const Endpoint& endpoint, std::chrono::milliseconds within);

/// A listening socket (non-blocking, close-on-exec). A Unix endpoint's old
/// socket file is replaced; a TCP one binds `host` (every interface when
/// empty) and, with port 0, a free port, written back into `endpoint`.
/// Returns -1 and sets `error` on failure.
int listen_on(Endpoint& endpoint, std::string& error);

/// `port` on loopback, listened on (close-on-exec) so that no other socket
/// can bind it while this process runs, and never reachable from another
/// machine: a job on one host holds its port so. Returns -1 and sets
/// `error` ("bind 127.0.0.1:P: <cause>") on failure.
int hold_loopback_port(int port, std::string& error);

/// A connected socket (blocking, close-on-exec), retried while nothing
/// listens yet until `deadline` (once only, without `retry`: a store that
/// was reached before and refuses now is gone); -1 and `error` (the last
/// cause) after it.
int connect_to(const Endpoint& endpoint,
               std::chrono::steady_clock::time_point deadline,
               std::string& error,
               bool retry = true);

} // namespace lockstep::store
