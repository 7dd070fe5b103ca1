#include "support/diloco_reference.h"

#include <sstream>

#include <lockstep/ddp.h>
#include <lockstep/diloco.h>
#include <lockstep/replica_groups.h>

namespace lockstep::testing {

std::vector<std::vector<std::vector<torch::Tensor>>> streaming_reference(
    const StreamingCase& c, int replicas, int64_t h, int64_t steps) {
  std::vector<Mlp> models;
  std::vector<std::unique_ptr<torch::optim::SGD>> inners;
  for (int r = 0; r < replicas; ++r) {
    models.push_back(float64_mlp());
    inners.push_back(std::make_unique<torch::optim::SGD>(models.back()->parameters(),
                                                         inner_options()));
  }
  // The global parameters, stepped by an outer SGD per fragment.
  Mlp global = float64_mlp();
  auto global_fragments = fragments_of(global, c.fragments);
  std::vector<std::unique_ptr<torch::optim::SGD>> outers;
  for (const auto& fragment : global_fragments) {
    outers.push_back(std::make_unique<torch::optim::SGD>(fragment, outer_options()));
  }
  int64_t interval = h / c.fragments;
  int64_t syncs = 0;
  std::vector<torch::Tensor> in_flight; // the averaged pseudo-gradient, per parameter
  std::vector<std::vector<std::vector<torch::Tensor>>> after(static_cast<size_t>(steps));
  for (int64_t step = 0; step < steps; ++step) {
    for (int r = 0; r < replicas; ++r) {
      auto [x, y] = replica_batch(step, replicas, r);
      inners[r]->zero_grad();
      torch::mse_loss(models[r](x), y).backward();
      inners[r]->step();
    }
    int64_t local_step = step + 1;
    size_t fragment = static_cast<size_t>(syncs % c.fragments);
    auto send = [&] {
      torch::NoGradGuard no_grad;
      in_flight.clear();
      for (size_t i = 0; i < global_fragments[fragment].size(); ++i) {
        auto sum = torch::zeros_like(global_fragments[fragment][i]);
        if (c.wire) {
          // Each replica's in the wire's type, summed in float32, rounded
          // once (in the order of the ranks: with 2 replicas, any order).
          sum = sum.to(torch::kFloat);
        }
        for (int r = 0; r < replicas; ++r) {
          auto pseudo_gradient =
              global_fragments[fragment][i] - fragments_of(models[r], c.fragments)[fragment][i];
          sum += c.wire ? pseudo_gradient.to(*c.wire).to(torch::kFloat) : pseudo_gradient;
        }
        if (c.wire) {
          sum = sum.to(*c.wire).to(torch::kDouble);
        }
        in_flight.push_back(sum / replicas);
      }
    };
    if (c.delay > 0 && (local_step + c.delay) % interval == 0) {
      send();
    }
    if (local_step % interval == 0) {
      if (c.delay == 0) {
        send();
      }
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < global_fragments[fragment].size(); ++i) {
        global_fragments[fragment][i].mutable_grad() = in_flight[i].clone();
      }
      outers[fragment]->step();
      for (int r = 0; r < replicas; ++r) {
        auto local = fragments_of(models[r], c.fragments)[fragment];
        for (size_t i = 0; i < local.size(); ++i) {
          const auto& g = global_fragments[fragment][i];
          local[i].copy_(g + c.alpha * (local[i] - g));
        }
      }
      ++syncs;
    }
    for (int r = 0; r < replicas; ++r) {
      std::vector<torch::Tensor> copy;
      for (const auto& p : models[r]->parameters()) {
        copy.push_back(p.detach().clone());
      }
      after[static_cast<size_t>(step)].push_back(copy);
    }
  }
  return after;
}

std::vector<std::string> check_diloco_with_ddp_inside(World& world, int ranks_per_replica) {
  const StreamingCase c{2, 1, 0.5};
  constexpr int64_t kSyncEvery = 6;
  constexpr int64_t kSteps = 14;
  int replicas = world.size() / ranks_per_replica;
  auto reference = streaming_reference(c, replicas, kSyncEvery, kSteps);
  auto groups = replica_groups(world, ranks_per_replica);
  Mlp model = float64_mlp(3 + static_cast<uint64_t>(world.rank()));
  DDP<Mlp> ddp(model, groups.replica);
  torch::optim::SGD inner(model->parameters(), inner_options());
  auto fragments = fragments_of(model, c.fragments);
  torch::optim::SGD outer(model->parameters(), outer_options());
  DiLoCo diloco(groups.across, fragments, inner, {&outer},
                DiLoCoOptions().sync_every(kSyncEvery).fragment_sync_delay(c.delay)
                    .fragment_update_alpha(c.alpha));
  int replica = world.rank() / ranks_per_replica;
  int64_t share = kPerReplica / ranks_per_replica;
  int64_t first = share * groups.replica.rank();
  std::vector<std::string> failures;
  for (int64_t step = 0; step < kSteps && failures.empty(); ++step) {
    auto [x, y] = replica_batch(step, replicas, replica);
    inner.zero_grad();
    torch::mse_loss(ddp(x.narrow(0, first, share)), y.narrow(0, first, share)).backward();
    diloco.step();
    auto parameters = model->parameters();
    const auto& expected = reference[static_cast<size_t>(step)][static_cast<size_t>(replica)];
    for (size_t i = 0; i < parameters.size(); ++i) {
      if (!torch::allclose(parameters[i], expected[i], 0, kFloat64Tolerance)) {
        std::ostringstream line;
        line << "rank " << world.rank() << ": parameter " << i << " after step " << step
             << " differs from the reference by up to "
             << (parameters[i] - expected[i]).abs().max().item<double>();
        failures.push_back(line.str());
      }
    }
  }
  try {
    ddp.check_replicas(); // the ranks of a replica, bit for bit
  } catch (const std::exception& e) {
    failures.push_back(e.what());
  }
  return failures;
}

} // namespace lockstep::testing
