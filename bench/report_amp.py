"""Writes docs/bench-amp.md from bench/run-amp's measurements.

    report_amp.py RESULTS BYTES OUT_MD ITERATIONS ROUNDS TORCH_VERSION OPENBLAS_CORETYPE
"""
import collections
import datetime
import statistics
import sys

results, bytes_file, out, iterations, rounds, torch_version, coretype = sys.argv[1:]

ms, rss, models = collections.defaultdict(list), {}, []
for line in open(results).readlines()[1:]:
    model, mode, median, peak = line.strip().split(",")
    if model not in models:
        models.append(model)
    if median == "failed":
        continue
    ms[(model, mode)].append(float(median))
    rss[(model, mode)] = max(rss.get((model, mode), 0.0), float(peak))
reduced = {}
for line in open(bytes_file):
    _, model, mode, count = line.strip().split(",")
    reduced[(model, mode)] = int(count)

PRECISIONS = [("", "float32"), ("_autocast", "bfloat16 autocast"), ("_policy", "bfloat16 policy")]


def median(model, mode):
    values = ms.get((model, mode))
    return statistics.median(values) if values else None


def cell(value, digits=1):
    return "failed" if value is None else f"{value:.{digits}f}"


lines = [
    "# Mixed precision on the CPU: lockstep and PyTorch DDP",
    "",
    f"Written by bench/run-amp on {datetime.date.today()}: 2 ranks x 1 intra-op thread,",
    f"batch 64 per rank, the median of {iterations} timed iterations, the median of {rounds}",
    f"rounds; PyTorch {torch_version} beside lockstep on the same LibTorch. Float32 is",
    "the plain loop; autocast runs forward and loss under bfloat16 autocast",
    "(lockstep::amp::Autocast, torch.autocast); the policy is DDP's mixed-precision",
    "policy in bfloat16 (lockstep::MixedPrecision; PyTorch's private _MixedPrecision),",
    "which averages the gradients in bfloat16. Reduced: the bytes lockstep's buckets",
    "put on the wire per iteration and rank (PyTorch's are the same tensors: float32",
    "gradients under autocast, bfloat16 under its policy). PyTorch's DDP",
    "mixed_precision does not run on the CPU (it makes a torch.Stream: \"Tried to",
    "instantiate dummy base class Stream\"), hence failed. OpenBLAS kernels:",
    f"{coretype}.",
    "",
    "| model | precision | lockstep ms | PyTorch ms | lockstep / PyTorch | vs float32 | lockstep RSS MiB | PyTorch RSS MiB | reduced MB |",
    "|---|---|---|---|---|---|---|---|---|",
]
for model in models:
    base = median(model, "lockstep")
    for suffix, name in PRECISIONS:
        ours, theirs = median(model, "lockstep" + suffix), median(model, "pytorch" + suffix)
        ratio = f"{ours / theirs:.2f}" if ours and theirs else "-"
        speed = f"{base / ours:.2f}x" if ours and base else "-"
        sent = reduced.get((model, "lockstep" + suffix))
        lines.append(
            f"| {model} | {name} | {cell(ours)} | {cell(theirs)} | {ratio} | {speed} | "
            f"{cell(rss.get((model, 'lockstep' + suffix)), 0)} | "
            f"{cell(rss.get((model, 'pytorch' + suffix)), 0)} | "
            f"{'-' if sent is None else f'{sent / 1e6:.2f}'} |"
        )
lines.append("")
open(out, "w").write("\n".join(lines))
