#pragma once

// FullyShardedDataParallel (ZeRO stage 3): each rank holds 1/N of every
// parameter, of its gradient and of the optimizer's state. A unit's full
// parameters exist only while the unit computes: gathered before its
// forward, freed after it, gathered again before its backward; its
// gradients are then reduce-scattered into the ranks' shards and freed.
//
// LibTorch modules have no forward hooks, so a unit is declared where the
// model holds it, with lockstep::Sharded in place of the block's holder:
//
//   struct NetImpl : torch::nn::Module {
//     NetImpl() {
//       for (int i = 0; i < 4; ++i) {
//         blocks.push_back(register_module("block" + std::to_string(i),
//                                          lockstep::Sharded<Block>(256)));
//       }
//       head = register_module("head", torch::nn::Linear(256, 10));
//     }
//     torch::Tensor forward(torch::Tensor x) {
//       for (auto& block : blocks) x = block(x);   // gathers, runs, frees
//       return head(x);
//     }
//     std::vector<lockstep::Sharded<Block>> blocks;
//     torch::nn::Linear head{nullptr};
//   };
//
//   lockstep::FullyShardedDataParallel<Net> fsdp(Net(), world);
//   torch::optim::AdamW optimizer(fsdp.parameters(), torch::optim::AdamWOptions(1e-3));
//   optimizer.zero_grad();
//   torch::nll_loss(fsdp(x), y).backward();     // each rank its own batch
//   optimizer.step();                           // steps this rank's shard
//
// What no unit holds (head above) is the root unit: gathered at the
// wrapper's forward and freed at the end of backward. Outside the wrapper
// (a plain process, the one-process reference of a test) a Sharded block
// is the block itself. A model whose parameters do not fit one rank is
// built with lockstep::build_sharded<Net>(world) (sharded_construction.h):
// each unit keeps this rank's shard as its constructor returns. See
// docs/ddp.md, "When the model does not fit".

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <lockstep/ddp.h>
#include <lockstep/fsdp_options.h>
#include <lockstep/sharded_construction.h>
#include <lockstep/world.h>

namespace lockstep {

namespace detail {

/// What a unit's Sharded holder calls around the block's forward.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward() = 0;
  virtual void forward_failed() = 0;
  /// `outputs` as collect_tensors makes them (an undefined tensor for an
  /// output of another type).
  virtual void after_forward(const std::vector<at::Tensor>& outputs) = 0;
  /// An input of the unit's forward as the unit receives it: one that
  /// requires grad comes back as a view whose gradient tells the wrapper
  /// that the unit's backward is over (FSDP2's post-backward), so that a
  /// unit with frozen parameters, which later nodes may read, is freed then.
  virtual at::Tensor mark_input(const at::Tensor& input) = 0;
};

template <typename T>
decltype(auto) mark_input(UnitHooks& hooks, T&& arg) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return at::Tensor(hooks.mark_input(arg));
  } else {
    return std::forward<T>(arg);
  }
}

/// Marks `module` as a unit (Sharded's constructors do).
void declare_unit(const std::shared_ptr<torch::nn::Module>& module);
bool is_declared_unit(const torch::nn::Module& module);
/// The hooks of the wrapper that shards `module`, or null outside one.
std::shared_ptr<UnitHooks> hooks_of_unit(const torch::nn::Module& module);

/// The part of FullyShardedDataParallel that does not depend on the
/// module's type (src/fsdp/).
class ShardedModel {
 public:
  /// Collective: rank 0's parameters and buffers reach every rank, then each
  /// rank keeps its shard and frees the rest.
  ShardedModel(torch::nn::Module& module, World world, FsdpOptions options);
  ~ShardedModel();
  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;

  void before_forward();
  /// Frees what the failed forward gathered. Where `error` is not
  /// lockstep's and a unit with parameters had not been gathered in this
  /// forward, raises UsageError naming it (a unit called around its
  /// holder computes on freed, empty parameters: ATen's shape error).
  void forward_failed(const std::exception_ptr& error);
  void after_forward(const std::vector<at::Tensor>& outputs);
  /// FsdpOptions::param_dtype, for the wrapper's inputs.
  std::optional<at::ScalarType> input_dtype() const;
  /// While false, backward accumulates each unit's gradients in full and
  /// reduces nothing; the next backward with it true reduces the sum once.
  void set_sync_enabled(bool enabled);
  bool sync_enabled() const;
  /// This rank's piece of every parameter that it holds a part of: leaf
  /// tensors that an optimizer steps, their gradients the averages.
  std::vector<at::Tensor> parameters() const;
  /// The same pieces under their parameters' names.
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const;
  /// Collective: a copy of every parameter in full, by name, on every rank.
  torch::OrderedDict<std::string, at::Tensor> full_parameters();
  /// Collective: every unit gathered, the module's parameters in full,
  /// until end_full_parameters (local: each rank takes its shard back from
  /// them, so that what was loaded into them stays, and frees them).
  void begin_full_parameters();
  void end_full_parameters();
  /// Collective: on rank `to`, `full` (an optimizer of `sharded`'s type over
  /// the module's parameters) takes the state of every parameter in full,
  /// put together from `sharded`'s states of every rank's pieces.
  void consolidate_optimizer_state(const torch::optim::Optimizer& sharded,
                                   torch::optim::Optimizer& full, int to);
  /// `sharded` takes this rank's pieces of `full`'s states (and its groups'
  /// options where both have as many groups).
  void load_optimizer_state(torch::optim::Optimizer& sharded,
                            const torch::optim::Optimizer& full);
  /// The units' names, root ("") first, in the order of the module tree.
  std::vector<std::string> unit_names() const;
  /// The ranks that hold each parameter's pieces once each.
  World shard_world() const;
  /// Collective: each rank writes its pieces, `optimizer`'s state of them
  /// and `module`'s buffers to a file of its own, then rank 0 the index at
  /// `path` (src/fsdp/sharded_checkpoint.cpp).
  void save_sharded(const std::string& path, torch::nn::Module& module,
                    const torch::optim::Optimizer& optimizer);
  /// Collective: this rank's pieces of what save_sharded wrote, at any
  /// world size.
  void load_sharded(const std::string& path, torch::nn::Module& module,
                    torch::optim::Optimizer& optimizer);
  /// Collective: compares what every rank holds alike (`module`'s buffers).
  void check_replicas(torch::nn::Module& module, ReplicaCheck what);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

} // namespace detail

/// A block that FullyShardedDataParallel gathers and frees as one unit:
/// declared (and registered) in the model in place of `Block`, a module
/// holder such as torch::nn::Linear or one made by TORCH_MODULE. Calling it
/// calls the block; inside a wrapper, between gathering and freeing.
template <typename Block>
class Sharded : public Block {
 public:
  Sharded(std::nullptr_t) : Block(nullptr) {}
  /// The module that register_module returns.
  Sharded(std::shared_ptr<typename Block::ContainedType> module) : Block(std::move(module)) {
    if (!this->is_empty()) {
      detail::declare_unit(this->ptr());
    }
  }
  /// The arguments of one of Block's constructors, or a Block.
  template <typename... Args,
            typename = std::enable_if_t<
                !(sizeof...(Args) == 1 &&
                  (std::is_same_v<std::decay_t<Args>, std::nullptr_t> && ...))>>
  explicit Sharded(Args&&... args) : Block(std::forward<Args>(args)...) {
    if (!this->is_empty()) {
      detail::declare_unit(this->ptr());
    }
  }

  template <typename... Args>
  auto operator()(Args&&... args) {
    auto hooks = detail::hooks_of_unit(*this->ptr());
    if (!hooks) {
      return Block::operator()(std::forward<Args>(args)...);
    }
    hooks->before_forward();
    auto output = [&] {
      try {
        return Block::operator()(detail::mark_input(*hooks, std::forward<Args>(args))...);
      } catch (...) {
        hooks->forward_failed();
        throw;
      }
    }();
    std::vector<at::Tensor> tensors;
    detail::collect_tensors(output, tensors);
    hooks->after_forward(tensors);
    return output;
  }
};

/// While it lives, the wrapped module holds every parameter in full: save
/// it, or load into it, as a plain module (PyTorch's summon_full_params
/// with writeback). Made by FullyShardedDataParallel::summon_full_parameters.
class FullParametersGuard {
 public:
  explicit FullParametersGuard(detail::ShardedModel& model) : model_(model) {
    model_.begin_full_parameters();
  }
  ~FullParametersGuard() {
    model_.end_full_parameters();
  }
  FullParametersGuard(const FullParametersGuard&) = delete;
  FullParametersGuard& operator=(const FullParametersGuard&) = delete;

 private:
  detail::ShardedModel& model_;
};

/// Keeps FullyShardedDataParallel's gradients local while alive (FSDP2's
/// set_requires_gradient_sync(False)): backward passes accumulate each
/// unit's gradients in full, and the next backward outside the guard
/// reduce-scatters the sum once. Made by FullyShardedDataParallel::no_sync.
class FsdpNoSyncGuard {
 public:
  explicit FsdpNoSyncGuard(detail::ShardedModel& model)
      : model_(&model), previous_(model.sync_enabled()) {
    model_->set_sync_enabled(false);
  }
  FsdpNoSyncGuard(FsdpNoSyncGuard&& other) noexcept
      : model_(std::exchange(other.model_, nullptr)), previous_(other.previous_) {}
  FsdpNoSyncGuard(const FsdpNoSyncGuard&) = delete;
  FsdpNoSyncGuard& operator=(const FsdpNoSyncGuard&) = delete;
  FsdpNoSyncGuard& operator=(FsdpNoSyncGuard&&) = delete;
  ~FsdpNoSyncGuard() {
    if (model_ != nullptr) {
      model_->set_sync_enabled(previous_);
    }
  }

 private:
  detail::ShardedModel* model_;
  bool previous_;
};

/// ZeRO-3 data parallelism: see the top of this header. Built on every rank
/// alike; `ModuleType` as DistributedDataParallel takes it.
template <typename ModuleType>
class FullyShardedDataParallel {
 public:
  FullyShardedDataParallel(ModuleType module, World world, FsdpOptions options = {})
      : module_(std::move(module)),
        model_(std::make_unique<detail::ShardedModel>(detail::module_of(module_),
                                                      std::move(world), options)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    model_->before_forward();
    auto dtype = model_->input_dtype();
    auto output = [&] {
      try {
        return detail::call_forward(module_,
                                    detail::cast_input(std::forward<Args>(args), dtype)...);
      } catch (...) {
        model_->forward_failed(std::current_exception());
        throw;
      }
    }();
    std::vector<at::Tensor> tensors;
    detail::collect_tensors(output, tensors);
    model_->after_forward(tensors);
    return output;
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// `auto guard = fsdp.no_sync();` accumulates gradients without reducing
  /// them while it lives (FsdpNoSyncGuard); each unit's gradients are held
  /// in full meanwhile.
  [[nodiscard]] FsdpNoSyncGuard no_sync() {
    return FsdpNoSyncGuard(*model_);
  }

  /// What an optimizer steps: this rank's pieces of the parameters.
  std::vector<at::Tensor> parameters() const {
    return model_->parameters();
  }
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const {
    return model_->named_parameters();
  }
  /// Collective: a copy of every parameter in full, by name, on every
  /// rank (what a plain module of the same type holds after the same steps).
  torch::OrderedDict<std::string, at::Tensor> full_parameters() {
    return model_->full_parameters();
  }
  /// Collective: the module's parameters in full while the guard lives;
  /// each rank keeps its shard of them when it ends (local). Every rank
  /// holds the whole model meanwhile.
  [[nodiscard]] FullParametersGuard summon_full_parameters() {
    return FullParametersGuard(*model_);
  }
  /// Collective: on rank `to`, `full` takes the state of `sharded` (the
  /// optimizer over parameters()) as a plain optimizer of the same type
  /// over module()->parameters() would hold it after the same steps: the
  /// consolidated state that save_checkpoint writes and any world size (or
  /// a program without lockstep) loads. Build `full` on every rank.
  void consolidate_optimizer_state(const torch::optim::Optimizer& sharded,
                                   torch::optim::Optimizer& full, int to = 0) {
    model_->consolidate_optimizer_state(sharded, full, to);
  }
  /// On every rank: `sharded` takes this rank's pieces of `full`'s state
  /// (loaded from a consolidated checkpoint, of any world size).
  void load_optimizer_state(torch::optim::Optimizer& sharded,
                            const torch::optim::Optimizer& full) {
    model_->load_optimizer_state(sharded, full);
  }
  /// Collective: a sharded checkpoint. Each rank writes its pieces of the parameters,
  /// `optimizer`'s state of them (the optimizer over parameters()) and the module's buffers to
  /// a file of its own beside `path` ("PATH.G.rankR-of-N"), then rank 0 writes `path`, which
  /// names them: no rank holds more than its shard. Under hybrid sharding the first group
  /// writes (N its size): the other groups hold the same pieces. A crash during a save leaves the previous
  /// checkpoint whole; once the new one is complete, the files of every other save beside it
  /// are removed. `path` must be where every rank that loads can read.
  void save_sharded(const std::string& path, const torch::optim::Optimizer& optimizer) {
    model_->save_sharded(path, detail::module_of(module_), optimizer);
  }
  /// Collective: takes this rank's pieces of a sharded checkpoint written at
  /// any world size, reading one at a time the files that hold part of
  /// them (a rank holds its shard and its state twice over and one file,
  /// never the model), with the optimizer's state and groups' options
  /// (rank 0's) and the buffers (this rank's place's at the same number of
  /// shards, else rank 0's; under hybrid sharding, the first group's). `optimizer` is over parameters(), of the type that saved.
  /// Raises CheckpointError on every rank, changing nothing, if any rank
  /// cannot read: a missing or damaged file, or another model's.
  void load_sharded(const std::string& path, torch::optim::Optimizer& optimizer) {
    model_->load_sharded(path, detail::module_of(module_), optimizer);
  }
  /// Collective: checks that every rank holds what all must hold alike,
  /// and raises lockstep::UsageError naming the first tensor that differs
  /// and the ranks that hold other values (one small all-gather of
  /// checksums). Each element of a parameter is held by one rank (under
  /// hybrid sharding, one rank of each group; those copies are not
  /// compared), so that the parameters have no replicas to compare; the
  /// buffers do, and
  /// ReplicaCheck::All compares them: a SyncBatchNorm's statistics agree
  /// between steps, a plain BatchNorm's are each rank's own (FSDP, as
  /// PyTorch's, does not synchronise buffers after construction).
  /// ReplicaCheck::Parameters compares nothing.
  void check_replicas(ReplicaCheck what = ReplicaCheck::All) {
    model_->check_replicas(detail::module_of(module_), what);
  }
  /// The units that hold parameters: the root ("") first, then the
  /// declared ones by their names in the module tree.
  std::vector<std::string> unit_names() const {
    return model_->unit_names();
  }
  /// The ranks that together hold each parameter's pieces once each: the
  /// wrapper's world, or under FsdpOptions::shard_group_size this rank's
  /// group. A norm over parameters() is taken over them
  /// (clip_grad_norm_(fsdp.parameters(), max, fsdp.shard_world())): over
  /// the whole world, each group's pieces would count once per group.
  World shard_world() const {
    return model_->shard_world();
  }
  /// The module. Outside forward and backward its parameters are freed
  /// (empty tensors); its buffers are its own.
  ModuleType& module() {
    return module_;
  }

 private:
  ModuleType module_;
  std::unique_ptr<detail::ShardedModel> model_;
};

} // namespace lockstep
