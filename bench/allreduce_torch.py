"""The peer of bench/allreduce.cpp: the same all-reduce loop through Python
torch.distributed (gloo), for bench/run-allreduce. Reads RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT like the C++ side."""
import os
import statistics
import time

import torch
import torch.distributed as dist


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    nbytes = 4 << 10
    while nbytes <= 64 << 20:
        tensor = torch.ones(nbytes // 4, dtype=torch.float32)
        iterations = max(10, min(200, (256 << 20) // nbytes))
        for _ in range(3):
            dist.all_reduce(tensor)
        micros = []
        for _ in range(iterations):
            tensor.fill_(1.0)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            micros.append((time.perf_counter() - start) * 1e6)
        median = statistics.median(micros)
        busbw = nbytes * 2 * (size - 1) / size / (median * 1e-6) / 1e9
        if rank == 0:
            print(f"torch-gloo,{nbytes},{iterations},{median:.1f},{busbw:.3f}", flush=True)
        nbytes *= 4
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
