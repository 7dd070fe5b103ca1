// PowerSGD's hook. At launch, a bucket past start_powerSGD_iter gets each
// parameter's error feedback added, its compressible matrices multiplied by
// Q into P,
// and two all-reduces started at once (the matrices left as they are, and
// P). The summed P is then orthogonalised, Q computed and all-reduced: for
// a bucket, as the next bucket launches (so that Q crosses while backward
// goes on), for the last, in its future; the future writes P Q^T / n over
// the gradients. Every rank issues the same collectives in the same order
// (P of bucket k, Q of bucket k - 1, in bucket order), which is what
// PyTorch 1.13's chained futures over Gloo do not guarantee.

#include <lockstep/power_sgd.h>

#include <map>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/serialize/archive.h>

#include <lockstep/error.h>

namespace lockstep {

struct PowerSGD::State {
  explicit State(PowerSGDOptions options_in) : options(options_in) {}
  PowerSGDOptions options;
  int64_t iteration = 0;
  int64_t draws = 0; // random initialisations of Q so far, the same on every rank
  // Per parameter (GradBucket::parameter_indices), so that a new bucket
  // layout (the rebuild after the first iteration, which a resumed run
  // repeats) changes nothing: this rank's error feedback, and the last Q.
  std::map<int64_t, at::Tensor> errors;
  std::map<int64_t, at::Tensor> qs;
  // Per bucket (its first parameter), the gradients before compression.
  std::map<int64_t, at::Tensor> copies;
  int64_t before = 0;
  int64_t after = 0;
  int64_t last_before = 0;
  int64_t last_after = 0;
  // The bucket launched before this one, whose Q is started next.
  std::shared_ptr<Compression> unstarted;

  void end_of_bucket(bool last) {
    if (last) {
      ++iteration;
      last_before = std::exchange(before, 0);
      last_after = std::exchange(after, 0);
    }
  }
};

namespace {

// Gram-Schmidt on the columns of `matrix` (rows x r), in place.
void orthogonalize(at::Tensor matrix, double epsilon) {
  int64_t columns = matrix.size(1);
  for (int64_t i = 0; i < columns; ++i) {
    auto column = matrix.narrow(1, i, 1);
    // Without epsilon, a vanishing gradient divides by zero, as in PyTorch.
    column.div_(epsilon == 0 ? column.norm() : column.norm() + epsilon);
    if (i + 1 < columns) {
      auto rest = matrix.narrow(1, i + 1, columns - i - 1);
      rest.sub_((column * rest).sum(0, /*keepdim=*/true) * column);
    }
  }
}

struct Matrix {
  int64_t key = 0;
  at::Tensor m; // a view of the bucket's gradients, rows x columns
  at::Tensor p; // rows x r, in the bucket's P
  at::Tensor q; // columns x r, in the bucket's Q
};

} // namespace

// A bucket's compressed matrices between P's all-reduce and Q's.
struct PowerSGD::Compression {
  World world;
  std::vector<Matrix> matrices;
  at::Tensor qs;
  std::optional<PendingCollective> p_work;
  std::optional<PendingCollective> q_work;
  std::string description;
  double epsilon = 0;

  // Once P is summed: Q = M^T P, on its way. Idempotent.
  void start_q() {
    if (q_work || !p_work) {
      return;
    }
    p_work->wait();
    for (auto& matrix : matrices) {
      orthogonalize(matrix.p, epsilon);
      at::mm_out(matrix.q, matrix.m.t(), matrix.p);
    }
    q_work = world.all_reduce_async(qs, ReduceOp::Sum, "PowerSGD's Q of " + description);
  }
};

PowerSGD::PowerSGD(PowerSGDOptions options) : state_(std::make_shared<State>(options)) {
  bool needs_warm_up = options.use_error_feedback() || options.warm_start();
  LOCKSTEP_ENFORCE(options.matrix_approximation_rank() >= 1, ConfigError,
                   "PowerSGD's matrix_approximation_rank must be at least 1, not ",
                   options.matrix_approximation_rank(), ".");
  LOCKSTEP_ENFORCE(
      !needs_warm_up || options.start_powerSGD_iter() > 1, ConfigError,
      "PowerSGD's start_powerSGD_iter must be more than 1 with error feedback or warm start "
      "(got ", options.start_powerSGD_iter(), "): the buckets are laid out again after the "
      "first iteration, as in PyTorch, where the same rule holds.");
}

const PowerSGDOptions& PowerSGD::options() const {
  return state_->options;
}
int64_t PowerSGD::iteration() const {
  return state_->iteration;
}
int64_t PowerSGD::values_before_compression() const {
  return state_->last_before;
}
int64_t PowerSGD::values_after_compression() const {
  return state_->last_after;
}

CommHook PowerSGD::hook() const {
  auto state = state_;
  return [state](GradBucket& bucket) -> BucketFuture {
    auto& s = *state;
    const auto& options = s.options;
    if (s.iteration < options.start_powerSGD_iter()) {
      s.before += bucket.gradients.numel();
      s.after += bucket.gradients.numel();
      s.end_of_bucket(bucket.last);
      return hooks::allreduce()(bucket);
    }
    at::NoGradGuard no_grad;
    World world = bucket.world;
    auto input = bucket.gradients;
    std::vector<at::Tensor> slices;
    for (size_t i = 0; i < bucket.parameters.size(); ++i) {
      slices.push_back(input.narrow(0, bucket.offsets[i], bucket.parameters[i].numel()));
    }
    at::Tensor input_copy;
    if (options.use_error_feedback()) {
      for (size_t i = 0; i < slices.size(); ++i) {
        auto found = s.errors.find(bucket.parameter_indices[i]);
        if (found != s.errors.end() && found->second.numel() == slices[i].numel()) {
          slices[i].add_(found->second);
        }
      }
      // Kept from one iteration to the next, as the errors are: memory
      // allocated afresh each time costs its page faults again.
      auto& copy = s.copies[bucket.parameter_indices.front()];
      if (!copy.defined() || copy.numel() != input.numel()) {
        copy = at::empty_like(input);
      }
      input_copy = copy.copy_(input);
    }

    std::vector<Matrix> matrices;
    std::vector<at::Tensor> uncompressed;
    int64_t ps_size = 0;
    int64_t qs_size = 0;
    bool fresh = false;
    for (size_t i = 0; i < bucket.parameters.size(); ++i) {
      const auto& parameter = bucket.parameters[i];
      int64_t rows = parameter.dim() > 0 ? parameter.size(0) : 1;
      int64_t columns = rows > 0 ? parameter.numel() / rows : 0;
      int64_t r = std::min({rows, columns, options.matrix_approximation_rank()});
      s.before += rows * columns;
      if (static_cast<double>(rows * columns) >
          options.min_compression_rate() * static_cast<double>((rows + columns) * r)) {
        int64_t key = bucket.parameter_indices[i];
        matrices.push_back({key, slices[i].view({rows, columns}), {}, {}});
        ps_size += rows * r;
        qs_size += columns * r;
        s.after += (rows + columns) * r;
        auto q = s.qs.find(key);
        fresh |= !options.warm_start() || q == s.qs.end() || q->second.size(0) != columns ||
            q->second.size(1) != r;
      } else {
        uncompressed.push_back(slices[i]);
        s.after += rows * columns;
      }
    }
    // Flat, so that each travels in one all-reduce.
    auto ps = at::empty({ps_size}, input.options());
    auto qs = at::empty({qs_size}, input.options());
    int64_t p_offset = 0;
    int64_t q_offset = 0;
    for (auto& matrix : matrices) {
      int64_t rows = matrix.m.size(0);
      int64_t columns = matrix.m.size(1);
      int64_t r = std::min({rows, columns, options.matrix_approximation_rank()});
      matrix.p = ps.narrow(0, p_offset, rows * r).view({rows, r});
      matrix.q = qs.narrow(0, q_offset, columns * r).view({columns, r});
      p_offset += rows * r;
      q_offset += columns * r;
    }
    if (fresh) {
      // One draw per bucket that needs one, the same on every rank.
      auto generator = at::make_generator<at::CPUGeneratorImpl>(
          options.random_seed() * 1000003 + static_cast<uint64_t>(s.draws++));
      for (auto& matrix : matrices) {
        // Drawn on the host (the generator's device) for any device, so that
        // a model on a GPU starts from the same Q as on the CPU.
        matrix.q.copy_(at::randn(matrix.q.sizes(), generator, input.options().device(at::kCPU)));
      }
    } else {
      for (auto& matrix : matrices) {
        matrix.q.copy_(s.qs[matrix.key]);
      }
    }
    for (auto& matrix : matrices) {
      orthogonalize(matrix.q, options.orthogonalization_epsilon());
      at::mm_out(matrix.p, matrix.m, matrix.q);
    }
    int n = world.size();
    at::Tensor flat;
    std::optional<PendingCollective> flat_work;
    if (!uncompressed.empty()) {
      flat = at::cat(uncompressed);
      flat_work = world.all_reduce_async(flat, ReduceOp::Sum,
                                         "PowerSGD's uncompressed part of " + bucket.description);
    }
    auto compression = std::make_shared<Compression>(
        Compression{world, matrices, qs, std::nullopt, std::nullopt, bucket.description,
                    options.orthogonalization_epsilon()});
    if (!matrices.empty()) {
      compression->p_work =
          world.all_reduce_async(ps, ReduceOp::Sum, "PowerSGD's P of " + bucket.description);
    }
    if (auto before = std::exchange(s.unstarted, compression)) {
      before->start_q();
    }
    bucket.bytes_sent = input.element_size() *
        ((flat.defined() ? flat.numel() : 0) + ps_size + qs_size);
    std::vector<int64_t> keys = bucket.parameter_indices;
    bool last = bucket.last;
    return [state, input, input_copy, slices, keys, flat, flat_work, uncompressed, compression,
            n, last]() mutable {
      at::NoGradGuard no_grad;
      auto& s = *state;
      if (flat_work) {
        flat_work->wait();
        flat.div_(n);
        int64_t offset = 0;
        for (auto& tensor : uncompressed) {
          tensor.copy_(flat.narrow(0, offset, tensor.numel()));
          offset += tensor.numel();
        }
      }
      if (compression->p_work) {
        compression->start_q();
        if (s.unstarted == compression) {
          s.unstarted = nullptr;
        }
        compression->q_work->wait();
        compression->qs.div_(n);
        for (auto& matrix : compression->matrices) {
          at::mm_out(matrix.m, matrix.p, matrix.q.t());
          if (s.options.warm_start()) {
            s.qs[matrix.key] = matrix.q.clone();
          }
        }
      }
      if (s.options.use_error_feedback()) {
        for (size_t i = 0; i < slices.size(); ++i) {
          auto& error = s.errors[keys[i]];
          if (!error.defined() || error.numel() != slices[i].numel()) {
            error = at::empty_like(slices[i]);
          }
          at::sub_out(error,
                      input_copy.narrow(0, slices[i].storage_offset() - input.storage_offset(),
                                        slices[i].numel()),
                      slices[i]);
        }
      }
      s.end_of_bucket(last);
      return input;
    };
  };
}

void PowerSGD::save(torch::serialize::OutputArchive& archive) const {
  const auto& s = *state_;
  archive.write("iteration", c10::IValue(s.iteration));
  archive.write("draws", c10::IValue(s.draws));
  for (const auto& [kind, tensors] : {std::pair{"error", &s.errors}, {"q", &s.qs}}) {
    std::vector<int64_t> keys;
    for (const auto& [b, tensor] : *tensors) {
      keys.push_back(b);
      archive.write(detail::str(kind, "/", b), tensor, /*is_buffer=*/true);
    }
    archive.write(detail::str(kind, "/parameters"), c10::IValue(keys));
  }
}

void PowerSGD::load(torch::serialize::InputArchive& archive) {
  auto& s = *state_;
  c10::IValue value;
  archive.read("iteration", value);
  s.iteration = value.toInt();
  archive.read("draws", value);
  s.draws = value.toInt();
  for (const auto& [kind, tensors] : {std::pair{"error", &s.errors}, {"q", &s.qs}}) {
    tensors->clear();
    archive.read(detail::str(kind, "/parameters"), value);
    for (int64_t b : value.toIntVector()) {
      at::Tensor tensor;
      archive.read(detail::str(kind, "/", b), tensor, /*is_buffer=*/true);
      (*tensors)[b] = tensor;
    }
  }
}

void PowerSGD::reset_error_feedback() {
  state_->errors.clear();
}

} // namespace lockstep
