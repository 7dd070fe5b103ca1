"""docs/bench-fsdp.md from bench/run-fsdp's CSV lines (see that script)."""

import csv
import sys

results, limited, output, iterations, limit_mib, torch_version, shape = sys.argv[1:8]
width, depth, batch = (int(v) for v in shape.split())
rows = list(csv.DictReader(open(results)))
unit_mib = (8 * width * width + 7 * width) * 4 / (1 << 20)
parameters_m = (depth * (8 * width * width + 7 * width) + width * width + width) / 1e6


def number(row, key):
    try:
        return float(row[key])
    except (KeyError, TypeError, ValueError):
        return None


def find(side, mode):
    for row in rows:
        if row["side"] == side and row["mode"] == mode:
            return row
    return None


names = {
    "ddp": "DDP",
    "zero1": "DDP + ZeRO-1 (ZeroRedundancyOptimizer, element slices)",
    "zero2": "DDP + ZeRO-2 (shard_gradients: buckets reduce-scattered)",
    "fsdp": "FSDP (ZeRO-3), reshard after forward",
    "fsdp_kept": "FSDP, parameters kept from forward to backward",
    "fsdp_prefetch": "FSDP, reshard after forward, prefetching the next unit",
    "fsdp_frozen": "FSDP, first block frozen, every other block's LayerNorm frozen",
    "fsdp_unused": "FSDP, an unused Linear in the last block",
    "fsdp2": "FSDP2 fully_shard",
}
lines = [
    "# FSDP: memory and time per rank",
    "",
    f"bench/run-fsdp: {parameters_m:.0f}M parameters ({depth} blocks of LayerNorm, "
    f"Linear {width} -> {4 * width}, GELU, Linear back, each an FSDP unit, then a Linear head), "
    f"float32, Adam, batch {batch} per rank, 4 ranks x 1 intra-op thread on one host, "
    f"median of {iterations} steps after the first. PyTorch {torch_version} on Gloo.",
    "",
    "- **peak** is the largest resident set over the ranks while training (the kernel's "
    "peak is reset once the model is built and wrapped); **above base** subtracts what a "
    "rank holds before it builds the model (LibTorch, the world's connections).",
    "- **state** is the parameters, gradients and Adam moments one rank holds by the "
    "mode's own account; **build** the peak while every rank built the whole model (a "
    "C++ module makes its parameters where it is constructed).",
    "",
    "| side | mode | ms/step | vs the side's DDP | peak MiB | above base | state MiB | build MiB |",
    "|---|---|---|---|---|---|---|---|",
]
for row in rows:
    ms = number(row, "ms_per_step")
    if ms is None:
        why = row["ms_per_step"] or "failed"
        lines.append(f"| {row['side']} | {names.get(row['mode'], row['mode'])} | {why} | | | | | |")
        continue
    ddp = find(row["side"], "ddp")
    ddp_ms = number(ddp, "ms_per_step") if ddp else None
    ratio = f"{ms / ddp_ms:.2f}" if ddp_ms else "-"
    peak = number(row, "peak_train_mib")
    above = peak - number(row, "baseline_mib")
    lines.append(
        f"| {row['side']} | {names.get(row['mode'], row['mode'])} | {ms:.0f} | {ratio} | "
        f"{peak:.0f} | {above:.0f} | {number(row, 'state_mib_per_rank'):.0f} | "
        f"{number(row, 'peak_build_mib'):.0f} |")

lines += ["", "## Goals", ""]
# The unused Linear makes the last block the largest unit.
largest_units = {"fsdp_unused": unit_mib + (width * width + width) * 4 / (1 << 20) + unit_mib}
for mode in ("fsdp", "fsdp_frozen", "fsdp_unused"):
    row = find("lockstep", mode)
    if not row or number(row, "ms_per_step") is None:
        continue
    state = number(row, "state_mib_per_rank")
    units = largest_units.get(mode, 2 * unit_mib)
    budget = (state + units) * 1.15
    peak = number(row, "peak_train_mib")
    above = peak - number(row, "baseline_mib")
    lines.append(
        f"- {names[mode]}: peak per rank {peak:.0f} MiB raw ({above:.0f} above the base), "
        f"against 1/N of the state ({state:.0f}) + the two largest units' parameters "
        f"({units:.0f}) + 15% = {budget:.0f} MiB: raw {'met' if peak <= budget else 'missed'}, "
        f"above the base {'met' if above <= budget else 'missed'}.")
ours = find("lockstep", "fsdp")
if ours and number(ours, "ms_per_step") is not None:
    ddp = find("lockstep", "ddp")
    if ddp and number(ddp, "ms_per_step"):
        ratio = number(ours, "ms_per_step") / number(ddp, "ms_per_step")
        lines.append(f"- Step time {ratio:.2f}x DDP's (goal 1.3x at most): "
                     f"{'met' if ratio <= 1.3 else 'missed'}.")
    theirs = find("pytorch", "fsdp")
    if theirs and number(theirs, "ms_per_step") is not None:
        lines.append(
            f"- Against PyTorch's FSDP in the same run: {number(ours, 'ms_per_step'):.0f} ms "
            f"against {number(theirs, 'ms_per_step'):.0f}, peak {number(ours, 'peak_train_mib'):.0f} "
            f"MiB against {number(theirs, 'peak_train_mib'):.0f}.")

lines += ["", f"## Every rank held to {limit_mib} MiB of address space (ulimit -v)", "",
          "| side | mode | result |", "|---|---|---|"]
for row in csv.reader(open(limited)):
    side, mode, result = row[0], row[1], row[2]
    detail = ",".join(row[3:])
    if result == "trained":
        fields = detail.split(",")
        detail = f"{fields[0]} ms/step, peak {fields[1]} MiB"
    lines.append(f"| {side} | {names.get(mode, mode)} | {result}: {detail} |")
open(output, "w").write("\n".join(lines) + "\n")
