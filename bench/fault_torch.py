# The peer of bench_fault checkpoint under torchrun: PyTorch DDP (Gloo) on
# the 10.5M MLP, batch 64 per rank, SGD, a checkpoint every EVERY steps
# (rank 0), resumed from at start; prints "rank R pid P step S wall MS size N".
#   torchrun --nproc_per_node 2 --max_restarts 1 fault_torch.py STEPS EVERY DIR
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def main():
    steps, every, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rank = int(os.environ["RANK"])
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    widths = [1024, 2048, 2048, 2048, 10]
    layers = []
    for i in range(4):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < 3:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, 1024)
    y = torch.randint(0, 10, (64,))
    path = os.path.join(folder, "torch-checkpoint.pt")
    step = 0
    if os.path.exists(path):
        saved = torch.load(path)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        print(f"rank {rank} resumed at step {step}", flush=True)
    while step < steps:
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        step += 1
        print(f"rank {rank} pid {os.getpid()} step {step} wall {time.time() * 1000:.1f} "
              f"size {dist.get_world_size()}", flush=True)
        if step % every == 0 and dist.get_rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step}, path + ".tmp")
            os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
