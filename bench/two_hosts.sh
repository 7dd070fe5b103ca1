# Two hosts on one machine, for bench/run-hosts and bench/run-diloco: two
# network namespaces joined by a veth pair, whose bandwidth tc's token
# bucket (tbf) limits (shape_link 1gbit | 100mbit | unlimited). Sourced after
# root, build_dir and iterations are set and the script runs as root; sets
# hosts, devices, addresses, scratch (removed at exit with the namespaces),
# torch26 (PyTorch 2.6's root, or empty) and wire, and defines
# one_stream, on_hosts and measure SETTING MODE RANKS_PER_HOST KIND ARGS...,
# which appends the configuration's line to $results (its wire bytes to
# $wire), timing $iterations after ${bench_warmup:-10} of warm-up.

# PyTorch 2.6, from the Debian 13 root that scripts/test-debian 13 keeps.
torch26=${LOCKSTEP_DEBIAN_CACHE:-/var/cache/lockstep-debian}/trixie
[ -d "$torch26/usr/lib/python3/dist-packages/torch" ] || torch26=

suffix=$$
hosts=(lockstep-bench-host0-$suffix lockstep-bench-host1-$suffix)
devices=(vethb0-$suffix vethb1-$suffix)
addresses=(192.168.79.1 192.168.79.2)
scratch=$(mktemp -d)
cleanup() {
  for ns in "${hosts[@]}"; do
    for pid in $(ip netns pids "$ns" 2> /dev/null); do kill -9 "$pid" 2> /dev/null; done
    ip netns delete "$ns" 2> /dev/null
  done
  rm -rf "$scratch"
}
trap cleanup EXIT
ip link add "${devices[0]}" type veth peer name "${devices[1]}"
for host in 0 1; do
  ip netns add "${hosts[$host]}"
  ip link set "${devices[$host]}" netns "${hosts[$host]}"
  ip -n "${hosts[$host]}" addr add "${addresses[$host]}/24" dev "${devices[$host]}"
  ip -n "${hosts[$host]}" link set lo up
  ip -n "${hosts[$host]}" link set "${devices[$host]}" up
done

# Both ends of the link get the same token bucket: RATE or "unlimited".
# The bucket holds 2 ms of traffic, so that the timer's granularity does
# not cap the rate below what is asked.
shape_link() {
  local rate=$1 host
  for host in 0 1; do
    ip netns exec "${hosts[$host]}" tc qdisc del dev "${devices[$host]}" root 2> /dev/null || true
    if [ "$rate" != unlimited ]; then
      local bits
      case $rate in
        *gbit) bits=${rate%gbit}000000000 ;;
        *mbit) bits=${rate%mbit}000000 ;;
        *) echo "shape_link: a rate in gbit or mbit, or unlimited; not $rate" >&2; return 2 ;;
      esac
      ip netns exec "${hosts[$host]}" tc qdisc add dev "${devices[$host]}" root tbf \
        rate "$rate" burst $((bits / 8 / 500)) latency 50ms
    fi
  done
}

# What one TCP stream carries from host 0 to host 1: Gbit/s.
one_stream() {
  ip netns exec "${hosts[1]}" /usr/bin/python3 -c '
import socket
server = socket.create_server(("0.0.0.0", 29599)); connection, _ = server.accept()
while connection.recv(1 << 20): pass' &
  local sink=$!
  sleep 0.5
  ip netns exec "${hosts[0]}" /usr/bin/python3 -c '
import socket, time
stream = socket.create_connection(("'"${addresses[1]}"'", 29599)); block = bytes(1 << 20)
start = time.perf_counter()
for _ in range(256): stream.sendall(block)
stream.shutdown(socket.SHUT_WR); stream.recv(1)
print(f"{256 * 8 * (1 << 20) / (time.perf_counter() - start) / 1e9:.2f}")'
  wait $sink
}

# Starts RANKS_PER_HOST ranks on each host and waits for them: rank r on host
# r / RANKS_PER_HOST. With 1 rank per host, host h's rank runs on core h.
on_hosts() { # ranks-per-host command...
  local per_host=$1; shift
  local port=$((20000 + RANDOM % 20000)) pids=() rank status=0
  local size=$((2 * per_host))
  for ((rank = 0; rank < size; rank++)); do
    local host=$((rank / per_host)) pin=()
    [ "$per_host" = 1 ] && pin=(taskset -c "$host")
    ip netns exec "${hosts[$host]}" env RANK=$rank WORLD_SIZE=$size \
      LOCAL_RANK=$((rank % per_host)) LOCAL_WORLD_SIZE=$per_host \
      MASTER_ADDR="${addresses[0]}" MASTER_PORT=$port GLOO_SOCKET_IFNAME="${devices[$host]}" \
      BENCH_NET_DEVICE="${devices[$host]}" OMP_NUM_THREADS=1 USE_LIBUV=0 \
      "${pin[@]}" timeout 600 "$@" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  return $status
}

# PyTorch 2.6 in the Debian 13 root: proc and sys mounted inside the
# namespace's own mount namespace, so that the counter is this host's.
torch26_python() { # args...
  sh -c 'mount -t proc proc "$0/proc" && mount -t sysfs sys "$0/sys" &&
    exec chroot "$0" /usr/bin/python3 /tmp/ddp_torch.py "$@"' "$torch26" "$@"
}
export -f torch26_python
export torch26
[ -n "$torch26" ] && cp "$root/bench/ddp_torch.py" "$torch26/tmp/ddp_torch.py"

wire=$scratch/wire
: > "$wire"
# One configuration: SETTING MODE ranks-per-host kind args...; its line in
# the results (renamed MODE), its wire bytes, or "failed".
measure() {
  local setting=$1 mode=$2 per_host=$3 kind=$4; shift 4
  local line timeline=()
  echo "bench: $setting, $mode" >&2
  case $kind in
    lockstep)
      [ -n "${BENCH_HOSTS_TIMELINE:-}" ] &&
        timeline=(LOCKSTEP_TIMELINE="$BENCH_HOSTS_TIMELINE/$setting-$mode")
      line=$(on_hosts "$per_host" env "${timeline[@]}" "$@" "$build_dir/bench/bench_ddp" mlp lockstep \
        "$iterations" ${bench_warmup:+"$bench_warmup"} 2> "$scratch/err") || line=failed ;;
    pytorch) line=$(on_hosts "$per_host" env "$@" /usr/bin/python3 "$root/bench/ddp_torch.py" mlp \
        "$iterations" ${bench_warmup:+"$bench_warmup"} 2> "$scratch/err") || line=failed ;;
    pytorch26) line=$(on_hosts "$per_host" env "$@" bash -c 'torch26_python "$@"' _ mlp \
        "$iterations" ${bench_warmup:+"$bench_warmup"} 2> "$scratch/err") || line=failed ;;
  esac
  if [ "$line" = failed ]; then
    echo "$setting,$mode,failed,0" >> "$results"
    tail -3 "$scratch/err" >&2
  else
    echo "$line" | sed "s/^mlp,[a-z0-9_]*,/$setting,$mode,/" >> "$results"
    sed -n "s/^wire,mlp,[a-z0-9_]*,/$setting,$mode,/p" "$scratch/err" >> "$wire"
  fi
}

