"""docs/bench-fsdp.md from bench/run-fsdp's CSV lines (see that script)."""

import csv
import sys

(results, limited, output, iterations, limit_mib, torch_version, shape, bound_iterations,
 bound_shape) = sys.argv[1:10]
width, depth, batch = (int(v) for v in shape.split())
bound_depth = int(bound_shape.split()[1])
every_row = list(csv.DictReader(open(results)))
rows = [row for row in every_row if row["section"] == "main"]
bound_rows = [row for row in every_row if row["section"] == "bound"]
unit_mib = (8 * width * width + 7 * width) * 4 / (1 << 20)


def parameters_m(blocks):
    return (blocks * (8 * width * width + 7 * width) + width * width + width) / 1e6


def number(row, key):
    try:
        return float(row[key])
    except (KeyError, TypeError, ValueError):
        return None


def find(side, mode, among=None):
    for row in rows if among is None else among:
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
    f"bench/run-fsdp: {parameters_m(depth):.0f}M parameters ({depth} blocks of LayerNorm, "
    f"Linear {width} -> {4 * width}, GELU, Linear back, each an FSDP unit, then a Linear head), "
    f"float32, Adam, batch {batch} per rank, 4 ranks x 1 intra-op thread on one host, "
    f"median (and range) of {iterations} steps after the first. PyTorch {torch_version} on "
    "Gloo, in the same run.",
    "",
    "- **peak** is the largest resident set over the ranks while training (the kernel's "
    "peak is reset once the model is built and wrapped); **above base** subtracts what a "
    "rank holds before it builds the model (LibTorch, the world's connections).",
    "- **state** is the parameters, gradients and Adam moments one rank holds by the "
    "mode's own account; **build** the peak while every rank built the whole model (a "
    "C++ module makes its parameters where it is constructed).",
    "",
    "| side | mode | ms/step (range) | vs the side's DDP | peak MiB | above base | state MiB | "
    "build MiB |",
    "|---|---|---|---|---|---|---|---|",
]
for row in rows:
    ms = number(row, "ms_per_step")
    if ms is None:
        why = row["ms_per_step"] or "failed"
        lines.append(f"| {row['side']} | {names.get(row['mode'], row['mode'])} | {why} | | | | | |")
        continue
    spread = (f" ({number(row, 'ms_fastest'):.0f}-{number(row, 'ms_slowest'):.0f})"
              if number(row, "ms_fastest") is not None else "")
    ddp = find(row["side"], "ddp")
    ddp_ms = number(ddp, "ms_per_step") if ddp else None
    ratio = f"{ms / ddp_ms:.2f}" if ddp_ms else "-"
    peak = number(row, "peak_train_mib")
    above = peak - number(row, "baseline_mib")
    lines.append(
        f"| {row['side']} | {names.get(row['mode'], row['mode'])} | {ms:.0f}{spread} | {ratio} | "
        f"{peak:.0f} | {above:.0f} | {number(row, 'state_mib_per_rank'):.0f} | "
        f"{number(row, 'peak_build_mib'):.0f} |")

# The unused Linear makes the last block the largest unit.
largest_units = {"fsdp_unused": unit_mib + (width * width + width) * 4 / (1 << 20) + unit_mib}


def bound_of(row):
    """The goal: 1/N of the state + the two largest units' parameters + 15%."""
    units = largest_units.get(row["mode"], 2 * unit_mib)
    return number(row, "state_mib_per_rank"), units, (number(row, "state_mib_per_rank") + units) * 1.15


lines += ["", "## Goals", ""]
for mode in ("fsdp", "fsdp_frozen", "fsdp_unused"):
    row = find("lockstep", mode)
    if not row or number(row, "ms_per_step") is None:
        continue
    state, units, budget = bound_of(row)
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

lines += [
    "", f"## The memory bound, raw, at {bound_depth} blocks", "",
    f"The same blocks, {bound_depth} of them: {parameters_m(bound_depth):.0f}M parameters, "
    f"{bound_iterations} steps after the first (memory only: the peak comes in the first "
    "step's backward). Here the state dwarfs the base, which the bound at "
    f"{depth} blocks cannot absorb. DDP would need {parameters_m(bound_depth) * 16 / 1000:.1f} GB "
    f"of state per rank, {4 * parameters_m(bound_depth) * 16 / 1000:.0f} GB for the four.", "",
    "| side | mode | peak MiB | above base | state MiB | bound MiB | raw peak within the bound |",
    "|---|---|---|---|---|---|---|"]
for row in bound_rows:
    peak = number(row, "peak_train_mib")
    if peak is None:
        lines.append(f"| {row['side']} | {names.get(row['mode'], row['mode'])} | "
                     f"{row['ms_per_step'] or 'failed'} | | | | |")
        continue
    state, units, budget = bound_of(row)
    above = peak - number(row, "baseline_mib")
    lines.append(
        f"| {row['side']} | {names.get(row['mode'], row['mode'])} | {peak:.0f} | {above:.0f} | "
        f"{state:.0f} | {budget:.0f} | {'met' if peak <= budget else 'missed'} |")

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
