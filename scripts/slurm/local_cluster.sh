#!/usr/bin/env bash
# A real Slurm on this machine, to try the sbatch templates and the Slurm launcher (and to test them in CI):
#   sudo bash scripts/slurm/local_cluster.sh start              # one node: this host
#   sudo bash scripts/slurm/local_cluster.sh start --nodes 2    # two nodes, each its own network host
#   sudo bash scripts/slurm/local_cluster.sh status
#   sudo bash scripts/slurm/local_cluster.sh fail cat-n2        # the node is lost: link down, everything on it killed
#   sudo bash scripts/slurm/local_cluster.sh stop               # daemons, namespaces, bridge, addresses: all gone
# Idempotent (a `start` after `fail` brings the lost node back). Debian's slurm-wlm and munge, a generated munge
# key, slurmctld and slurmd as root, one partition "local", job-completion records for `sacct -c`.
#
# With --nodes N (N >= 2) node i is "cat-n<i>": a slurmd in its own network and UTS namespace (hostname cat-n<i>,
# address $NET.<10+i> on a bridge "catslurm0" this script creates, the controller at $NET.1 on the bridge). Names
# resolve inside the nodes through /etc/netns/cat-n<i>/hosts (ip-netns bind-mounts it as their /etc/hosts).
# The nodes share this machine's filesystem, munge socket and CPUs; packets go only between the bridge, the
# nodes and the loopback (nothing is routed: the bridge has no uplink and forwarding is left as it is).
# State and logs live in $CAT_SLURM_DIR (default /tmp/cat-slurm). Needs root.
#
# It ends only what it started: the daemons whose PID files are in $CAT_SLURM_DIR (each checked to still be that
# daemon), their job steps, and munged only if it started munged; a site's own Slurm or munge is left running.
# `stop` returns once they are gone (or names the one it could not end); `start` gives up after
# $CAT_SLURM_START_S seconds (default 120) with the daemon or node that did not come up and its log's end.
set -euo pipefail

STATE=${CAT_SLURM_DIR:-/tmp/cat-slurm}
NET=${CAT_SLURM_NET:-10.231.0}  # the bridge's /24; refused if this machine already routes it elsewhere
BRIDGE=catslurm0
CONF_DIR=/etc/slurm
HOST=$(hostname -s)
START_S=${CAT_SLURM_START_S:-120}

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

# The PID in one of our PID files, if that process lives and is the daemon named (a PID can be reused).
our_pid() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] && [ "$(ps -o comm= -p "$pid" 2>/dev/null)" = "$2" ] && echo "$pid"
}
# Every daemon of ours that lives, as "PID NAME" lines.
our_daemons() {
    local file name
    for file in "$STATE"/*.pid; do
        [ -e "$file" ] || continue
        name=$(basename "$file" .pid)
        name=${name%%-*}  # slurmd-cat-n2 -> slurmd
        our_pid "$file" "$name" | sed "s/\$/ $name/" || true
    done
}
# PID and all its descendants.
with_descendants() {
    local pid=$1 child
    echo "$pid"
    for child in $(pgrep -P "$pid" 2>/dev/null || true); do with_descendants "$child"; done
}
# The daemon's PID once its PID file names it (daemons write it after they fork), or fail with its log's end.
wait_for_pid() {
    local file=$1 name=$2 log=$3
    for _ in $(seq 50); do our_pid "$file" "$name" >/dev/null && return 0; sleep 0.2; done
    die "$name did not start (no live process in $file); the end of $log: $(tail -n 3 "$log" 2>/dev/null | tr '\n' ' ')"
}
[ "$(id -u)" = 0 ] || die "needs root (slurmd runs as root)"

node_names() { ls /var/run/netns 2>/dev/null | grep -E '^cat-n[0-9]+$' | sort -V || true; }

install_packages() {
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
        echo "installing slurm-wlm and munge (Debian packages)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
    fi
}

# The site's munged if one runs (left alone, and never stopped here), else ours, its PID recorded.
start_munge() {
    mkdir -p "$STATE"
    if pgrep -x munged >/dev/null; then return; fi
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge
    chmod 0700 /etc/munge
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do [ -s /run/munge/munged.pid ] && break; sleep 0.2; done
    cp /run/munge/munged.pid "$STATE/munged.pid" 2>/dev/null || die "munged did not start (no /run/munge/munged.pid)"
    wait_for_pid "$STATE/munged.pid" munged /var/log/munge/munged.log
}

start_slurmctld() {
    our_pid "$STATE/slurmctld.pid" slurmctld >/dev/null || slurmctld || die "slurmctld exited with status $?: see $STATE/slurmctld.log"
    wait_for_pid "$STATE/slurmctld.pid" slurmctld "$STATE/slurmctld.log"
}

# The bridge with the controller's address, then per node a namespace joined to it by a veth pair.
start_network() {
    local nodes=$1 i name
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        if ip route show | grep -q "^$NET\.0/24"; then die "$NET.0/24 is already routed on this machine; set CAT_SLURM_NET"; fi
        ip link add "$BRIDGE" type bridge
        ip addr add "$NET.1/24" dev "$BRIDGE"
        ip link set "$BRIDGE" up
    fi
    for i in $(seq "$nodes"); do
        name=cat-n$i
        ip netns add "$name" 2>/dev/null || true
        if ! ip link show "$name-h" >/dev/null 2>&1; then
            ip -n "$name" link del eth0 2>/dev/null || true
            ip link add "$name-h" type veth peer name eth0 netns "$name"
            ip link set "$name-h" master "$BRIDGE" up
            ip -n "$name" addr add "$NET.$((10 + i))/24" dev eth0
        fi
        ip -n "$name" link set lo up
        ip -n "$name" link set eth0 up
        mkdir -p "/etc/netns/$name"
        {
            echo "127.0.0.1 localhost"
            echo "$NET.1 $HOST"
            for j in $(seq "$nodes"); do echo "$NET.$((10 + j)) cat-n$j"; done
        } > "/etc/netns/$name/hosts"
        echo "$name" > "/etc/netns/$name/hostname"
    done
}

write_config() {
    local nodes=$1 mem cpus i
    cpus=$(nproc)
    [ "$cpus" -ge 2 ] || cpus=2  # two one-CPU jobs side by side on every node (the shared CPUs are oversubscribed)
    mem=$(awk -v n="$nodes" '/MemTotal/ {print int($2 / 1024 * 0.9 / n)}' /proc/meminfo)
    mkdir -p "$CONF_DIR" "$STATE/ctld" "$STATE/spool"
    {
        cat <<CONF
ClusterName=cat-local
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/slurmctld.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=20
SchedulerParameters=bf_interval=1
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/jobcomp.txt
AccountingStorageType=accounting_storage/none
CONF
        if [ "$nodes" = 1 ]; then
            cat <<CONF
SlurmctldHost=$HOST
SlurmdSpoolDir=$STATE/spool
SlurmdPidFile=$STATE/slurmd.pid
SlurmdLogFile=$STATE/slurmd.log
NodeName=$HOST CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
        else
            # A lost node is noticed within ~SlurmdTimeout (real clusters: minutes), its jobs then end NODE_FAIL.
            cat <<CONF
SlurmctldHost=$HOST($NET.1)
SlurmdTimeout=20
MessageTimeout=5
SlurmdSpoolDir=$STATE/spool/%h
SlurmdPidFile=$STATE/slurmd-%h.pid
SlurmdLogFile=$STATE/slurmd-%h.log
CONF
            for i in $(seq "$nodes"); do
                echo "NodeName=cat-n$i NodeAddr=$NET.$((10 + i)) NodeHostname=cat-n$i CPUs=$cpus RealMemory=$mem State=UNKNOWN"
            done
            echo "PartitionName=local Nodes=cat-n[1-$nodes] Default=YES MaxTime=INFINITE State=UP"
        fi
    } > "$CONF_DIR/slurm.conf"
    cat > "$CONF_DIR/cgroup.conf" <<CONF
CgroupPlugin=cgroup/v1
IgnoreSystemd=yes
CONF
}

# A node's slurmd, inside its namespace with its own hostname; started unless it runs.
start_node() {
    local name=$1
    if ip netns pids "$name" 2>/dev/null | xargs -r ps -o comm= -p 2>/dev/null | grep -qx slurmd; then return; fi
    mkdir -p "$STATE/spool/$name"
    ip netns exec "$name" unshare --uts -- sh -c "hostname $name && exec slurmd" \
        || die "slurmd of $name did not start: it exited with status $? (see $STATE/slurmd-$name.log)"
    wait_for_pid "$STATE/slurmd-$name.pid" slurmd "$STATE/slurmd-$name.log"
}

# Within the start's deadline: every node up, each daemon of ours still alive; else which, and why.
wait_for_nodes() {
    local names=("$@") deadline=$((SECONDS + START_S)) name
    while [ "$SECONDS" -lt "$deadline" ]; do
        our_pid "$STATE/slurmctld.pid" slurmctld >/dev/null \
            || die "slurmctld died while the nodes came up; the end of $STATE/slurmctld.log: $(tail -n 3 "$STATE/slurmctld.log" 2>/dev/null | tr '\n' ' ')"
        if [ "$(timeout 10 sinfo -h -N -n "$(IFS=,; echo "${names[*]}")" -o '%t' 2>/dev/null | grep -cE '^(idle|mix|alloc)')" = "${#names[@]}" ]; then
            return 0
        fi
        for name in "${names[@]}"; do timeout 10 scontrol update nodename="$name" state=resume >/dev/null 2>&1 || true; done
        sleep 1
    done
    die "nodes ${names[*]} did not come up in ${START_S} s ($(timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null | tr '\n' ',' || echo 'sinfo did not answer')); see $STATE/slurmctld.log and $STATE/slurmd*.log"
}

# Everything in a node's namespace, killed at once (slurmd, job steps, trainers): a node that is gone.
kill_node() {
    local name=$1 pids
    pids=$(ip netns pids "$name" 2>/dev/null || true)
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
}

# Ours only: the namespaces' processes, then each daemon of ours with its job steps; returns when they are gone.
stop_all() {
    local name pids pid left
    if our_pid "$STATE/slurmctld.pid" slurmctld >/dev/null; then timeout 10 scancel --user=root >/dev/null 2>&1 || true; fi
    for name in $(node_names); do kill_node "$name"; done
    pids=$(our_daemons | while read -r pid _; do with_descendants "$pid"; done)
    [ -z "$pids" ] || kill $pids 2>/dev/null || true
    for i in $(seq 60); do
        left=$(for pid in $pids; do kill -0 "$pid" 2>/dev/null && echo "$pid"; done || true)
        [ -n "$left" ] || break
        [ "$i" = 30 ] && kill -9 $left 2>/dev/null || true  # 15 s on: what ignored SIGTERM is killed
        sleep 0.5
    done
    if [ -n "$left" ]; then
        die "could not end $(for pid in $left; do echo -n "$pid ($(ps -o comm= -p "$pid" 2>/dev/null)) "; done)in 30 s"
    fi
    for name in $(node_names); do
        ip link del "$name-h" 2>/dev/null || true
        ip netns del "$name"
        rm -rf "/etc/netns/$name"
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    rmdir /etc/netns 2>/dev/null || true
    rm -rf "$STATE"
}

command=${1:-start}
shift || true
nodes=1
while [ $# -gt 0 ]; do
    case "$1" in
    --nodes) nodes=${2:?--nodes needs a number}; shift 2 ;;
    --nodes=*) nodes=${1#--nodes=}; shift ;;
    *) [ "$command" = fail ] && break; die "unknown option $1" ;;
    esac
done
[[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive number, got $nodes"

case "$command" in
start)
    install_packages
    start_munge
    if our_pid "$STATE/slurmctld.pid" slurmctld >/dev/null && [ -f "$CONF_DIR/slurm.conf" ]; then
        running=$(grep -c '^NodeName=' "$CONF_DIR/slurm.conf")
        grep -q "^NodeName=cat-n" "$CONF_DIR/slurm.conf" || running=1
        [ "$running" = "$nodes" ] || die "a $running-node cluster runs; stop it first"
    fi
    if [ "$nodes" = 1 ]; then
        write_config 1
        start_slurmctld
        our_pid "$STATE/slurmd.pid" slurmd >/dev/null || slurmd || die "slurmd did not start: it exited with status $? (see $STATE/slurmd.log)"
        wait_for_pid "$STATE/slurmd.pid" slurmd "$STATE/slurmd.log"
        wait_for_nodes "$HOST"
    else
        start_network "$nodes"
        write_config "$nodes"
        start_slurmctld
        names=()
        for i in $(seq "$nodes"); do start_node "cat-n$i"; names+=("cat-n$i"); done
        wait_for_nodes "${names[@]}"
    fi
    timeout 10 sinfo
    ;;
fail)
    name=${1:?usage: local_cluster.sh fail NODE}
    ip netns pids "$name" >/dev/null 2>&1 || die "no node $name"
    ip -n "$name" link set eth0 down  # first the network, so nothing it held says goodbye
    kill_node "$name"
    echo "node $name lost"
    ;;
stop)
    stop_all
    echo "local Slurm stopped"
    ;;
status)
    if our_pid "$STATE/slurmctld.pid" slurmctld >/dev/null; then sinfo; squeue; else echo "not running"; exit 1; fi
    ;;
*)
    die "usage: local_cluster.sh start [--nodes N]|fail NODE|status|stop"
    ;;
esac
