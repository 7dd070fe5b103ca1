#include "supervisor.h"

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <map>

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <iostream>
#include <string>
#include <vector>

#include "fault/membership.h"

extern char** environ;

namespace lockstep::run {
namespace {

using Clock = std::chrono::steady_clock;

int signal_pipe[2] = {-1, -1};

void on_signal(int signo) {
  unsigned char byte = static_cast<unsigned char>(signo);
  [[maybe_unused]] auto written = ::write(signal_pipe[1], &byte, 1);
}

struct Rank {
  int global = 0;
  pid_t pid = -1;
  int output = -1; // read end of the rank's stdout+stderr
  int log = -1; // with --log-dir
  std::string partial; // a line not yet ended
  bool running = false;
  int status = 0;
  int incarnation = 0; // with --restart rank: restarts of this rank alone
  bool hidden = false; // left out by --ranks-filter: its last lines are kept instead
  std::deque<std::string> last_lines;
};

constexpr size_t kLinesKeptOfHiddenRanks = 20;

// What a hidden rank that failed last said: its failure would mean little
// without it.
void show_last_lines(Rank& rank) {
  for (const auto& line : rank.last_lines) {
    std::string prefixed = "[" + std::to_string(rank.global) + "] " + line;
    [[maybe_unused]] auto written = ::write(STDOUT_FILENO, prefixed.data(), prefixed.size());
  }
  rank.last_lines.clear();
}

void say(const std::string& line) {
  std::cerr << "lockstep-run: " << line << std::endl;
}

std::string describe_exit(int status) {
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT) {
    // What std::terminate does after an exception nobody caught.
    return "was aborted (signal 6, SIGABRT), most likely by an uncaught exception: its "
           "message (\"terminate called after throwing ...\") is in the rank's output above";
  }
  if (WIFSIGNALED(status)) {
    int signo = WTERMSIG(status);
    return "was killed by signal " + std::to_string(signo) + " (" +
        ::strsignal(signo) + ")";
  }
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

// Like torchrun: ranks that share a machine each get one intra-op thread
// unless the user says otherwise, or N ranks x all cores of threads fight.
bool set_omp_threads(const RunOptions& options) {
  const char* threads = std::getenv("OMP_NUM_THREADS");
  return options.nproc_per_node > 1 && (threads == nullptr || *threads == '\0');
}

bool failed(int status) {
  return WIFSIGNALED(status) || WEXITSTATUS(status) != 0;
}

void spawn(Rank& rank, const RunOptions& options, int local, int attempt, int port,
           const std::string& store_endpoint) {
  int world = options.nnodes * options.nproc_per_node;
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    env.emplace_back(*entry);
  }
  // Replaces an inherited value: getenv() would find the first of two.
  auto set = [&](const std::string& name, const std::string& value) {
    env.erase(std::remove_if(env.begin(), env.end(),
                             [&](const std::string& entry) {
                               return entry.compare(0, name.size() + 1, name + "=") == 0;
                             }),
              env.end());
    env.push_back(name + "=" + value);
  };
  set("RANK", std::to_string(rank.global));
  set("WORLD_SIZE", std::to_string(world));
  set("LOCAL_RANK", std::to_string(local));
  set("LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node));
  set("GROUP_RANK", std::to_string(options.node_rank));
  set("MASTER_ADDR", options.master_addr);
  set("MASTER_PORT", std::to_string(port));
  set("LOCKSTEP_RESTART_COUNT", std::to_string(attempt));
  set("LOCKSTEP_STORE_ENDPOINT", store_endpoint);
  if (options.restart_rank) {
    set("LOCKSTEP_INCARNATION", std::to_string(rank.incarnation));
  }
  if (set_omp_threads(options)) {
    set("OMP_NUM_THREADS", "1");
  }
  if (!options.job_id.empty()) {
    set("LOCKSTEP_JOB_ID", options.job_id);
  }
  std::vector<char*> envp;
  for (auto& entry : env) {
    envp.push_back(entry.data());
  }
  envp.push_back(nullptr);
  std::vector<std::string> args = options.command;
  std::vector<char*> argv;
  for (auto& arg : args) {
    argv.push_back(arg.data());
  }
  argv.push_back(nullptr);

  int pipe_fds[2];
  if (rank.output >= 0) {
    ::close(rank.output); // a restarted rank's predecessor's, drained
  }
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
    throw std::runtime_error("pipe failed");
  }
  // Until the child has restored the default handlers, a SIGTERM meant for
  // it would run our handler there and look like one sent to us.
  sigset_t forwarded, previous;
  ::sigemptyset(&forwarded);
  ::sigaddset(&forwarded, SIGINT);
  ::sigaddset(&forwarded, SIGTERM);
  ::sigprocmask(SIG_BLOCK, &forwarded, &previous);
  pid_t launcher = ::getpid();
  rank.pid = ::fork();
  if (rank.pid == 0) {
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    // A rank dies with its launcher: killing a node's launcher stops that
    // node's part of the job instead of leaving orphans.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != launcher) {
      ::_exit(1); // the launcher died before the request took hold
    }
    // Its own process group, so that stopping a rank stops what it started.
    ::setpgid(0, 0);
    ::dup2(pipe_fds[1], STDOUT_FILENO);
    ::dup2(pipe_fds[1], STDERR_FILENO);
    ::execvpe(argv[0], argv.data(), envp.data());
    std::string message = "lockstep-run: cannot run " + args[0] + ": " +
        std::strerror(errno) + "\n";
    [[maybe_unused]] auto written = ::write(STDERR_FILENO, message.data(), message.size());
    ::_exit(127);
  }
  ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  ::setpgid(rank.pid, rank.pid);
  ::close(pipe_fds[1]);
  // Never blocks: a process that a rank left behind may hold the pipe open.
  ::fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
  rank.output = pipe_fds[0];
  rank.running = true;
  if (!options.log_dir.empty() && rank.log < 0) {
    std::string path = options.log_dir + "/rank-" + std::to_string(rank.global) + ".log";
    rank.log = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (rank.log < 0) {
      throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
    }
  }
}

// Writes complete segments: prefixed on our stdout, or as they are to the
// log. A segment ends with a newline or a carriage return (a progress line
// that redraws itself), and each gets the rank's prefix.
void carry(Rank& rank, const char* data, size_t size, bool flush) {
  rank.partial.append(data, size);
  size_t start = 0;
  for (size_t end; (end = rank.partial.find_first_of("\n\r", start)) != std::string::npos ||
       flush;) {
    std::string segment;
    if (end == std::string::npos) {
      if (start == rank.partial.size()) {
        break;
      }
      segment = rank.partial.substr(start) + "\n";
      end = rank.partial.size();
    } else {
      segment = rank.partial.substr(start, end + 1 - start);
    }
    if (rank.log >= 0) {
      [[maybe_unused]] auto written = ::write(rank.log, segment.data(), segment.size());
    } else if (rank.hidden) {
      rank.last_lines.push_back(segment);
      if (rank.last_lines.size() > kLinesKeptOfHiddenRanks) {
        rank.last_lines.pop_front();
      }
    } else {
      std::string prefixed = "[" + std::to_string(rank.global) + "] " + segment;
      [[maybe_unused]] auto written = ::write(STDOUT_FILENO, prefixed.data(), prefixed.size());
    }
    start = end + 1;
    if (start > rank.partial.size()) {
      break;
    }
  }
  rank.partial.erase(0, std::min(start, rank.partial.size()));
}

// Carries what a rank that ended left in its pipe, and its last line.
void drain(Rank& rank) {
  if (rank.output < 0) {
    return;
  }
  char buffer[65536];
  while (true) {
    ssize_t got = ::read(rank.output, buffer, sizeof(buffer));
    if (got <= 0) {
      break;
    }
    carry(rank, buffer, static_cast<size_t>(got), false);
  }
  carry(rank, "", 0, true);
}

void signal_all(std::vector<Rank>& ranks, int signo) {
  for (auto& rank : ranks) {
    if (rank.running) {
      ::kill(-rank.pid, signo);
    }
  }
}

} // namespace

int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    if (fd >= 0) {
      ::close(fd);
    }
    throw std::runtime_error("cannot find a free port");
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

void install_signal_forwarding() {
  if (::pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw std::runtime_error("pipe failed");
  }
  struct sigaction action {};
  action.sa_handler = on_signal;
  ::sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
}

AttemptResult run_attempt(const RunOptions& options, int attempt, int port,
                          LauncherStore& store) {
  if (!options.log_dir.empty()) {
    ::mkdir(options.log_dir.c_str(), 0755);
  }
  store.begin_attempt(attempt);
  if (attempt == 0 && set_omp_threads(options)) {
    say("OMP_NUM_THREADS is not set: each of the " + std::to_string(options.nproc_per_node) +
        " ranks on this machine gets OMP_NUM_THREADS=1, so that they do not fight over the "
        "cores (as torchrun does); set it to choose another number");
  }
  // Incarnations live with the job, not the launcher: one that finds its
  // node's ranks in the job's store replaces a node the job lost, and its
  // ranks rejoin as their next incarnations (a first incarnation would
  // wait for a rendezvous the others are long past).
  std::map<int, int> known;
  if (options.restart_rank && attempt == 0) {
    known = store.known_incarnations();
  }
  std::vector<Rank> ranks(options.nproc_per_node);
  // So do restart counts: an incarnation is one restart of its slot, so a
  // replacement starts with the budget its predecessors left.
  int restarts = 0; // of single ranks, with --restart rank
  for (int local = 0; local < options.nproc_per_node; ++local) {
    ranks[local].global = options.node_rank * options.nproc_per_node + local;
    if (auto found = known.find(ranks[local].global); found != known.end()) {
      restarts = std::min(restarts + std::max(found->second, 0), 1 << 20);
      ranks[local].incarnation = found->second + 1;
      say("rank " + std::to_string(ranks[local].global) + " is known to the job's store (as "
          "incarnation " + std::to_string(found->second) + "): this launcher replaces its "
          "node, and starts it as incarnation " + std::to_string(ranks[local].incarnation) +
          ", which rejoins the job");
    }
    ranks[local].hidden = !options.shown_ranks.empty() &&
        std::find(options.shown_ranks.begin(), options.shown_ranks.end(),
                  ranks[local].global) == options.shown_ranks.end();
    spawn(ranks[local], options, local, attempt, port, store.endpoint());
  }

  if (restarts > 0) {
    say("the job restarted this node's ranks " + std::to_string(restarts) + " time" +
        (restarts == 1 ? "" : "s") + " before this launcher: " +
        std::to_string(std::max(0, options.max_restarts - restarts)) + " of --max-restarts " +
        std::to_string(options.max_restarts) + " left");
  }
  AttemptResult result;
  // With --restart rank, once a rank has finished, the job is ending: a
  // rank that fails then is not restarted.
  bool finishing = false;
  // Failures that fail the job: a rank that failed and was not restarted
  // (unless it was a restart that found the loop ended, which is no
  // failure). Under --restart rank the others stop only if no rank
  // finishes within the grace period; otherwise at once.
  std::vector<std::string> failures;
  std::optional<std::string> pending_failure;
  Clock::time_point judge_at;
  auto grace = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(options.grace_seconds));
  bool stopping = false;
  Clock::time_point kill_at;
  int running = options.nproc_per_node;
  char buffer[65536];
  while (running > 0) {
    std::vector<pollfd> fds;
    fds.push_back({signal_pipe[0], POLLIN, 0});
    fds.push_back({store.hung_fd(), POLLIN, 0});
    for (auto& rank : ranks) {
      fds.push_back({rank.output, POLLIN, 0});
    }
    ::poll(fds.data(), fds.size(), 50);
    unsigned char signo = 0;
    while (::read(signal_pipe[0], &signo, 1) == 1) {
      say(std::string("got ") + ::strsignal(signo) + ", passing it to every rank");
      signal_all(ranks, signo);
      result = {Outcome::Interrupted, signo};
      if (!stopping) {
        stopping = true;
        kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(options.grace_seconds));
      }
    }
    // A rank that the others judged hung: its heartbeat goes on, its
    // training does not. It is ended (and restarted like any failed rank).
    for (const auto& hung : store.take_hung()) {
      for (auto& rank : ranks) {
        if (rank.running && rank.global == hung.slot && rank.incarnation == hung.incarnation) {
          say("rank " + std::to_string(rank.global) + " was judged hung by the others (" +
              hung.why + "); ending it");
          ::kill(-rank.pid, SIGKILL);
        }
      }
    }
    for (size_t i = 0; i < ranks.size(); ++i) {
      auto& rank = ranks[i];
      if (rank.output < 0 || !(fds[i + 2].revents & (POLLIN | POLLHUP))) {
        continue;
      }
      ssize_t got = ::read(rank.output, buffer, sizeof(buffer));
      if (got > 0) {
        carry(rank, buffer, static_cast<size_t>(got), false);
      } else if (got < 0 && errno == EAGAIN) {
        continue;
      } else {
        carry(rank, "", 0, true);
        ::close(rank.output);
        rank.output = -1;
        fds[i + 2].fd = -1;
      }
    }
    for (auto& rank : ranks) {
      if (!rank.running || ::waitpid(rank.pid, &rank.status, WNOHANG) != rank.pid) {
        continue;
      }
      rank.running = false;
      --running;
      if (!failed(rank.status)) {
        store.rank_finished(); // no store is taken over from here on
        if (options.restart_rank && !finishing) {
          finishing = true;
          store.job_finished(attempt);
        }
        continue;
      }
      bool stopped_by_us = stopping && WIFSIGNALED(rank.status) &&
          (WTERMSIG(rank.status) == SIGTERM || WTERMSIG(rank.status) == SIGKILL);
      // A rank that found the job's loop ended (restarted, or one that
      // dropped a last step the others committed) says so in the store:
      // "left" is no failure; "crashed after the loop" (its earlier
      // incarnation failed after training to the end) fails the job.
      std::optional<std::string> left;
      if (options.restart_rank) {
        left = store.left(attempt, rank.global, rank.incarnation);
      }
      bool nothing_to_rejoin = left && *left == lockstep::detail::kLeft;
      if (rank.hidden && !stopped_by_us && result.outcome != Outcome::Interrupted &&
          !nothing_to_rejoin) {
        drain(rank); // what it said last, shown with its failure
        show_last_lines(rank);
      }
      if (stopping) {
        continue;
      }
      std::string failure = "rank " + std::to_string(rank.global) + " " +
          describe_exit(rank.status);
      if (nothing_to_rejoin) {
        say(failure + " after it found the job's loop ended: nothing to rejoin");
        continue;
      }
      if (left && rank.incarnation > 0) {
        failure = "rank " + std::to_string(rank.global) + " (incarnation " +
            std::to_string(rank.incarnation - 1) + ") failed after the job's loop";
        finishing = true; // the loop is over: nothing is restarted
      }
      if (options.restart_rank && !finishing && restarts < options.max_restarts) {
        ++restarts;
        ++rank.incarnation;
        say(failure + "; restarting it alone (restart " + std::to_string(restarts) + " of " +
            std::to_string(options.max_restarts) + "), the others go on");
        drain(rank);
        spawn(rank, options, static_cast<int>(&rank - ranks.data()), attempt, port,
              store.endpoint());
        ++running;
        continue;
      }
      failures.push_back(failure);
      if (options.restart_rank && !pending_failure) {
        // No restart left, or the job is ending: the others go on, and are
        // stopped only if none finishes within the grace period.
        pending_failure = failure;
        judge_at = Clock::now() + grace;
      } else if (!options.restart_rank) {
        pending_failure = failure;
        judge_at = Clock::now();
      }
    }
    if (pending_failure && finishing) {
      say(*pending_failure + "; the others finish, and the job fails");
      pending_failure.reset();
    }
    if (pending_failure && !stopping && Clock::now() >= judge_at) {
      say(*pending_failure + "; stopping the other ranks");
      pending_failure.reset();
      stopping = true;
      signal_all(ranks, SIGTERM);
      kill_at = Clock::now() + grace;
    }
    if (stopping && running > 0 && Clock::now() >= kill_at) {
      signal_all(ranks, SIGKILL);
    }
  }
  if (pending_failure) { // the last rank to end failed
    say(*pending_failure);
  }
  if (result.outcome != Outcome::Interrupted && !failures.empty()) {
    result = {Outcome::RankFailed, 0};
  }
  for (auto& rank : ranks) {
    drain(rank);
    if (rank.output >= 0) {
      ::close(rank.output);
    }
    if (rank.log >= 0) {
      ::close(rank.log);
    }
  }
  return result;
}

} // namespace lockstep::run
