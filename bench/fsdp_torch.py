"""PyTorch's peer of bench/fsdp_bench.cpp: the same model, Adam and
measurements, with torch.distributed on Gloo. Rank 0 prints one CSV line:

  mode,ms_per_step,peak_train_mib,peak_build_mib,state_mib_per_rank,baseline_mib,after_build_mib,
      ms_fastest,ms_slowest

  fsdp_torch.py MODE [ITERATIONS=10] [WIDTH=1024] [DEPTH=18] [BATCH=16]
  MODE: ddp | fsdp (FullyShardedDataParallel, FULL_SHARD, each block a unit)
        | fsdp_kept (SHARD_GRAD_OP: parameters kept from forward to backward)
        | fsdp2 (fully_shard on each block and the root)

A mode that cannot run here prints "MODE,failed: <why>" instead.
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def status_mib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return float(line.split()[1]) / 1024.0
    return -1.0


def largest(value):
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def wrap(mode, model, ranks):
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model), 4.0
    if mode in ("fsdp", "fsdp_kept"):
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        strategy = ShardingStrategy.FULL_SHARD if mode == "fsdp" else ShardingStrategy.SHARD_GRAD_OP
        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy,
            device_id=torch.device("cpu"), use_orig_params=True)
        return wrapped, 4.0 / ranks
    if mode == "fsdp2":
        from torch.distributed._composable.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, 4.0 / ranks
    raise SystemExit(f"fsdp_torch.py: unknown mode {mode}")


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
    iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    width = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    depth = int(sys.argv[4]) if len(sys.argv) > 4 else 18
    batch = int(sys.argv[5]) if len(sys.argv) > 5 else 16
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    baseline = largest(status_mib("VmRSS"))
    torch.manual_seed(0)
    model = Stack(width, depth)
    parameters = sum(p.numel() for p in model.parameters())
    try:
        wrapped, state_factor = wrap(mode, model, ranks)
        optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-4)
        build_peak = largest(status_mib("VmHWM"))
        after_build = largest(status_mib("VmRSS"))
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        generator = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(batch, width, generator=generator)
        y = torch.randn(batch, width, generator=generator)
        times = []
        for i in range(iterations + 1):
            start = time.perf_counter()
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
            optimizer.step()
            dist.barrier()
            if i > 0:
                times.append((time.perf_counter() - start) * 1000.0)
    except Exception as error:  # a mode that does not run on this machine
        if rank == 0:
            print(f"{mode},failed: {type(error).__name__}: {str(error).splitlines()[0]}",
                  flush=True)
        os._exit(0)
    step_ms = largest(statistics.median(times))
    fastest_ms, slowest_ms = largest(min(times)), largest(max(times))
    train_peak = largest(status_mib("VmHWM"))
    state = state_factor * parameters * 4 / (1 << 20)
    if rank == 0:
        print(f"{mode},{step_ms:.0f},{train_peak:.0f},{build_peak:.0f},{state:.0f},"
              f"{baseline:.0f},{after_build:.0f},{fastest_ms:.0f},{slowest_ms:.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
