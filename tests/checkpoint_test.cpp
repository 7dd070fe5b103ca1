// Checkpoints: a round trip restores everything; every kind of bad file is
// an error on every rank that says what is wrong; a crash in the middle of
// a save leaves the previous checkpoint whole.

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "checkpoint/checkpoint_file.h"
#include "support/expect_error.h"
#include "support/models.h"
#include "support/multiprocess.h"
#include "support/scratch_folder.h"
#include "support/shared_folder.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {


void train_step(DDP<Mlp>& ddp, torch::optim::Optimizer& optimizer, int step, int rank, int n) {
  auto [x, y] = global_batch(step, 4 * n, {20});
  optimizer.zero_grad();
  torch::mse_loss(ddp(x.narrow(0, 4 * rank, 4)), y.narrow(0, 4 * rank, 4)).backward();
  optimizer.step();
}

TEST(Checkpoint, RoundTripRestoresModelOptimizerExtraAndRandomState) {
  ScratchFolder folder("checkpoint");
  auto result = launch_ranks(with_shared_folder(2, folder.path()), [](int rank) {
    World world = init();
    for (auto read : {CheckpointRead::EveryRank, CheckpointRead::RankZeroBroadcasts}) {
      torch::manual_seed(1);
      Mlp model;
      DDP<Mlp> ddp(model, world);
      torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      train_step(ddp, optimizer, 0, rank, 2);
      CheckpointExtra extra;
      extra.epoch = 3;
      extra.step = 7;
      extra.values["accuracy"] = 0.875;
      std::string path = shared_folder() + "/round-trip.pt";
      save_checkpoint(world, path, *model, optimizer, extra);
      auto draw = torch::rand({4});
      train_step(ddp, optimizer, 1, rank, 2);
      auto expected = flatten(model->parameters());

      train_step(ddp, optimizer, 5, rank, 2); // wander off
      auto loaded = load_checkpoint(world, path, *model, optimizer, read);
      EXPECT_EQ(loaded.epoch, 3);
      EXPECT_EQ(loaded.step, 7);
      EXPECT_EQ(loaded.values["accuracy"], 0.875);
      EXPECT_EQ(loaded.world_size, 2);
      EXPECT_TRUE(torch::rand({4}).equal(draw)) << "random state not restored";
      // Same parameters and momentum: the same step lands on the same values.
      train_step(ddp, optimizer, 1, rank, 2);
      EXPECT_TRUE(flatten(model->parameters()).equal(expected));
    }
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(Checkpoint, EachRankResumesItsOwnRandomStream) {
  for (int world_size : {2, 3}) {
    ScratchFolder folder("checkpoint");
    auto result = launch_ranks(with_shared_folder(world_size, folder.path()), [](int rank) {
      World world = init();
      torch::manual_seed(100 + rank); // noise and dropout differ by rank
      Mlp model;
      DDP<Mlp> ddp(model, world);
      torch::optim::SGD optimizer(model->parameters(), 0.1);
      std::string path = shared_folder() + "/streams.pt";
      save_checkpoint(world, path, *model, optimizer);
      auto continuation = torch::rand({4});
      torch::rand({16}); // wander off
      load_checkpoint(world, path, *model, optimizer);
      EXPECT_TRUE(torch::rand({4}).equal(continuation)) << "rank " << rank
                                                         << " did not resume its own stream";
      auto draws = world.all_gather(continuation);
      for (int other = 0; other < world.size(); ++other) {
        EXPECT_EQ(draws[other].equal(continuation), other == rank)
            << "ranks " << rank << " and " << other;
      }
    });
    EXPECT_TRUE(result.ok()) << result.report();
  }
}

TEST(Checkpoint, AtAnotherWorldSizeTheNewRanksKeepTheirOwnStream) {
  ScratchFolder folder("checkpoint");
  auto write = launch_ranks(with_shared_folder(2, folder.path()), [](int rank) {
    World world = init();
    torch::manual_seed(100 + rank);
    Mlp model;
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    save_checkpoint(world, shared_folder() + "/two.pt", *model, optimizer);
  });
  auto read = launch_ranks(with_shared_folder(3, folder.path()), [](int rank) {
    World world = init();
    torch::manual_seed(100 + rank);
    auto own = torch::rand({4});
    torch::manual_seed(100 + rank);
    Mlp model;
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    torch::manual_seed(100 + rank);
    load_checkpoint(world, shared_folder() + "/two.pt", *model, optimizer);
    if (rank == 2) {
      EXPECT_TRUE(torch::rand({4}).equal(own)) << "rank 2 did not keep its own stream";
    }
  });
  if (in_rank_process()) {
    return;
  }
  ASSERT_TRUE(write.ok()) << write.report();
  ASSERT_TRUE(read.ok()) << read.report();
  EXPECT_NE(read.ranks[0].output.find(
                "two.pt holds the random streams of 2 rank(s) and this job has 3: ranks below 2 "
                "resume their own, the others keep the state their program seeded."),
            std::string::npos)
      << read.ranks[0].output;
}

TEST(Checkpoint, SeveralModelsAndOptimizersLiveInOneFile) {
  // A GAN: a generator and a discriminator, each with its optimizer.
  ScratchFolder folder("checkpoint");
  auto result = launch_ranks(with_shared_folder(2, folder.path()), [](int rank) {
    World world = init();
    torch::manual_seed(7);
    Mlp generator(20, 32, 20);
    Mlp discriminator(20, 16, 1);
    DDP<Mlp> g(generator, world);
    DDP<Mlp> d(discriminator, world);
    torch::optim::Adam g_optimizer(generator->parameters(), 1e-3);
    torch::optim::SGD d_optimizer(discriminator->parameters(),
                                  torch::optim::SGDOptions(0.1).momentum(0.9));
    auto step = [&](int64_t i) {
      auto [x, y] = global_batch(i, 8, {20});
      g_optimizer.zero_grad();
      d_optimizer.zero_grad();
      d(g(x.narrow(0, 4 * rank, 4))).mean().backward();
      g_optimizer.step();
      d_optimizer.step();
    };
    step(0);
    CheckpointItems items;
    items.module("generator", *generator)
        .module("discriminator", *discriminator)
        .optimizer("generator", g_optimizer)
        .optimizer("discriminator", d_optimizer);
    std::string path = shared_folder() + "/gan.pt";
    CheckpointExtra extra;
    extra.step = 1;
    save_checkpoint(world, path, items, extra);
    step(1);
    auto expected = flatten(generator->parameters());
    auto expected_d = flatten(discriminator->parameters());
    step(5); // wander off
    EXPECT_EQ(load_checkpoint(world, path, items).step, 1);
    step(1);
    EXPECT_TRUE(flatten(generator->parameters()).equal(expected));
    EXPECT_TRUE(flatten(discriminator->parameters()).equal(expected_d));

    Mlp critic(20, 16, 1);
    torch::optim::SGD c_optimizer(critic->parameters(), 0.1);
    expect_error<CheckpointError>(
        [&] {
          load_checkpoint(world, path,
                          CheckpointItems().module("critic", *critic).optimizer("critic",
                                                                              c_optimizer));
        },
        {"gan.pt holds no module named 'critic': its modules are 'generator', "
         "'discriminator'."});
    expect_error<CheckpointError>(
        [&] { CheckpointItems().module("twice", *critic).module("twice", *critic); },
        {"two modules named 'twice' in one checkpoint; give each its own name."});
    PowerSGD power_sgd(PowerSGDOptions().start_powerSGD_iter(2));
    expect_error<CheckpointError>(
        [&] {
          load_checkpoint(world, path, CheckpointItems().hook_state("powersgd", power_sgd));
        },
        {"gan.pt holds no hook state named 'powersgd': its hook states are none."});
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(Checkpoint, BadFilesAreClearErrorsOnEveryRank) {
  ScratchFolder folder("checkpoint");
  auto result = launch_ranks(with_shared_folder(2, folder.path()), [](int) {
    World world = init();
    torch::manual_seed(1);
    Mlp model;
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    std::string good = shared_folder() + "/good.pt";
    save_checkpoint(world, good, *model, optimizer);
    std::string bytes = detail::read_bytes(good);
    auto write = [&](const std::string& name, const std::string& content) {
      std::string path = shared_folder() + "/" + name;
      if (world.rank() == 0) {
        std::ofstream(path, std::ios::binary) << content;
      }
      world.barrier();
      return path;
    };
    auto expect_load_error = [&](const std::string& path,
                                 std::initializer_list<std::string> fragments) {
      expect_error<CheckpointError>(
          [&] { load_checkpoint(world, path, *model, optimizer); }, fragments);
    };
    expect_load_error(shared_folder() + "/missing.pt",
                      {"loading the checkpoint", "failed on 2 rank(s)",
                       "cannot read the checkpoint", "missing.pt"});
    expect_load_error(write("text.pt", "hello"), {"is not a lockstep checkpoint"});
    expect_load_error(write("truncated.pt", bytes.substr(0, bytes.size() / 2)),
                      {"truncated.pt is truncated:", "bytes of payload expected"});
    std::string flipped = bytes;
    flipped[flipped.size() - 100] ^= 0x5a;
    expect_load_error(write("corrupted.pt", flipped),
                      {"corrupted.pt is corrupted: its checksum does not match"});

    Mlp wider(20, 33);
    torch::optim::SGD wider_optimizer(wider->parameters(), 0.1);
    expect_error<CheckpointError>(
        [&] { load_checkpoint(world, good, *wider, wider_optimizer); },
        {"good.pt was saved from another model: at entry 0 of module 'model' the checkpoint has "
         "parameter 'fc1.weight': Float [32, 20]",
         "where this model has parameter 'fc1.weight': Float [33, 20]"});
    // None of that touched the good one.
    EXPECT_EQ(detail::read_bytes(good), bytes);
    load_checkpoint(world, good, *model, optimizer);
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(Checkpoint, ACrashDuringASaveLeavesThePreviousOneLoadable) {
  ScratchFolder folder("checkpoint");
  auto crashed = launch_ranks(with_shared_folder(1, folder.path()), [](int) {
    World world = init();
    torch::manual_seed(1);
    Mlp model;
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    std::string path = shared_folder() + "/checkpoint.pt";
    CheckpointExtra first;
    first.epoch = 1;
    save_checkpoint(world, path, *model, optimizer, first);
    detail::set_checkpoint_write_observer([](size_t) {
      std::_Exit(3); // the machine goes down in the middle of the write
    });
    CheckpointExtra second;
    second.epoch = 2;
    save_checkpoint(world, path, *model, optimizer, second);
  });
  // The rank that runs the next launch passes here too, with no result.
  if (!in_rank_process()) {
    ASSERT_EQ(crashed.ranks[0].exit_code, 3) << crashed.report();
  }

  auto reloaded = launch_ranks(with_shared_folder(1, folder.path()), [](int) {
    World world = init();
    torch::manual_seed(1);
    Mlp model;
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    auto extra = load_checkpoint(world, shared_folder() + "/checkpoint.pt", *model, optimizer);
    EXPECT_EQ(extra.epoch, 1);
  });
  EXPECT_TRUE(reloaded.ok()) << reloaded.report();
}

TEST(Checkpoint, ASaveNeverWritesThroughALinkPlantedAtItsTempName) {
  // In a shared folder, another user can plant a link where the save
  // would put its temp file; the save must not follow it, and the file it
  // writes takes the user's umask like any other.
  ScratchFolder folder("checkpoint");
  auto result = launch_ranks(with_shared_folder(1, folder.path()), [](int) {
    World world = init();
    Mlp model;
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    std::string path = shared_folder() + "/checkpoint.pt";
    std::string precious = shared_folder() + "/precious.txt";
    std::ofstream(precious) << "not yours to overwrite";
    std::filesystem::create_symlink(precious, path + ".tmp-" + std::to_string(::getpid()));
    ::umask(077);
    save_checkpoint(world, path, *model, optimizer);
    std::ifstream in(precious);
    std::string kept((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(kept, "not yours to overwrite");
    struct stat info {};
    ASSERT_EQ(::stat(path.c_str(), &info), 0);
    EXPECT_EQ(info.st_mode & 0777, 0600u) << "the umask 077 applies";
    load_checkpoint(world, path, *model, optimizer);
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

// The most memory this process has held so far, in bytes.
int64_t peak_resident_bytes() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

TEST(Checkpoint, ASaveAndALoadOfA200MBModelTakeLittleMoreThanItsSize) {
  // A save streams the tensors to the file: its peak is the model itself
  // and a buffer. A load reads the file in place: LibTorch's archive holds
  // one copy of the tensors before they are copied into the model, so the
  // peak grows by the payload, and by no more than a fifth beyond it.
  ScratchFolder folder("checkpoint");
  auto result = launch_ranks(with_shared_folder(1, folder.path()), [](int) {
    World world = init();
    torch::nn::Linear model(torch::nn::LinearOptions(7000, 7500).bias(false));
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    auto payload = static_cast<double>(model->weight.nbytes());
    std::string path = shared_folder() + "/large.pt";
    auto before = peak_resident_bytes();
    save_checkpoint(world, path, *model, optimizer);
    auto saved = peak_resident_bytes();
    EXPECT_LE(saved - before, 0.2 * payload) << "the save held more than a fifth of the model";
    load_checkpoint(world, path, *model, optimizer);
    EXPECT_LE(peak_resident_bytes() - saved, 1.2 * payload)
        << "the load held more than 1.2 times the model";
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

} // namespace
} // namespace lockstep::testing
