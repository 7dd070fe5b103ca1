#include "options.h"

#include <algorithm>
#include <cstdlib>

namespace lockstep::run {

const char* const kUsage = R"(usage: lockstep-run [options] -- program [args...]

Starts the ranks of a lockstep (or torchrun-compatible) job on this machine
and watches them. Each rank gets RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCKSTEP_RESTART_COUNT.

options:
  --nproc-per-node N   ranks on this machine (default 1)
  --nnodes M           machines in the job (default 1)
  --node-rank K        this machine's index, 0..M-1 (default 0); node K runs
                       ranks K*N .. K*N+N-1
  --master-addr A      address of node 0, whose lockstep-run hosts the
                       job's store (default 127.0.0.1; required when M > 1)
  --master-port P      the store's TCP port (default: a free port when
                       M = 1; required when M > 1)
  --store-successors L where nodes 1, 2, ... serve the store if node 0's
                       is gone ("HOST:PORT,HOST:PORT": node 1's address
                       first), the same on every node: when node 0's host
                       answers that nothing listens on P any more (its
                       lockstep-run died), node 1 takes over at its
                       address, and the ranks write back what they hold
  --job-id ID          the job's id (LOCKSTEP_JOB_ID), the same on every
                       node: a rank of another job given the same address
                       and port is then refused instead of joining this one
  --log-dir D          write each rank's output to D/rank-R.log instead of
                       prefixing its lines with [R] here
  --ranks-filter LIST  show the lines of these ranks only (global ranks,
                       comma-separated: "0" or "0,3"; torchrun's
                       --local-ranks-filter); a rank left out that fails
                       still shows its last 20 lines
  --max-restarts R     after a failure, restart all ranks of this machine,
                       up to R times (default 0)
  --restart WHAT       what a restart restarts: "all" (default: every rank
                       of this machine; the job resumes from its checkpoint)
                       or "rank" (only the rank that failed, up to R times
                       in all, while the others go on: for programs that
                       train with lockstep::FaultTolerance, where it rejoins
                       and receives the live state; it gets
                       LOCKSTEP_INCARNATION, its restart count)
  --grace S            seconds between SIGTERM and SIGKILL when stopping
                       ranks (default 3)
  -h, --help           this text

When a rank exits with an error or is killed, lockstep-run stops the others
(SIGTERM, then SIGKILL after the grace period), says which rank failed and
how, and exits with code 1 (or restarts, with --max-restarts). SIGINT and
SIGTERM are forwarded to every rank. A bad command line exits with code 2.
)";

namespace {

int parse_int(const std::string& flag, const std::string& text, int min_value) {
  char* end = nullptr;
  long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || value < min_value || value > 1 << 30) {
    throw UsageError(flag + " needs an integer >= " + std::to_string(min_value) +
                     ", got '" + text + "'");
  }
  return static_cast<int>(value);
}

} // namespace

RunOptions parse_options(int argc, char** argv) {
  RunOptions options;
  bool port_given = false;
  bool addr_given = false;
  int i = 1;
  auto value = [&](const std::string& flag) -> std::string {
    if (i + 1 >= argc) {
      throw UsageError(flag + " needs a value");
    }
    return argv[++i];
  };
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      options.help = true;
      return options;
    } else if (arg == "--nproc-per-node") {
      options.nproc_per_node = parse_int(arg, value(arg), 1);
    } else if (arg == "--nnodes") {
      options.nnodes = parse_int(arg, value(arg), 1);
    } else if (arg == "--node-rank") {
      options.node_rank = parse_int(arg, value(arg), 0);
    } else if (arg == "--master-addr") {
      options.master_addr = value(arg);
      addr_given = true;
    } else if (arg == "--master-port") {
      options.master_port = parse_int(arg, value(arg), 1);
      port_given = true;
    } else if (arg == "--store-successors") {
      std::string list = value(arg);
      for (size_t start = 0; start <= list.size();) {
        size_t end = std::min(list.find(',', start), list.size());
        std::string address = list.substr(start, end - start);
        auto colon = address.rfind(':');
        if (colon == std::string::npos || colon == 0) {
          throw UsageError("--store-successors needs HOST:PORT entries, got '" + address + "'");
        }
        int port = parse_int(arg, address.substr(colon + 1), 1);
        if (port > 65535) {
          throw UsageError("--store-successors: " + address + " has no TCP port (1 to 65535)");
        }
        options.store_successors.push_back(address);
        start = end + 1;
      }
    } else if (arg == "--job-id") {
      options.job_id = value(arg);
    } else if (arg == "--log-dir") {
      options.log_dir = value(arg);
    } else if (arg == "--ranks-filter") {
      std::string list = value(arg);
      for (size_t start = 0; start <= list.size();) {
        size_t end = std::min(list.find(',', start), list.size());
        options.shown_ranks.push_back(parse_int(arg, list.substr(start, end - start), 0));
        start = end + 1;
      }
    } else if (arg == "--max-restarts") {
      options.max_restarts = parse_int(arg, value(arg), 0);
    } else if (arg == "--restart") {
      std::string what = value(arg);
      if (what != "all" && what != "rank") {
        throw UsageError("--restart needs \"all\" or \"rank\", got '" + what + "'");
      }
      options.restart_rank = what == "rank";
    } else if (arg == "--grace") {
      options.grace_seconds = parse_int(arg, value(arg), 0);
    } else {
      throw UsageError("unknown option '" + arg + "'");
    }
  }
  for (; i < argc; ++i) {
    options.command.emplace_back(argv[i]);
  }
  if (options.command.empty()) {
    throw UsageError("no program to run: put it after --");
  }
  if (options.master_port > 65535) {
    throw UsageError("--master-port must be a TCP port (1 to 65535)");
  }
  for (int rank : options.shown_ranks) {
    if (rank >= options.nnodes * options.nproc_per_node) {
      throw UsageError("--ranks-filter names rank " + std::to_string(rank) + ", but the job has " +
                       std::to_string(options.nnodes * options.nproc_per_node) + " ranks");
    }
  }
  if (options.node_rank >= options.nnodes) {
    throw UsageError("--node-rank " + std::to_string(options.node_rank) +
                     " is out of range for --nnodes " +
                     std::to_string(options.nnodes));
  }
  if (!options.store_successors.empty() && options.nnodes == 1) {
    throw UsageError("--store-successors needs --nnodes > 1: the store of a job on one host "
                     "has no other host to move to");
  }
  if (static_cast<int>(options.store_successors.size()) >= options.nnodes) {
    throw UsageError("--store-successors names " +
                     std::to_string(options.store_successors.size()) + " addresses, but only "
                     "nodes 1 to " + std::to_string(options.nnodes - 1) + " can take over the "
                     "store (--nnodes " + std::to_string(options.nnodes) + ")");
  }
  if (options.nnodes > 1 && (!port_given || !addr_given)) {
    throw UsageError("--nnodes > 1 needs --master-addr and --master-port "
                     "(node 0's address and a port free there), the same "
                     "on every node");
  }
  return options;
}

} // namespace lockstep::run
