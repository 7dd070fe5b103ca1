// Every way the configuration can be given, and every way it can be wrong.
// Pure parsing: the environment is a map, so no process or socket is needed.

#include <map>

#include <gtest/gtest.h>

#include <lockstep/error.h>

#include "support/expect_error.h"
#include "world/rendezvous.h"
#include "world/resolve.h"

namespace lockstep::detail {
namespace {

using Env = std::map<std::string, std::string>;

WorldConfig resolve(const Env& env, const WorldOptions& options = {}) {
  return resolve_world(options, [&](const std::string& name) {
    auto it = env.find(name);
    return it == env.end() ? std::nullopt
                           : std::optional<std::string>(it->second);
  });
}

void expect_config_error(
    const Env& env,
    std::initializer_list<std::string> fragments,
    const WorldOptions& options = {}) {
  testing::expect_error<ConfigError>([&] { resolve(env, options); }, fragments);
}

const Env kTorchrun{{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                    {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.1"},
                    {"MASTER_PORT", "29500"}};

TEST(Resolve, NothingSetIsASingleProcess) {
  auto config = resolve({});
  EXPECT_EQ(config.rank, 0);
  EXPECT_EQ(config.size, 1);
  EXPECT_EQ(config.local_rank, 0);
  EXPECT_EQ(config.local_size, 1);
  EXPECT_EQ(config.source, "single process");
  EXPECT_EQ(config.timeout, std::chrono::minutes(5));
  EXPECT_FALSE(config.agent_store);
}

TEST(Resolve, TorchrunVariables) {
  auto config = resolve(kTorchrun);
  EXPECT_EQ(config.source, "RANK/WORLD_SIZE");
  EXPECT_EQ(config.rank, 1);
  EXPECT_EQ(config.size, 4);
  EXPECT_EQ(config.local_rank, 1);
  EXPECT_EQ(config.local_size, 2);
  EXPECT_EQ(config.master_addr, "10.0.0.1");
  EXPECT_EQ(config.master_port, 29500);
  EXPECT_EQ(config.key_prefix, "lockstep/default/0");
}

TEST(Resolve, AgentStoreAndRestartScopeTheKeys) {
  Env env = kTorchrun;
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["TORCHELASTIC_RUN_ID"] = "job7";
  env["TORCHELASTIC_RESTART_COUNT"] = "2";
  auto config = resolve(env);
  EXPECT_TRUE(config.agent_store);
  EXPECT_EQ(config.key_prefix, "lockstep/job7/2");
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  EXPECT_FALSE(resolve(env).agent_store);
}

TEST(Resolve, OptionsComeBeforeEnvironment) {
  auto options = WorldOptions()
                     .rank(0)
                     .size(2)
                     .master_addr("127.0.0.1")
                     .master_port(1234)
                     .timeout(std::chrono::milliseconds(1500))
                     .job_id("mine");
  auto config = resolve(kTorchrun, options);
  EXPECT_EQ(config.source, "options");
  EXPECT_EQ(config.rank, 0);
  EXPECT_EQ(config.size, 2);
  EXPECT_EQ(config.local_rank, 0); // not torchrun's: options chose the world
  EXPECT_EQ(config.local_size, 2);
  EXPECT_EQ(config.master_addr, "127.0.0.1");
  EXPECT_EQ(config.master_port, 1234);
  EXPECT_EQ(config.timeout, std::chrono::milliseconds(1500));
  EXPECT_EQ(config.key_prefix, "lockstep/mine/0");
}

TEST(Resolve, OpenMpiVariables) {
  auto config = resolve({{"OMPI_COMM_WORLD_RANK", "3"},
                         {"OMPI_COMM_WORLD_SIZE", "4"},
                         {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                         {"MASTER_ADDR", "node0"},
                         {"MASTER_PORT", "4000"}});
  EXPECT_EQ(config.source, "OpenMPI");
  EXPECT_EQ(config.rank, 3);
  EXPECT_EQ(config.size, 4);
  EXPECT_EQ(config.local_rank, 1);
  EXPECT_EQ(config.local_size, 2);
}

TEST(Resolve, SlurmVariables) {
  auto config = resolve({{"SLURM_PROCID", "5"},
                         {"SLURM_NTASKS", "8"},
                         {"SLURM_LOCALID", "1"},
                         {"SLURM_NTASKS_PER_NODE", "4(x2)"},
                         {"MASTER_ADDR", "node0"},
                         {"MASTER_PORT", "4000"}});
  EXPECT_EQ(config.source, "SLURM");
  EXPECT_EQ(config.rank, 5);
  EXPECT_EQ(config.size, 8);
  EXPECT_EQ(config.local_rank, 1);
  EXPECT_EQ(config.local_size, 4);
}

TEST(Resolve, TorchrunInsideSlurmUsesTorchrunsWorld) {
  Env env = kTorchrun;
  env["SLURM_PROCID"] = "0";
  env["SLURM_NTASKS"] = "1";
  auto config = resolve(env);
  EXPECT_EQ(config.source, "RANK/WORLD_SIZE");
  EXPECT_EQ(config.size, 4);
}

TEST(Resolve, TimeoutFromEnvironment) {
  EXPECT_EQ(resolve({{"LOCKSTEP_TIMEOUT", "30"}}).timeout,
            std::chrono::seconds(30));
  EXPECT_EQ(resolve({{"LOCKSTEP_TIMEOUT", "0.25"}}).timeout,
            std::chrono::milliseconds(250));
}

TEST(Resolve, DebugLevelFromOptionsThenEnvironment) {
  EXPECT_EQ(resolve({}).debug, DebugLevel::Off);
  EXPECT_EQ(resolve({{"LOCKSTEP_DEBUG", "INFO"}}).debug, DebugLevel::Info);
  EXPECT_EQ(resolve({{"LOCKSTEP_DEBUG", "DETAIL"}}).debug, DebugLevel::Detail);
  EXPECT_EQ(resolve({{"LOCKSTEP_DEBUG", "DETAIL"}}, WorldOptions().debug(DebugLevel::Off)).debug,
            DebugLevel::Off);
}

TEST(ResolveErrors, RankOutOfRange) {
  Env env = kTorchrun;
  env["RANK"] = "4";
  expect_config_error(env, {"RANK=4", "WORLD_SIZE=4", "0 to 3"});
}

TEST(ResolveErrors, NegativeRank) {
  Env env = kTorchrun;
  env["RANK"] = "-1";
  expect_config_error(env, {"RANK=-1", "non-negative"});
}

TEST(ResolveErrors, NonNumericWorldSize) {
  Env env = kTorchrun;
  env["WORLD_SIZE"] = "two";
  expect_config_error(env, {"WORLD_SIZE='two'", "not an integer"});
}

TEST(ResolveErrors, ZeroWorldSize) {
  Env env = kTorchrun;
  env["WORLD_SIZE"] = "0";
  env["RANK"] = "0";
  expect_config_error(env, {"WORLD_SIZE=0", "positive"});
}

TEST(ResolveErrors, RankWithoutWorldSize) {
  expect_config_error({{"RANK", "0"}},
                      {"RANK is set but WORLD_SIZE is not", "set WORLD_SIZE"});
}

TEST(ResolveErrors, WorldSizeWithoutRank) {
  expect_config_error({{"WORLD_SIZE", "2"}},
                      {"WORLD_SIZE is set but RANK is not"});
}

TEST(ResolveErrors, MissingMasterAddress) {
  Env env = kTorchrun;
  env.erase("MASTER_ADDR");
  expect_config_error(env, {"WORLD_SIZE=4", "MASTER_ADDR", "MASTER_PORT"});
}

TEST(ResolveErrors, MissingMasterPort) {
  Env env = kTorchrun;
  env.erase("MASTER_PORT");
  expect_config_error(env, {"needs MASTER_ADDR and MASTER_PORT"});
}

TEST(ResolveErrors, BadMasterPort) {
  Env env = kTorchrun;
  env["MASTER_PORT"] = "http";
  expect_config_error(env, {"MASTER_PORT='http'", "TCP port"});
  env["MASTER_PORT"] = "70000";
  expect_config_error(env, {"MASTER_PORT=70000", "1 to 65535"});
}

TEST(ResolveErrors, LocalRankOutOfRange) {
  Env env = kTorchrun;
  env["LOCAL_RANK"] = "2";
  expect_config_error(env, {"local rank 2", "local size 2", "LOCAL_RANK"});
}

TEST(ResolveErrors, BadTimeout) {
  expect_config_error({{"LOCKSTEP_TIMEOUT", "soon"}},
                      {"LOCKSTEP_TIMEOUT='soon'", "seconds"});
  expect_config_error({{"LOCKSTEP_TIMEOUT", "-3"}}, {"LOCKSTEP_TIMEOUT='-3'"});
}

TEST(ResolveErrors, BadDebugLevel) {
  expect_config_error({{"LOCKSTEP_DEBUG", "LOUD"}},
                      {"LOCKSTEP_DEBUG='LOUD' is not a debug level; use OFF, INFO or DETAIL."});
}

TEST(ResolveErrors, BadOptions) {
  expect_config_error({}, {"WorldOptions::rank=3", "WorldOptions::size=2"},
                      WorldOptions().rank(3).size(2));
  expect_config_error({}, {"WorldOptions::rank is set but WorldOptions::size"},
                      WorldOptions().rank(0));
}

TEST(Resolve, AJobOnOneHostMeetsInAFileStore) {
  using StoreKind = WorldConfig::StoreKind;
  Env one_host{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
               {"MASTER_PORT", "29500"}};
  EXPECT_EQ(resolve(one_host).store, StoreKind::File);
  EXPECT_TRUE(resolve(one_host).single_host);
  one_host["MASTER_ADDR"] = "localhost";
  EXPECT_EQ(resolve(one_host).store, StoreKind::File);
  // The launcher says every rank is local, whatever the address.
  EXPECT_EQ(resolve(Env{kTorchrun}).store, StoreKind::Tcp);
  Env all_local = kTorchrun;
  all_local["LOCAL_WORLD_SIZE"] = "4";
  EXPECT_EQ(resolve(all_local).store, StoreKind::File);
  // Without local information and a remote address: maybe several hosts.
  Env unknown{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.1"},
              {"MASTER_PORT", "29500"}};
  EXPECT_EQ(resolve(unknown).store, StoreKind::Tcp);
  EXPECT_FALSE(resolve(unknown).single_host);
  // torchrun's agent hosts a store of its own.
  Env agent = one_host;
  agent["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  EXPECT_EQ(resolve(agent).store, StoreKind::Tcp);
  Env forced = one_host;
  forced["LOCKSTEP_STORE"] = "tcp";
  EXPECT_EQ(resolve(forced).store, StoreKind::Tcp);
}

TEST(ResolveErrors, BadStoreKind) {
  Env env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.1"},
          {"MASTER_PORT", "29500"}, {"LOCKSTEP_STORE", "redis"}};
  expect_config_error(env, {"LOCKSTEP_STORE='redis' is not a store kind; use auto, tcp or file."});
  env["LOCKSTEP_STORE"] = "file";
  expect_config_error(env, {"LOCKSTEP_STORE=file needs every rank on this host"});
}

TEST(ResolveErrors, BadJobId) {
  expect_config_error({{"LOCKSTEP_JOB_ID", "my job"}},
                      {"the job id 'my job'", "must be a non-empty word without spaces or '/'"});
}

TEST(Resolve, TheSecretComesFromTheOptionOrTheEnvironment) {
  EXPECT_EQ(resolve({}).secret, "");
  EXPECT_EQ(resolve({{"LOCKSTEP_JOB_SECRET", "abc"}}).secret, "abc");
  EXPECT_EQ(resolve({{"LOCKSTEP_JOB_SECRET", "abc"}}, WorldOptions().secret("xyz")).secret,
            "xyz");
}

TEST(RankList, ConsecutiveRanksBecomeRanges) {
  EXPECT_EQ(rank_list({}), "none");
  EXPECT_EQ(rank_list({0, 1}), "0, 1");
  EXPECT_EQ(rank_list({0, 2, 3, 4, 7}), "0, 2–4, 7");
  std::vector<int> many;
  for (int rank = 1; rank < 3000; ++rank) {
    many.push_back(rank);
  }
  EXPECT_EQ(rank_list(many), "1–2999");
}

} // namespace
} // namespace lockstep::detail
