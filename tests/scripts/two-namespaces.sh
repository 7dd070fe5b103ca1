# Sourced by the two-nodes-* scripts: two machines, played by two network
# namespaces joined by a veth pair. After `two_namespaces NAME PREFIX
# SUBNET`: $ns0 and $ns1 are the namespaces (node 0 at SUBNET.1, node 1 at
# SUBNET.2, on veth0-$suffix and veth1-$suffix), $scratch a folder; both go
# when the script exits, with every process left in them. Exits 77
# (skipped) where namespaces cannot be made or entered.

cleanup_namespaces() {
  for ns in "$ns0" "$ns1"; do
    for pid in $(ip netns pids "$ns" 2> /dev/null); do kill -9 "$pid" 2> /dev/null; done
    ip netns delete "$ns" 2> /dev/null
  done
  rm -rf "$scratch"
}

two_namespaces() { # name prefix subnet
  local name=$1 prefix=$2 subnet=$3
  suffix=$$
  ns0=$prefix"0-"$suffix
  ns1=$prefix"1-"$suffix
  scratch=$(mktemp -d)
  trap cleanup_namespaces EXIT
  # A chroot whose root is not a mount point (a plain debootstrap folder)
  # could make namespaces but not enter them (`ip netns exec` needs
  # `mount --make-rslave /`): skip before leaving /run/netns mounted there.
  if ! mountpoint -q /; then
    echo "$name: / is not a mount point here, so no network namespace can be entered; skipped"
    exit 77
  fi
  if ! command -v nft > /dev/null; then
    echo "$name: nftables is missing (scripts/setup installs it); skipped"
    exit 77
  fi
  if [ "$(id -u)" -ne 0 ] || ! ip netns add "$ns0" 2> /dev/null; then
    echo "$name: cannot create network namespaces here (needs root and iproute2); skipped"
    exit 77
  fi
  ip netns add "$ns1"
  ip link add "veth0-$suffix" type veth peer name "veth1-$suffix"
  ip link set "veth0-$suffix" netns "$ns0"
  ip link set "veth1-$suffix" netns "$ns1"
  ip -n "$ns0" addr add "$subnet.1/24" dev "veth0-$suffix"
  ip -n "$ns1" addr add "$subnet.2/24" dev "veth1-$suffix"
  for ns in "$ns0" "$ns1"; do
    ip -n "$ns" link set lo up
  done
  ip -n "$ns0" link set "veth0-$suffix" up
  ip -n "$ns1" link set "veth1-$suffix" up
}

print_stacks() { # program: where each of its processes waits (gdb), on stderr
  command -v gdb > /dev/null || return 0
  for pid in $(pgrep -x "$(basename "$1")"); do
    echo "---- stacks of rank process $pid ----" >&2
    timeout -s KILL 20 gdb -batch -nx -p "$pid" -ex "thread apply all bt" 2>&1 |
      grep -E "^Thread|^#" >&2
  done
}

wait_for() { # seconds file pattern: whether the pattern shows in the file in time
  local tries=$(($1 * 10))
  for _ in $(seq "$tries"); do
    grep -q "$3" "$2" 2> /dev/null && return 0
    sleep 0.1
  done
  return 1
}
