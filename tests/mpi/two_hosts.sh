#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces A and B joined by a veth pair (10.77.x.1 and .2, nothing
# else), mpirun started inside A with its remote agent set to a script that runs B's ranks inside B, TCP over
# the veth addresses only. Each run trains the MLP over 4 ranks (2 per host) and must match the in-process
# run bit for bit (tests/mpi/training_worker.cc). Needs root (ip netns); exits 77 (ctest: skipped) without it.
#   two_hosts.sh <mpi_training_worker>
set -euo pipefail
worker=$1
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null; then
  echo "two_hosts: needs root and iproute2 (ip netns); skipped"
  exit 77
fi
id=$$
a=ssA$id b=ssB$id
net=10.$((77 + id % 100)).$((id / 100 % 250)).0
ipa=${net%.0}.1 ipb=${net%.0}.2
agent=$(mktemp /tmp/ss_agent.XXXXXX)
cleanup() { ip netns del "$a" 2>/dev/null || true; ip netns del "$b" 2>/dev/null || true; rm -f "$agent"; }
trap cleanup EXIT
ip netns add "$a"
ip netns add "$b"
ip link add "va$id" type veth peer name "vb$id"
ip link set "va$id" netns "$a"
ip link set "vb$id" netns "$b"
ip -n "$a" addr add "$ipa/24" dev "va$id"
ip -n "$b" addr add "$ipb/24" dev "vb$id"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "va$id" up
ip -n "$b" link set "vb$id" up

# mpirun calls the agent as "agent [options] HOST COMMAND...": run COMMAND inside HOST's namespace.
cat > "$agent" <<AGENT
#!/bin/sh
while [ \$# -gt 0 ]; do case "\$1" in -*) shift ;; *) break ;; esac; done
host=\$1; shift
case "\$host" in $ipa) ns=$a ;; $ipb) ns=$b ;; *) echo "agent: unknown host \$host" >&2; exit 1 ;; esac
exec ip netns exec "\$ns" sh -c "\$*"
AGENT
chmod +x "$agent"

mpi=(mpirun --allow-run-as-root --oversubscribe --host "$ipa:2,$ipb:2" -np 4 --mca plm_rsh_agent "$agent"
     --mca btl tcp,self --mca btl_tcp_if_include "$net/24" --mca oob_tcp_if_include "$net/24")
# Where the ranks ran: two on each namespace's address.
where=$(ip netns exec "$a" timeout 60 "${mpi[@]}" sh -c 'ip -o -4 addr show | grep -o "inet [0-9.]*" | grep -v 127.0.0.1' | sort | uniq -c)
echo "ranks per host: $(echo $where)"
[ "$(echo "$where" | grep -c " 2 inet ")" = 2 ] || { echo "two_hosts: ranks did not run 2 per namespace"; exit 1; }
for args in "--optimizer adam --shard on" "--optimizer lamb --shard on"; do
  out=$(ip netns exec "$a" timeout 120 "${mpi[@]}" "$worker" $args --steps 20 2>&1) || { echo "$out"; exit 1; }
  echo "$out" | grep "bitwise equal to in-process: 4 ranks" || { echo "$out"; exit 1; }
done
echo "two_hosts: passed"
