#include "support/collective_checks.h"

#include <functional>

#include <ATen/ATen.h>

#include <lockstep/error.h>
#include <lockstep/sharded_collectives.h>

namespace lockstep::testing {
namespace {

using detail::str;

// What rank `rank` contributes: small integers, whose sums over 4 ranks are
// exact in float16 and bfloat16 too, or values that round.
at::Tensor contribution(int64_t numel, at::ScalarType type, int rank, bool exact) {
  auto positions = at::arange(numel, at::kDouble);
  auto values = exact ? at::remainder(positions * 7 + rank * 3, 13) - 6
                      : at::sin(positions * 0.37 + rank) * (rank + 1.5);
  return values.to(type);
}

// A checksum of `tensor`'s bytes, to compare ranks without trusting the
// transport under test.
std::string fingerprint(const at::Tensor& tensor) {
  auto bytes = tensor.contiguous().view(at::kByte);
  const auto* data = bytes.data_ptr<uint8_t>();
  uint64_t hash = 1469598103934665603ull;
  for (int64_t i = 0; i < bytes.numel(); ++i) {
    hash = (hash ^ data[i]) * 1099511628211ull;
  }
  return std::to_string(hash);
}

// The distance from 1 to the next representable value.
double unit_of(at::ScalarType type) {
  switch (type) {
    case at::kBFloat16:
      return 1.0 / 128;
    case at::kHalf:
      return 1.0 / 1024;
    case at::kFloat:
      return 1.2e-7;
    default:
      return 2.3e-16;
  }
}

// The average's definition: the sum divided by n; in 16 bits, where the
// sum could pass the format's range, each share divided first, the shares
// summed exactly (in float32) and rounded once.
at::Tensor average_of(const std::vector<at::Tensor>& values, at::ScalarType type) {
  auto n = static_cast<int64_t>(values.size());
  auto sum = at::zeros_like(values[0], at::kDouble);
  bool divides_first = type == at::kHalf || type == at::kBFloat16;
  for (const auto& value : values) {
    sum += divides_first ? value.div(n).to(at::kDouble) : value.to(at::kDouble);
  }
  return divides_first ? sum.to(type) : sum.to(type).div(n);
}

} // namespace

std::vector<std::string> check_collectives(World& world, bool large) {
  std::vector<std::string> failures;
  auto expect = [&](bool holds, const std::string& what) {
    if (!holds) {
      failures.push_back(str("rank ", world.rank(), ": ", what));
    }
  };
  int n = world.size();
  int rank = world.rank();
  const std::vector<at::ScalarType> types{at::kFloat, at::kDouble, at::kBFloat16, at::kHalf};
  std::vector<std::pair<at::ScalarType, int64_t>> cases;
  for (auto type : types) {
    for (int64_t numel : {int64_t{1}, int64_t{7}, int64_t{1001}, int64_t{65536 + 3},
                          (int64_t{1} << 20) + 5}) {
      cases.emplace_back(type, numel);
    }
  }
  if (large) {
    cases.emplace_back(at::kFloat, int64_t{16} << 20);
  }
  for (auto [type, numel] : cases) {
    std::vector<at::Tensor> exact_values;
    std::vector<at::Tensor> rounding_values;
    auto exact_sum = at::zeros({numel}, at::kDouble);
    auto rounded_exact = at::zeros({numel}, at::kDouble);
    for (int r = 0; r < n; ++r) {
      exact_values.push_back(contribution(numel, type, r, true));
      rounding_values.push_back(contribution(numel, type, r, false));
      exact_sum += exact_values[r].to(at::kDouble);
      rounded_exact += rounding_values[r].to(at::kDouble);
    }
    auto smallest = exact_values[0].to(at::kDouble);
    for (int r = 1; r < n; ++r) {
      smallest = at::minimum(smallest, exact_values[r].to(at::kDouble));
    }
    auto allocated = world.allocate(numel, type);
    for (bool in_place : {false, true}) {
      std::string what = str(type, " x ", numel, in_place ? " (allocated)" : " (own tensor)");
      auto place = [&](const at::Tensor& values) {
        return in_place ? allocated.copy_(values) : values.clone();
      };
      auto sum = place(exact_values[rank]);
      world.all_reduce(sum);
      expect(sum.equal(exact_sum.to(type)), "sum of " + what);
      auto average = place(exact_values[rank]);
      world.all_reduce(average, ReduceOp::Average);
      expect(average.equal(average_of(exact_values, type)), "average of " + what);
      auto minimum = place(exact_values[rank]);
      world.all_reduce(minimum, ReduceOp::Min);
      expect(minimum.equal(smallest.to(type)), "minimum of " + what);
      auto rounded = place(rounding_values[rank]);
      world.all_reduce(rounded);
      double error = (rounded.to(at::kDouble) - rounded_exact).abs().max().item<double>();
      expect(error <= n * unit_of(type) * (rounded_exact.abs().max().item<double>() + 1),
             str("rounded sum of ", what, " is off by ", error));
      auto prints = world.all_gather_strings(fingerprint(rounded));
      for (int r = 1; r < n; ++r) {
        expect(prints[r] == prints[0], str("rounded sum of ", what, ": rank ", r,
                                           " holds other bits than rank 0"));
      }
    }
  }
  // Broadcast and all_gather move bits, whatever they are.
  for (auto type : types) {
    for (int64_t numel : {int64_t{1}, int64_t{1001}, (int64_t{1} << 20) + 5}) {
      std::string what = str(type, " x ", numel);
      int root = n - 1;
      auto data = contribution(numel, type, rank, false);
      auto broadcast = data.clone();
      world.broadcast(broadcast, root);
      expect(broadcast.equal(contribution(numel, type, root, false)), "broadcast of " + what);
      auto gathered = world.all_gather(data);
      for (int r = 0; r < n; ++r) {
        expect(gathered[r].equal(contribution(numel, type, r, false)),
               str("all_gather of ", what, ": rank ", r, "'s part"));
      }
    }
  }
  // The sharded pair: reduce_scatter's slice of the sum, average and
  // minimum, bit for bit where sums are exact and the same bits as the
  // all-reduce's slice where they round; all_gather_into moves bits. Also
  // with the output a slice of the input (in place, as a sharded optimizer
  // keeps its gradients).
  for (auto type : types) {
    for (int64_t per_rank : {int64_t{1}, int64_t{1001}, (int64_t{1} << 18) + 5}) {
      std::string what = str(type, " x ", n, " x ", per_rank);
      int64_t numel = per_rank * n;
      std::vector<at::Tensor> exact_values;
      auto exact_sum = at::zeros({numel}, at::kDouble);
      for (int r = 0; r < n; ++r) {
        exact_values.push_back(contribution(numel, type, r, true));
        exact_sum += exact_values[r].to(at::kDouble);
      }
      auto smallest = exact_values[0].to(at::kDouble);
      for (int r = 1; r < n; ++r) {
        smallest = at::minimum(smallest, exact_values[r].to(at::kDouble));
      }
      auto mine = [&](const at::Tensor& whole) {
        return whole.narrow(0, rank * per_rank, per_rank);
      };
      auto slice = at::empty({per_rank}, type);
      reduce_scatter(world, slice, exact_values[rank]);
      expect(slice.equal(mine(exact_sum.to(type))), "reduce_scatter sum of " + what);
      reduce_scatter(world, slice, exact_values[rank], ReduceOp::Average);
      expect(slice.equal(mine(average_of(exact_values, type))),
             "reduce_scatter average of " + what);
      reduce_scatter(world, slice, exact_values[rank], ReduceOp::Min);
      expect(slice.equal(mine(smallest.to(type))), "reduce_scatter minimum of " + what);
      auto in_place = exact_values[rank].clone();
      auto own_slice = mine(in_place);
      reduce_scatter(world, own_slice, in_place);
      expect(own_slice.equal(mine(exact_sum.to(type))),
             "reduce_scatter sum into a slice of its input, " + what);
      auto rounding = contribution(numel, type, rank, false);
      auto all_reduced = rounding.clone();
      world.all_reduce(all_reduced);
      reduce_scatter(world, slice, rounding);
      auto prints = world.all_gather_strings(fingerprint(slice));
      auto gathered = at::empty({numel}, type);
      all_gather_into(world, gathered, slice);
      auto error = (gathered.to(at::kDouble) - all_reduced.to(at::kDouble)).abs().max();
      expect(error.item<double>() <=
                 n * unit_of(type) * (all_reduced.to(at::kDouble).abs().max().item<double>() + 1),
             str("rounded reduce_scatter of ", what, " is off by ", error.item<double>()));
      for (int r = 0; r < n; ++r) {
        expect(fingerprint(gathered.narrow(0, r * per_rank, per_rank)) == prints[r],
               str("all_gather_into of ", what, ": rank ", r, "'s part"));
      }
    }
  }
  // Views: a collective on a view of a tensor changes the view's elements
  // and nothing else of that tensor, on every transport. A tensor whose
  // elements share memory (expand) has no one place for each result.
  using ViewOf = std::function<at::Tensor(const at::Tensor&)>;
  const std::vector<std::pair<std::string, ViewOf>> views{
      {"narrow(1, 2, 5)", [](const at::Tensor& t) { return t.narrow(1, 2, 5); }},
      {"select(1, 3)", [](const at::Tensor& t) { return t.select(1, 3); }},
      {"t()", [](const at::Tensor& t) { return t.t(); }},
      {"narrow(0, 1, 30)", [](const at::Tensor& t) { return t.narrow(0, 1, 30); }}};
  for (auto type : types) {
    auto base = [&](int r) { return contribution(37 * 11, type, r, true).view({37, 11}); };
    int root = n - 1;
    for (const auto& [name, view_of] : views) {
      std::string what = str(name, " of a ", type, " [37, 11]");
      auto sum = view_of(base(0)).to(at::kDouble);
      for (int r = 1; r < n; ++r) {
        sum += view_of(base(r)).to(at::kDouble);
      }
      auto reduced = base(rank).clone();
      auto reduced_view = view_of(reduced);
      world.all_reduce(reduced_view);
      auto expected = base(rank).clone();
      view_of(expected).copy_(sum);
      expect(reduced.equal(expected), "sum of " + what);
      auto broadcast = base(rank).clone();
      auto broadcast_view = view_of(broadcast);
      world.broadcast(broadcast_view, root);
      expected = base(rank).clone();
      view_of(expected).copy_(view_of(base(root)));
      expect(broadcast.equal(expected), "broadcast of " + what);
      auto gathered = world.all_gather(view_of(base(rank)));
      for (int r = 0; r < n; ++r) {
        expect(gathered[r].equal(view_of(base(r))), str("all_gather of ", what, ": rank ", r,
                                                         "'s part"));
      }
    }
  }
  auto expanded = at::ones({1}).expand({5});
  try {
    world.all_reduce(expanded);
    expect(false, "an all_reduce of an expanded tensor was not refused");
  } catch (const UsageError& e) {
    expect(std::string(e.what()).find("share memory") != std::string::npos,
           str("the refusal of an expanded tensor says: ", e.what()));
  }
  world.barrier();
  return failures;
}

} // namespace lockstep::testing
