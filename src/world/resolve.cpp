#include "world/resolve.h"

#include "store/endpoint.h"
#include "world/job_keys.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <vector>

#include <lockstep/error.h>

namespace lockstep::detail {
namespace {

// One family of variables that a launcher sets. The first family that has a
// rank or a size decides both: mixing RANK from torchrun with SLURM_NTASKS
// from the allocation around it would form a wrong world.
struct LauncherVariables {
  const char* source;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;
};

constexpr LauncherVariables kLaunchers[] = {
    {"RANK/WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"OpenMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"SLURM", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
     "SLURM_NTASKS_PER_NODE"},
};

// A value with the name it was read from, for error messages.
struct Setting {
  std::string name;
  std::string text;
};

std::optional<Setting> lookup(const EnvLookup& env, const char* name) {
  auto value = env(name);
  if (!value) {
    return std::nullopt;
  }
  return Setting{name, *value};
}

int parse_int(const Setting& setting, int min_value, const char* meaning) {
  const std::string& text = setting.text;
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(text.c_str(), &end, 10);
  bool numeric = !text.empty() && end == text.c_str() + text.size() &&
      errno == 0 && value >= INT32_MIN && value <= INT32_MAX;
  LOCKSTEP_ENFORCE(
      numeric, ConfigError, setting.name, "='", text,
      "' is not an integer; it must be ", meaning, ".");
  LOCKSTEP_ENFORCE(
      value >= min_value, ConfigError, setting.name, "=", value,
      " is out of range; it must be ", meaning, ".");
  return static_cast<int>(value);
}

// SLURM_NTASKS_PER_NODE looks like "4" or "4(x2)"; only the leading count
// matters for this node.
std::optional<Setting> leading_count(std::optional<Setting> setting) {
  if (setting) {
    auto digits = setting->text.find_first_not_of("0123456789");
    if (digits != std::string::npos && digits > 0) {
      setting->text.resize(digits);
    }
  }
  return setting;
}

int resolve_int(
    const std::optional<int>& option,
    const char* option_name,
    const std::optional<Setting>& setting,
    int min_value,
    const char* meaning,
    int fallback) {
  if (option) {
    return parse_int({option_name, std::to_string(*option)}, min_value,
                     meaning);
  }
  if (setting) {
    return parse_int(*setting, min_value, meaning);
  }
  return fallback;
}

std::chrono::milliseconds resolve_timeout(
    const WorldOptions& options,
    const EnvLookup& env) {
  if (options.timeout()) {
    LOCKSTEP_ENFORCE(
        options.timeout()->count() > 0, ConfigError,
        "WorldOptions::timeout must be positive, got ",
        options.timeout()->count(), " ms.");
    return *options.timeout();
  }
  auto setting = lookup(env, "LOCKSTEP_TIMEOUT");
  if (!setting) {
    return kDefaultTimeout;
  }
  char* end = nullptr;
  double seconds = std::strtod(setting->text.c_str(), &end);
  bool valid = !setting->text.empty() &&
      end == setting->text.c_str() + setting->text.size() &&
      std::isfinite(seconds) && seconds > 0;
  LOCKSTEP_ENFORCE(
      valid, ConfigError, "LOCKSTEP_TIMEOUT='", setting->text,
      "' is not a positive number of seconds (for example 300 or 0.5).");
  return std::chrono::milliseconds(
      static_cast<long long>(std::ceil(seconds * 1000.0)));
}

DebugLevel resolve_debug(const WorldOptions& options, const EnvLookup& env) {
  if (options.debug()) {
    return *options.debug();
  }
  auto setting = lookup(env, "LOCKSTEP_DEBUG");
  std::string level = setting ? setting->text : "OFF";
  if (level == "OFF" || level.empty()) {
    return DebugLevel::Off;
  }
  if (level == "INFO") {
    return DebugLevel::Info;
  }
  LOCKSTEP_ENFORCE(
      level == "DETAIL", ConfigError, "LOCKSTEP_DEBUG='", level,
      "' is not a debug level; use OFF, INFO or DETAIL.");
  return DebugLevel::Detail;
}

std::string resolve_job_id(const WorldOptions& options, const EnvLookup& env) {
  std::string job = "default";
  if (options.job_id()) {
    job = *options.job_id();
  } else if (auto id = env("LOCKSTEP_JOB_ID")) {
    job = *id;
  } else if (auto id = env("TORCHELASTIC_RUN_ID")) {
    job = *id;
  }
  LOCKSTEP_ENFORCE(
      !job.empty() && job.find_first_of(" /\n") == std::string::npos, ConfigError,
      "the job id '", job, "' (LOCKSTEP_JOB_ID, WorldOptions::job_id or "
      "TORCHELASTIC_RUN_ID) must be a non-empty word without spaces or '/'.");
  return job;
}

std::string resolve_job_prefix(const std::string& job, const EnvLookup& env) {
  // A restarted job reuses the agent's store; the restart count keeps the
  // previous attempt's keys from being mistaken for this one's.
  std::string attempt = "0";
  if (auto count = env("LOCKSTEP_RESTART_COUNT")) {
    attempt = *count;
  } else if (auto count = env("TORCHELASTIC_RESTART_COUNT")) {
    attempt = *count;
  }
  // PrefixStore adds the "/" between this prefix and each key.
  return job_key_prefix(job, attempt);
}

TransportKind resolve_transport(const WorldOptions& options, const EnvLookup& env) {
  if (options.transport()) {
    return *options.transport();
  }
  std::string choice = env("LOCKSTEP_TRANSPORT").value_or("auto");
  if (choice == "auto" || choice.empty()) {
    return TransportKind::Auto;
  }
  if (choice == "gloo") {
    return TransportKind::Gloo;
  }
  LOCKSTEP_ENFORCE(choice == "shm", ConfigError, "LOCKSTEP_TRANSPORT='", choice,
                   "' is not a transport; use auto, gloo or shm.");
  return TransportKind::SharedMemory;
}

// A job on one host meets in a file store, which opens no socket; torchrun's
// agent has its own store, which the ranks must use.
WorldConfig::StoreKind resolve_store(const EnvLookup& env, const WorldConfig& config) {
  using StoreKind = WorldConfig::StoreKind;
  std::string choice = env("LOCKSTEP_STORE").value_or("auto");
  if (choice == "auto" || choice.empty()) {
    return config.single_host && !config.agent_store ? StoreKind::File : StoreKind::Tcp;
  }
  if (choice == "tcp") {
    return StoreKind::Tcp;
  }
  LOCKSTEP_ENFORCE(
      choice == "file", ConfigError, "LOCKSTEP_STORE='", choice,
      "' is not a store kind; use auto, tcp or file.");
  LOCKSTEP_ENFORCE(
      config.single_host && !config.agent_store, ConfigError,
      "LOCKSTEP_STORE=file needs every rank on this host (MASTER_ADDR a loopback "
      "address, or LOCAL_WORLD_SIZE equal to WORLD_SIZE) and a store of lockstep's own "
      "(not torchrun's agent).");
  return StoreKind::File;
}

} // namespace

EnvLookup process_environment() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) {
      return std::nullopt;
    }
    return std::string(value);
  };
}

WorldConfig resolve_world(const WorldOptions& options, const EnvLookup& env) {
  WorldConfig config;

  const LauncherVariables* launcher = nullptr;
  if (options.rank() || options.size()) {
    config.source = "options";
  } else {
    for (const auto& candidate : kLaunchers) {
      if (env(candidate.rank) || env(candidate.size)) {
        launcher = &candidate;
        config.source = candidate.source;
        break;
      }
    }
  }
  if (config.source.empty()) {
    config.source = "single process";
  }

  auto env_setting = [&](const char* LauncherVariables::*field)
      -> std::optional<Setting> {
    if (launcher == nullptr) {
      return std::nullopt;
    }
    return lookup(env, launcher->*field);
  };
  const char* rank_name = launcher ? launcher->rank : "WorldOptions::rank";
  const char* size_name = launcher ? launcher->size : "WorldOptions::size";

  auto rank_setting = env_setting(&LauncherVariables::rank);
  auto size_setting = env_setting(&LauncherVariables::size);
  bool has_rank = options.rank() || rank_setting;
  bool has_size = options.size() || size_setting;
  LOCKSTEP_ENFORCE(
      !has_rank || has_size, ConfigError, rank_name,
      " is set but ", size_name, " is not; set ", size_name,
      " to the number of processes in the job (or unset ", rank_name,
      " to run a single process).");
  LOCKSTEP_ENFORCE(
      has_rank || !has_size, ConfigError, size_name,
      " is set but ", rank_name, " is not; every process needs its own ",
      rank_name, " from 0 to ", size_name, "-1 (a launcher such as "
      "lockstep-run sets both).");

  config.size = resolve_int(options.size(), "WorldOptions::size",
                            size_setting, 1, "a positive process count", 1);
  config.rank = resolve_int(options.rank(), "WorldOptions::rank",
                            rank_setting, 0, "a non-negative rank", 0);
  LOCKSTEP_ENFORCE(
      config.rank < config.size, ConfigError, rank_name, "=", config.rank,
      " is out of range for ", size_name, "=", config.size,
      "; ranks go from 0 to ", config.size - 1, ".");

  auto local_size_setting = env_setting(&LauncherVariables::local_size);
  if (launcher != nullptr && std::string(launcher->source) == "SLURM") {
    local_size_setting = leading_count(local_size_setting);
  }
  // Without local information, assume one machine: every rank is local.
  config.local_size = resolve_int(
      options.local_size(), "WorldOptions::local_size", local_size_setting, 1,
      "a positive process count", config.size);
  config.local_rank = resolve_int(
      options.local_rank(), "WorldOptions::local_rank",
      env_setting(&LauncherVariables::local_rank), 0, "a non-negative rank",
      config.size == config.local_size ? config.rank : 0);
  LOCKSTEP_ENFORCE(
      config.local_rank < config.local_size, ConfigError,
      "the local rank ", config.local_rank,
      " is out of range for the local size ", config.local_size,
      "; check LOCAL_RANK and LOCAL_WORLD_SIZE (or the launcher's "
      "equivalents).");
  LOCKSTEP_ENFORCE(
      config.local_size <= config.size, ConfigError, "the local size ",
      config.local_size, " is larger than the world size ", config.size, ".");

  config.timeout = resolve_timeout(options, env);
  config.debug = resolve_debug(options, env);
  config.transport = resolve_transport(options, env);
  config.job_id = resolve_job_id(options, env);
  config.key_prefix = resolve_job_prefix(config.job_id, env);
  config.secret = options.secret().value_or(env("LOCKSTEP_JOB_SECRET").value_or(""));
  if (auto incarnation = lookup(env, "LOCKSTEP_INCARNATION")) {
    config.incarnation = parse_int(*incarnation, 0, "a restart count, 0 or more");
  }
  config.standby = config.incarnation > 0 && config.size > 1;
  if (config.size == 1) {
    config.single_host = true;
    return config;
  }

  auto addr = options.master_addr()
      ? std::optional<Setting>(
            Setting{"WorldOptions::master_addr", *options.master_addr()})
      : lookup(env, "MASTER_ADDR");
  auto port = options.master_port()
      ? std::optional<Setting>(Setting{"WorldOptions::master_port",
                                       std::to_string(*options.master_port())})
      : lookup(env, "MASTER_PORT");
  LOCKSTEP_ENFORCE(
      addr && !addr->text.empty() && port, ConfigError, size_name, "=",
      config.size, " needs MASTER_ADDR and MASTER_PORT: the address and "
      "port of the store that rank 0 hosts. Set MASTER_ADDR (127.0.0.1 on "
      "one machine, rank 0's host name otherwise) and MASTER_PORT (a free "
      "TCP port, the same on every rank), or start the job with "
      "lockstep-run, which sets them.");
  config.master_addr = addr->text;
  config.master_port =
      parse_int(*port, 1, "a TCP port from 1 to 65535 (the same on every rank)");
  LOCKSTEP_ENFORCE(
      config.master_port <= 65535, ConfigError, port->name, "=",
      config.master_port, " is out of range; it must be a TCP port from 1 "
      "to 65535 (the same on every rank).");

  auto agent = env("TORCHELASTIC_USE_AGENT_STORE");
  config.agent_store = launcher != nullptr && agent &&
      (*agent == "True" || *agent == "true" || *agent == "1");
  bool local_known = options.local_size() || env_setting(&LauncherVariables::local_size);
  config.single_host = is_loopback_name(config.master_addr) ||
      (local_known && config.local_size == config.size);
  config.store = resolve_store(env, config);
  if (auto endpoint = env("LOCKSTEP_STORE_ENDPOINT"); endpoint && !endpoint->empty()) {
    try {
      store::Endpoint::parse(*endpoint);
    } catch (const std::invalid_argument& e) {
      LOCKSTEP_FAIL(ConfigError, "LOCKSTEP_STORE_ENDPOINT=", e.what(), "; lockstep-run sets it "
                    "for the ranks it starts: leave it unset otherwise.");
    }
    config.store_endpoint = *endpoint;
  }
  return config;
}

bool is_loopback_name(const std::string& address) {
  return address == "localhost" || address == "::1" || address == "[::1]" ||
      address.rfind("127.", 0) == 0;
}

} // namespace lockstep::detail
