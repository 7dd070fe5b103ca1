# What a rejoin costs in memory: bench_fault rejoin (LAYERS Linear(WIDTH,
# WIDTH) without bias, Adam) on 3 ranks under lockstep-run --restart rank.
# Once every rank has stepped, each rank's peak resident memory is reset
# (/proc/PID/clear_refs) and read again two steps later: the steady peak.
# Reset again, rank 2 is killed; its restart receives the live state from
# rank 0 (rank 1 is up to date and takes no part); two steps after it
# rejoined, the peaks are read again: the peak across the kill. Writes
# CSV_PATH (one row per rank and ROUND) and MD_PATH, generated from it
# (ROUNDS=0: MD_PATH again from the CSV there is).
#   rejoin_memory.py BUILD_DIR CSV_PATH MD_PATH [WIDTH=4096] [LAYERS=16] [ROUNDS=3]
import csv
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

build, csv_path, md_path = sys.argv[1:4]
width = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
layers = int(sys.argv[5]) if len(sys.argv) > 5 else 16
rounds = int(sys.argv[6]) if len(sys.argv) > 6 else 3
run = os.path.join(build, "tools/lockstep-run/lockstep-run")
bench = os.path.join(build, "bench/bench_fault")
RANKS = 3
STEPS = 14
STEP = re.compile(r"rank (\d+) pid (\d+) step (\d+) wall [0-9.]+ size (\d+)")
PID = re.compile(r"rank (\d+) pid (\d+)")
BYTES = re.compile(r"rank (\d+) incarnation (\d+) sent (\d+) received (\d+)")
MIB = 1024 * 1024


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def reset_peak(pid):
    with open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")


def one_round(number):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [run, "--nproc-per-node", str(RANKS), "--restart", "rank", "--max-restarts", "1",
            "--", bench, "rejoin", str(STEPS), str(width), str(layers)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                               text=True, start_new_session=True)
    pids, steps, lines = {}, {}, []
    phase, marks = "warm", {}
    rows = {}
    for line in process.stdout:
        lines.append(line)
        found = PID.search(line)
        if found:
            pids[int(found.group(1))] = int(found.group(2))
        found = STEP.search(line)
        if not found:
            continue
        rank, step, size = int(found.group(1)), int(found.group(3)), int(found.group(4))
        steps[rank] = step
        everyone = len(steps) == RANKS and min(steps.values())
        if phase == "warm" and everyone and everyone >= 2 and size == RANKS:
            for r in range(RANKS):
                rows[r] = {"rss_mib": status_kib(pids[r], "VmRSS") / 1024}
                reset_peak(pids[r])
            marks["steady_from"] = everyone
            phase = "steady"
        elif phase == "steady" and min(steps.values()) >= marks["steady_from"] + 2:
            for r in range(RANKS):
                rows[r]["steady_peak_mib"] = status_kib(pids[r], "VmHWM") / 1024
                reset_peak(pids[r])
            killed = pids[RANKS - 1]
            os.kill(killed, signal.SIGKILL)
            marks["killed"] = killed
            phase = "killed"
        elif phase == "killed" and size == RANKS and pids[RANKS - 1] != marks["killed"]:
            marks["rejoined_at"] = step
            phase = "rejoined"
        elif phase == "rejoined" and rank == 0 and step >= marks["rejoined_at"] + 2:
            for r in range(RANKS):
                rows[r]["kill_peak_mib"] = status_kib(pids[r], "VmHWM") / 1024
            phase = "done"
    process.wait()
    text = "".join(lines)
    with open(os.path.join(tempfile.gettempdir(), "rejoin-memory.log"), "a") as log:
        log.write(text)
    if process.returncode != 0 or phase != "done":
        sys.exit(f"rejoin_memory: round {number} ended in phase {phase} with "
                 f"{process.returncode}:\n{text[-3000:]}")
    moved = {}
    for rank, incarnation, sent, received in BYTES.findall(text):
        moved[(int(rank), int(incarnation))] = (int(sent), int(received))
    roles = {0: "sender", 1: "up to date", 2: "restarted"}
    out = []
    for rank in range(RANKS):
        sent, received = moved.get((rank, 1 if rank == RANKS - 1 else 0), (0, 0))
        out.append(dict(round=number, rank=rank, role=roles[rank], **rows[rank],
                        sent_mib=sent / MIB, received_mib=received / MIB))
    return out


parameters = width * width * layers
# What a rank holds to train: parameters, gradients, and Adam's two moments.
state_mib = 4 * parameters * 4 / MIB
results = []
for number in range(1, rounds + 1):
    results += one_round(number)
fields = ["round", "rank", "role", "rss_mib", "steady_peak_mib", "kill_peak_mib", "sent_mib",
          "received_mib"]
if rounds > 0:
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in results:
            writer.writerow({k: (f"{v:.1f}" if isinstance(v, float) else v)
                             for k, v in row.items()})

# The report, from the CSV alone.
with open(csv_path) as f:
    table = list(csv.DictReader(f))


def figures(role, field):
    values = [float(r[field]) for r in table if r["role"] == role]
    return statistics.median(values), min(values), max(values)


lines = [
    "# What a rejoin costs in memory",
    "",
    f"Generated by `bench/run-rejoin-memory` from `{os.path.basename(csv_path)}`: "
    f"{layers} layers of Linear({width}, {width}) without bias ({parameters / 1e6:.0f}M "
    f"parameters, {parameters * 4 / MIB:.0f} MiB in float32), Adam, 3 ranks on one host, "
    f"{len(set(r['round'] for r in table))} rounds. A rank that trains holds its parameters, "
    f"their gradients and Adam's two moments: {state_mib:.0f} MiB, the model and optimizer. "
    "Rank 2 is killed after two steady steps; its restart receives the live state from rank 0; "
    "rank 1 is up to date. Peaks are each process's peak resident memory (VmHWM), reset "
    "before the window they cover; the median of the rounds, with their range. "
    f"Allocator settings: GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES') or 'unset (glibc defaults)'}.",
    "",
    "| rank | role | resident before (MiB) | peak over 2 steady steps (MiB) | "
    "peak across the kill and rejoin (MiB) | added by the rejoin (MiB) | "
    "added / model and optimizer | live state sent (MiB) | received (MiB) |",
    "|---|---|---|---|---|---|---|---|---|",
]
verdicts = []
for rank, role in enumerate(["sender", "up to date", "restarted"]):
    rss = figures(role, "rss_mib")
    steady = figures(role, "steady_peak_mib")
    peak = figures(role, "kill_peak_mib")
    added = [float(r["kill_peak_mib"]) - float(r["steady_peak_mib"]) for r in table
             if r["role"] == role]
    sent = figures(role, "sent_mib")
    received = figures(role, "received_mib")
    lines.append(
        f"| {rank} | {role} | {rss[0]:.0f} | {steady[0]:.0f} ({steady[1]:.0f}-{steady[2]:.0f}) | "
        f"{peak[0]:.0f} ({peak[1]:.0f}-{peak[2]:.0f}) | {statistics.median(added):.0f} "
        f"({min(added):.0f}-{max(added):.0f}) | {statistics.median(added) / state_mib:.1%} | "
        f"{sent[0]:.0f} | {received[0]:.0f} |")
    if role != "restarted":
        verdicts.append((role, max(added), max(float(r["kill_peak_mib"]) for r in table
                                              if r["role"] == role)))
lines.append("")
for role, worst_added, worst_peak in verdicts:
    goal = 0.10 * state_mib
    lines.append(
        f"- The {role} rank: the kill and rejoin added at most {worst_added:.0f} MiB to its "
        f"peak, {worst_added / state_mib:.1%} of the model and optimizer (goal: at most 10%, "
        f"{goal:.0f} MiB): {'met' if worst_added <= goal else 'NOT met'}. Its highest peak "
        f"across a kill was {worst_peak:.0f} MiB, {worst_peak / state_mib:.2f}x the model and "
        "optimizer (the rest: LibTorch, the wrapper's buckets in shared memory, a step's "
        "temporaries).")
# What the transfer itself costs: the sender beside the rank up to date,
# which went through the same kill and re-forming without sending.
by_round = {}
for r in table:
    by_round.setdefault(r["round"], {})[r["role"]] = (
        float(r["kill_peak_mib"]) - float(r["steady_peak_mib"]))
transfer = [v["sender"] - v["up to date"] for v in by_round.values()]
lines.append(
    f"- The transfer's own cost, the sender's added peak less the up-to-date rank's in the "
    f"same round: median {statistics.median(transfer):.0f} MiB (from {min(transfer):.0f} to "
    f"{max(transfer):.0f}), for {figures('sender', 'sent_mib')[0]:.0f} MiB sent: what every "
    "rank adds comes with the re-forming, not with the transfer.")
lines.append("")
with open(md_path, "w") as f:
    f.write("\n".join(lines))
print("\n".join(lines))
