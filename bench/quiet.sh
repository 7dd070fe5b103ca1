# Sourced by the benches that need the machine to themselves:
# wait_for_quiet NAME waits (up to 3 minutes; a build just finished takes a
# minute or two to leave the average) for the one-minute load average to
# fall below 1, sets $load to it, and refuses to go on past that.
wait_for_quiet() {
  for _ in $(seq 18); do
    load=$(cut -d' ' -f1 /proc/loadavg)
    awk -v load="$load" 'BEGIN { exit !(load > 1.0) }' || return 0
    sleep 10
  done
  echo "$1: the load average is $load: something else runs; stop it first" >&2
  exit 1
}
