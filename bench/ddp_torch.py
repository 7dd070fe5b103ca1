"""The peer of bench/ddp_bench.cpp: the same models and loop under Python
PyTorch DistributedDataParallel (gloo, default options). Prints the same CSV
line on rank 0.

    python3 ddp_torch.py MODEL [ITERATIONS] [WARMUP]

BENCH_OPTIMIZER=adam: Adam instead of SGD, as in ddp_bench.cpp; BENCH_TORCH_ZERO=1:
Adam inside PyTorch's ZeroRedundancyOptimizer.
BENCH_NET_DEVICE: as in ddp_bench.cpp, rank 0 prints "wire,MODEL,MODE,BYTES"
to stderr, the bytes per timed iteration that device's counter saw leave.
BENCH_DEVICE=cuda: on cuda:LOCAL_RANK over NCCL, each iteration timed up to
the end of its device work, as in ddp_bench.cpp.
"""
import contextlib
import importlib
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook


class Mlp(nn.Module):
    def __init__(self, constant_buffer=False):
        super().__init__()
        widths = [1024, 2048, 2048, 2048, 10]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        if constant_buffer:
            self.register_buffer("scale", torch.ones(1024, 1024))
        else:
            self.scale = None

    def forward(self, x):
        if self.scale is not None:
            x = x * self.scale[0]
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.relu(x)
        return x


class Cnn(nn.Module):
    def __init__(self, batch_norm=False):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)
        self.bn1 = nn.BatchNorm2d(32) if batch_norm else None
        self.bn2 = nn.BatchNorm2d(64) if batch_norm else None

    def forward(self, x):
        x = self.conv1(x)
        if self.bn1 is not None:
            x = self.bn1(x)
        x = self.conv2(F.relu(x))
        if self.bn2 is not None:
            x = self.bn2(x)
        x = F.max_pool2d(F.relu(x), 2).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


class Transformer(nn.Module):
    """bench_models.h's TransformerImpl, registered in the same order."""
    VOCABULARY, WIDTH, HEADS, TOKENS = 1000, 256, 4, 32

    def __init__(self):
        super().__init__()
        width = self.WIDTH
        self.embedding = nn.Embedding(self.VOCABULARY, width)
        self.head = nn.Linear(width, 10)
        for i in range(2):
            setattr(self, f"block{i}_norm1", nn.LayerNorm(width))
            setattr(self, f"block{i}_qkv", nn.Linear(width, 3 * width))
            setattr(self, f"block{i}_proj", nn.Linear(width, width))
            setattr(self, f"block{i}_norm2", nn.LayerNorm(width))
            setattr(self, f"block{i}_up", nn.Linear(width, 4 * width))
            setattr(self, f"block{i}_down", nn.Linear(4 * width, width))

    def forward(self, ids):
        x = self.embedding(ids)
        batch, tokens, depth = x.size(0), x.size(1), self.WIDTH // self.HEADS
        for i in range(2):
            block = lambda part: getattr(self, f"block{i}_{part}")
            parts = block("qkv")(block("norm1")(x)).view(batch, tokens, 3, self.HEADS, depth)
            q, k, v = parts.permute(2, 0, 3, 1, 4)
            attended = torch.softmax(q.matmul(k.transpose(-2, -1)) / depth ** 0.5, -1).matmul(v)
            x = x + block("proj")(attended.transpose(1, 2).reshape(batch, tokens, self.WIDTH))
            x = x + block("down")(F.gelu(block("up")(block("norm2")(x))))
        return self.head(x.mean(1))


def deterministic_tokens():
    ids = torch.arange(64 * Transformer.TOKENS).mul(7919).remainder(Transformer.VOCABULARY)
    return ids.view(64, Transformer.TOKENS), torch.arange(64).remainder(10)


class Recommender(nn.Module):
    ROWS = 1000000

    def __init__(self, sparse):
        super().__init__()
        self.table = nn.EmbeddingBag(self.ROWS, 64, mode="sum", sparse=sparse)
        self.head = nn.Linear(64, 10)

    def forward(self, ids):
        return self.head(self.table(ids))


def deterministic_ids():
    ids = torch.arange(64 * 20).mul(7919).remainder(Recommender.ROWS)
    return ids.view(64, 20), torch.arange(64).remainder(10)


def deterministic_init(module):
    """The formula of bench_models.h: both sides compute on the same numbers."""
    with torch.no_grad():
        for k, param in enumerate(module.parameters()):
            scale = 1.0 / (param.numel() // param.size(0)) ** 0.5 if param.dim() > 1 else 0.01
            values = torch.arange(param.numel(), dtype=torch.float32).mul(0.37).add(float(k)).sin().mul(scale)
            param.copy_(values.view(param.shape))


def deterministic_batch(shape):
    x = torch.arange(64 * int(torch.tensor(shape).prod()), dtype=torch.float32).mul(0.11).cos().view(64, *shape)
    return x, torch.arange(64).remainder(10)


def wire_bytes():
    device = os.environ.get("BENCH_NET_DEVICE")
    if not device:
        return -1.0
    with open(f"/sys/class/net/{device}/statistics/tx_bytes") as counter:
        return float(counter.read())


def main():
    name = sys.argv[1]
    iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    warmup = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    torch.set_num_threads(1)
    cuda = os.environ.get("BENCH_DEVICE") == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    if name.startswith("mlp"):
        model, shape = Mlp(name == "mlp_const"), (1024,)
    elif name.startswith("emb"):
        model, shape = Recommender(name == "emb_sparse"), None
    elif name == "transformer":
        model, shape = Transformer(), "tokens"
    else:
        model, shape = Cnn(name == "cnn_bn"), (1, 28, 28)
    deterministic_init(model)
    model.to(device)
    # BENCH_AMP=autocast: forward and loss under bfloat16 autocast;
    # BENCH_AMP=policy: DDP's (private) mixed_precision in bfloat16.
    precision = os.environ.get("BENCH_AMP", "")
    options = {}
    if precision == "policy":
        # PyTorch 2.6's DDP frees the copies through a module it does not
        # import itself (AttributeError: ..._functional_collectives).
        importlib.import_module("torch.distributed._functional_collectives")
        from torch.nn.parallel.distributed import _MixedPrecision
        options["mixed_precision"] = _MixedPrecision(param_dtype=torch.bfloat16)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None, **options)
    # BENCH_TORCH_HOOK=fp16|bf16|powersgd:R: PyTorch's hook of that name.
    hook = os.environ.get("BENCH_TORCH_HOOK", "")
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook.startswith("powersgd"):
        state = powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=int(hook.split(":")[1]), start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    adam = os.environ.get("BENCH_OPTIMIZER") == "adam"
    # BENCH_TORCH_ZERO=1: PyTorch's ZeroRedundancyOptimizer over Adam.
    zero = os.environ.get("BENCH_TORCH_ZERO") == "1"
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    elif adam:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    if shape == "tokens":
        x, y = deterministic_tokens()
    else:
        x, y = deterministic_ids() if shape is None else deterministic_batch(shape)
    x, y = x.to(device), y.to(device)
    times = []
    # BENCH_TORCH_JOIN=1: the loop inside ddp.join(), every rank with the same batches.
    joined = os.environ.get("BENCH_TORCH_JOIN") == "1"
    wire_at_start = -1.0
    with ddp.join() if joined else contextlib.nullcontext():
        for i in range(warmup + iterations):
            if i == warmup:
                dist.barrier()
                wire_at_start = wire_bytes()
            start = time.perf_counter()
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "autocast"):
                loss = F.cross_entropy(ddp(x).float(), y)
            loss.backward()
            optimizer.step()
            if cuda:
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
    wire = torch.tensor([(wire_bytes() - wire_at_start) / iterations], dtype=torch.float64, device=device)
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        mode = "pytorch_join" if joined else "pytorch"
        if adam or zero:
            mode += "_adam"
        if zero:
            mode += "_zero"
        if hook:
            mode += "_" + hook.split(":")[0]
        if precision:
            mode += "_" + precision
        print(f"{name},{mode},{median.item():.2f},{rss.item():.0f}", flush=True)
    if wire_at_start >= 0:
        dist.all_reduce(wire, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print(f"wire,{name},{mode},{wire.item():.0f}", file=sys.stderr, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
