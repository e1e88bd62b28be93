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
# address $NET.<10+i> on a bridge this script creates, $CAT_SLURM_BRIDGE (default catslurm0), the controller at
# $NET.1 on the bridge). Names resolve inside the nodes through /etc/netns/cat-n<i>/hosts (ip-netns bind-mounts
# it as their /etc/hosts).
# The nodes share this machine's filesystem, munge socket and CPUs; packets go only between the bridge, the
# nodes and the loopback (nothing is routed: the bridge has no uplink and forwarding is left as it is).
# State and logs live in $CAT_SLURM_DIR (default /tmp/cat-slurm): made 0700 and owned by the caller; one that is a
# link, someone else's, or group- or world-writable is refused. Needs root.
#
# It ends only what it started. Each daemon it starts is recorded in $CAT_SLURM_DIR/started (name, PID and the
# kernel's start time of that PID), and only a process that still matches all three is ended, with its job steps;
# munged only if it started munged; a site's own Slurm or munge is left running. The namespaces and the bridge it
# creates are recorded in $CAT_SLURM_DIR/namespaces and .../bridge with their identities (a namespace's inode, the
# bridge's interface index), and only those are deleted (`stop`) or failed (`fail NODE`): a namespace or bridge of
# the same name made by anyone else, even after ours was gone, is left as it is. Every setting from the
# environment is checked before it is used (digits only, bounded), so none reaches the shell's arithmetic.
# `stop` returns once they are gone (or names the one it could not end); `start` gives up after
# $CAT_SLURM_START_S seconds (default 120) with the daemon or node that did not come up and its log's end.
set -euo pipefail

die() { echo "local_cluster.sh: $*" >&2; exit 1; }
# "the end of FILE: " and its last three lines on one line, for a message saying why a daemon did not come up.
log_end() { echo "the end of $1: $(tail -n 3 "$1" 2>/dev/null | tr '\n' ' ')"; }

STATE=${CAT_SLURM_DIR:-/tmp/cat-slurm}
NET=${CAT_SLURM_NET:-10.231.0}  # the bridge's /24; refused if this machine already routes it elsewhere
BRIDGE=${CAT_SLURM_BRIDGE:-catslurm0}  # the bridge's interface name (another for a second cluster on this machine)
CONF_DIR=/etc/slurm
HOST=$(hostname -s)
START_S=${CAT_SLURM_START_S:-120}
# Checked as text before any use: a value reaches neither the shell's arithmetic nor a command line unchecked.
[[ "$START_S" =~ ^[0-9]{1,5}$ ]] && [ "$((10#$START_S))" -ge 1 ] && [ "$((10#$START_S))" -le 86400 ] \
    || die "CAT_SLURM_START_S must be a number of seconds from 1 to 86400, got '$START_S'"
START_S=$((10#$START_S))  # decimal, leading zeros and all (the shell's arithmetic would read 08 as octal)
[[ "$NET" =~ ^(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])$ ]] \
    || die "CAT_SLURM_NET must be the first three numbers of an IPv4 /24 (e.g. 10.231.0), got '$NET'"
[[ "$STATE" = /* && "$STATE" != *$'\n'* ]] || die "CAT_SLURM_DIR must be an absolute path, got '$STATE'"
[[ "$BRIDGE" =~ ^[a-z][a-z0-9]{0,14}$ ]] \
    || die "CAT_SLURM_BRIDGE must be an interface name of 1 to 15 lower-case letters and digits, got '$BRIDGE'"

# The state folder: made 0700 for the caller, or refused where it could be someone else's (a link planted in /tmp,
# another owner, a folder others may write in), and one this script made: it holds its marker, or was empty when it
# was first given. Any other existing folder (CAT_SLURM_DIR=/var/log/slurm, or one holding only names like the
# script's: they may be a site's logs or a user's files) is refused by every command, `stop` included, before
# anything is written, ended or deleted. `stop` deletes only names of its own in a folder it made.
MARKER=.cat-slurm-state
# What this script and its daemons write in the state folder: a folder of only these without the marker is named
# as an older version's (which made no marker), with the command that removes it.
OWN_NAMES='^(ctld|spool|started|namespaces|bridge|jobcomp\.txt|slurmctld\.(pid|log)|slurmd(-cat-n[0-9]+)?\.(pid|log))$'
state_dir() {
    [ ! -L "$STATE" ] || die "$STATE is a symbolic link; the cluster's state folder must be a folder of its own"
    if [ ! -e "$STATE" ]; then (umask 077 && mkdir -p "$STATE") || die "cannot make $STATE"; fi
    [ -d "$STATE" ] || die "$STATE is not a folder"
    [ "$(stat -c %u "$STATE")" = "$(id -u)" ] || die "$STATE belongs to uid $(stat -c %u "$STATE"), not to you"
    case "$(stat -c %A "$STATE")" in
    ?????w????|????????w?) die "$STATE may be written by others ($(stat -c %A "$STATE")); use a folder only you write" ;;
    esac
    if [ -f "$STATE/$MARKER" ] && [ ! -L "$STATE/$MARKER" ]; then return 0; fi
    local held foreign
    held=$(ls -A "$STATE")
    if [ -n "$held" ]; then
        foreign=$(echo "$held" | grep -Ev "$OWN_NAMES" | head -n 3 | tr '\n' ' ' || true)
        [ -z "$foreign" ] || die "$STATE is not a folder this script made (no $MARKER; it holds ${foreign% }): give \
CAT_SLURM_DIR a new folder"
        die "$STATE holds only names this script uses ($(echo "$held" | head -n 3 | tr '\n' ' ')) but not its \
$MARKER: a folder an older version made, or someone else's; nothing in it was touched. If it is an old cluster's, \
stop its daemons and remove it with: rm -rf -- '$STATE'; or give CAT_SLURM_DIR a new folder"
    fi
    : > "$STATE/$MARKER"  # empty: the script's from now on
}

# Whole seconds since boot (/proc/uptime): the start's deadlines are kept on it, not on bash's SECONDS, which follows
# the wall clock (a step of it, as a fresh VM's clock is synced, would cut a wait short or stretch it).
uptime_s() { local up _; read -r up _ < /proc/uptime; echo "${up%.*}"; }
# The kernel's start time of PID (field 22 of /proc/PID/stat, after the command's parentheses), empty once it has
# exited: a killed daemon stays in the process table as a zombie (state Z, or X) until it is reaped, which on a loaded
# machine can take a while, and must not count as running.
start_time() { awk '{sub(/^.*\) /, ""); if ($1 != "Z" && $1 != "X") print $20}' "/proc/$1/stat" 2>/dev/null; }
# A recorded daemon ("KEY COMMAND PID START") that still lives as recorded: the same command at the same start.
alive_as_recorded() { [ "$(ps -o comm= -p "$3" 2>/dev/null)" = "$2" ] && [ -n "$4" ] && [ "$(start_time "$3")" = "$4" ]; }
# The PID of the daemon this script started as KEY (slurmctld, slurmd, slurmd-cat-n2, munged), if it still lives.
our_pid() {
    local key command pid started
    [ -f "$STATE/started" ] || return 1
    while read -r key command pid started; do
        [ "$key" = "$1" ] && [[ "$pid" =~ ^[0-9]+$ ]] || continue
        if alive_as_recorded "$key" "$command" "$pid" "$started"; then echo "$pid"; return 0; fi
    done < "$STATE/started"
    return 1
}
# Every daemon this script started that still lives as recorded, as "PID COMMAND" lines.
our_daemons() {
    local key command pid started
    [ -f "$STATE/started" ] || return 0
    while read -r key command pid started; do
        [[ "$pid" =~ ^[0-9]+$ ]] || continue
        if alive_as_recorded "$key" "$command" "$pid" "$started"; then echo "$pid $command"; fi
    done < "$STATE/started"
}
# PID and all its descendants.
with_descendants() {
    local pid=$1 child
    echo "$pid"
    for child in $(pgrep -P "$pid" 2>/dev/null || true); do with_descendants "$child"; done
}
# Once the daemon's PID file names a live NAME (daemons write it after they fork), record it as started here
# under KEY (default NAME), with the kernel's start time of its PID; or fail with its log's end. Bounded by the
# start's deadline, not a count of tries: on a loaded machine a daemon can take seconds to write its PID file.
wait_for_pid() {
    local file=$1 name=$2 log=$3 key=${4:-$2} pid started deadline=$(($(uptime_s) + START_S))
    while [ "$(uptime_s)" -lt "$deadline" ]; do
        pid=$(cat "$file" 2>/dev/null || true)
        if [[ "$pid" =~ ^[0-9]+$ ]] && [ "$(ps -o comm= -p "$pid" 2>/dev/null)" = "$name" ]; then
            started=$(start_time "$pid")
            if [ -n "$started" ]; then echo "$key $name $pid $started" >> "$STATE/started"; return 0; fi
        fi
        sleep 0.2
    done
    die "$name did not start in ${START_S} s (no live process in $file); $(log_end "$log")"
}
[ "$(id -u)" = 0 ] || die "needs root (slurmd runs as root)"

# A namespace's identity: the inode of the network namespace its name is bound to (a namespace deleted and made
# again by someone else under the same name has another).
netns_id() { stat -L -c %i "/var/run/netns/$1" 2>/dev/null; }
# The bridge's identity: its interface index (a bridge re-made under the same name has another).
bridge_id() { cat "/sys/class/net/$BRIDGE/ifindex" 2>/dev/null; }
# The namespaces this script created (recorded as "NAME INODE" as it made them), those that still exist as made.
# Its readers grep without -q: under pipefail, grep -q ending the pipe early kills the writer (SIGPIPE) and the test
# fails at random (seen once the lines took a stat each).
node_names() {
    local name id
    [ -f "$STATE/namespaces" ] || return 0
    while read -r name id; do
        [[ "$name" =~ ^cat-n[0-9]+$ ]] && [ -n "$id" ] && [ "$(netns_id "$name")" = "$id" ] && echo "$name"
    done < "$STATE/namespaces"
}
# Whether the bridge that exists is the one this script made (recorded as "NAME IFINDEX").
our_bridge() {
    local name id
    [ -f "$STATE/bridge" ] && read -r name id < "$STATE/bridge" && [ "$name" = "$BRIDGE" ] && [ -n "$id" ] \
        && [ "$(bridge_id)" = "$id" ]
}

install_packages() {
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
        echo "installing slurm-wlm and munge (Debian packages)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
    fi
}

# The site's munged if one runs (left alone, and never stopped here), else ours, its PID recorded.
start_munge() {
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
    wait_for_pid /run/munge/munged.pid munged /var/log/munge/munged.log
}

start_slurmctld() {
    our_pid slurmctld >/dev/null && return 0
    rm -f "$STATE/slurmctld.pid"
    slurmctld || die "slurmctld exited with status $?: see $STATE/slurmctld.log"
    wait_for_pid "$STATE/slurmctld.pid" slurmctld "$STATE/slurmctld.log"
}

# The bridge with the controller's address, then per node a namespace joined to it by a veth pair.
start_network() {
    local nodes=$1 i name
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        if ip route show | grep "^$NET\.0/24" >/dev/null; then die "$NET.0/24 is already routed on this machine; set CAT_SLURM_NET"; fi
        ip link add "$BRIDGE" type bridge
        echo "$BRIDGE $(bridge_id)" > "$STATE/bridge"
        ip addr add "$NET.1/24" dev "$BRIDGE"
        ip link set "$BRIDGE" up
    elif ! our_bridge; then
        die "a bridge $BRIDGE exists that this cluster did not make; remove it, or stop the cluster that made it"
    fi
    for i in $(seq "$nodes"); do
        name=cat-n$i
        if [ -e "/var/run/netns/$name" ]; then
            node_names | grep -x "$name" >/dev/null || die "a network namespace $name exists that this cluster did not make; remove it first"
        else
            ip netns add "$name" && echo "$name $(netns_id "$name")" >> "$STATE/namespaces"
        fi
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

# The start time the controller holds for node NAME's slurmd ("None" before any registered; empty if it cannot say).
registered_start() {
    timeout 10 scontrol show node -o "$1" 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*' | cut -d= -f2 || true
}
# Per node whose slurmd this `start` launched: what the controller held for it just before. The node has come back
# once the controller holds another, set by the new slurmd's first registration. No process start time is compared with
# it: ps's (lstart) follows the wall clock, so a step of it (a fresh VM's clock being synced) made a slurmd running
# since before the step look newer than its registration, and `start` waited for a node that was up.
declare -A REGISTERED_BEFORE=()
# Records what the controller holds for NAME, before a slurmd is launched for it; asks again while the controller
# does not answer (busy, or just started), within the start's deadline.
before_launch() {
    local held deadline=$(($(uptime_s) + START_S))
    until held=$(registered_start "$1"); [ -n "$held" ]; do
        [ "$(uptime_s)" -lt "$deadline" ] || die "slurmctld did not say in ${START_S} s what it holds for node $1 (scontrol \
show node $1); $(log_end "$STATE/slurmctld.log")"
        sleep 1
    done
    REGISTERED_BEFORE[$1]=$held
    # A registration is stamped with its second: one within the second of the held one could look like it.
    held=$(date -d "$held" +%s 2>/dev/null || echo 0)
    while [ "$(date +%s)" = "$held" ]; do sleep 0.1; done
}

# A node's slurmd, inside its namespace with its own hostname; started unless it runs.
start_node() {
    local name=$1
    if our_pid slurmd-"$name" >/dev/null; then return; fi
    before_launch "$name"
    mkdir -p "$STATE/spool/$name"
    rm -f "$STATE/slurmd-$name.pid"  # a lost slurmd's: its PID must not be taken for the new one's
    ip netns exec "$name" unshare --uts -- sh -c "hostname $name && exec slurmd" \
        || die "slurmd of $name did not start: it exited with status $? (see $STATE/slurmd-$name.log)"
    wait_for_pid "$STATE/slurmd-$name.pid" slurmd "$STATE/slurmd-$name.log" "slurmd-$name"
}

# Within the start's deadline: each node (NAME:KEY, KEY its slurmd's record) answering and usable in Slurm, and one
# whose slurmd this `start` launched registered by it, not by an earlier one the controller has not yet missed (a
# `start` just after `fail` would otherwise see the lost node still "idle"); each daemon of ours alive throughout;
# else which, and why.
wait_for_nodes() {
    local deadline=$(($(uptime_s) + START_S)) node name key states waiting
    while [ "$(uptime_s)" -lt "$deadline" ]; do
        our_pid slurmctld >/dev/null \
            || die "slurmctld died while the nodes came up; $(log_end "$STATE/slurmctld.log")"
        states=$(timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null || true)
        waiting=()
        for node in "$@"; do
            name=${node%%:*} key=${node#*:}
            our_pid "$key" >/dev/null || die "slurmd of $name died while the nodes came up; $(log_end "$(node_log "$name")")"
            if ! grep -qE "^$name (idle|mix|alloc)\$" <<< "$states" || ! registered_anew "$name"; then
                waiting+=("$name")
                timeout 10 scontrol update nodename="$name" state=resume >/dev/null 2>&1 || true
            fi
        done
        [ "${#waiting[@]}" -gt 0 ] || return 0
        sleep 1
    done
    name=${waiting[0]}
    die "nodes ${waiting[*]} did not come up in ${START_S} s (${states//$'\n'/, }; $name's slurmd start as registered: \
$(registered_start "$name")${REGISTERED_BEFORE[$name]+, before this start: ${REGISTERED_BEFORE[$name]}}; sinfo: \
$(timeout 10 sinfo -h -R -o '%N: %E' 2>/dev/null | tr '\n' ' ')); $(log_end "$(node_log "$name")")"
}
# Whether node NAME's registration is its slurmd's of now: any, for a slurmd running before this `start`; for one
# launched by it, a start time the controller did not hold before.
registered_anew() {
    local now
    [ -n "${REGISTERED_BEFORE[$1]+set}" ] || return 0
    now=$(registered_start "$1")
    [ -n "$now" ] && [ "$now" != None ] && [ "$now" != "${REGISTERED_BEFORE[$1]}" ]
}
# A node's slurmd log.
node_log() { if [ "$1" = "$HOST" ]; then echo "$STATE/slurmd.log"; else echo "$STATE/slurmd-$1.log"; fi; }

# Everything in a node's namespace, killed at once (slurmd, job steps, trainers): a node that is gone. Returns once
# they have exited (zombies aside, which are gone for every purpose here), so a `start` right after cannot mistake
# the dying slurmd for a running one; names what is left after 30 s.
kill_node() {
    local name=$1 pids pid left
    for _ in $(seq 150); do
        pids=$(ip netns pids "$name" 2>/dev/null || true)
        left=$(for pid in $pids; do [ -n "$(start_time "$pid")" ] && echo "$pid"; done || true)
        [ -n "$left" ] || return 0
        kill -9 $left 2>/dev/null || true
        sleep 0.2
    done
    die "could not end $(for pid in $left; do echo -n "$pid ($(ps -o comm= -p "$pid" 2>/dev/null)) "; done)in node $name in 30 s"
}

# Ours only: the namespaces' processes, then each daemon of ours with its job steps; returns when they are gone.
stop_all() {
    local name pids pid left
    if our_pid slurmctld >/dev/null; then timeout 10 scancel --user=root >/dev/null 2>&1 || true; fi
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
    if our_bridge; then ip link del "$BRIDGE" 2>/dev/null || true; fi
    rmdir /etc/netns 2>/dev/null || true
    # What this script and its daemons write there, by name; the folder goes only if nothing else is left in it.
    rm -rf "$STATE/ctld" "$STATE/spool" "$STATE/started" "$STATE/namespaces" "$STATE/bridge" "$STATE/jobcomp.txt"
    rm -f "$STATE"/slurmctld.{pid,log} "$STATE"/slurmd.{pid,log} "$STATE"/slurmd-cat-n*.{pid,log}
    if [ -z "$(ls -A "$STATE" | grep -vx -- "$MARKER" || true)" ]; then rm -f "$STATE/$MARKER"; rmdir "$STATE" || true; fi
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
[[ "$nodes" =~ ^[1-9][0-9]?$ ]] || die "--nodes must be a number from 1 to 99, got $nodes"
state_dir

case "$command" in
start)
    install_packages
    start_munge
    if our_pid slurmctld >/dev/null && [ -f "$CONF_DIR/slurm.conf" ]; then
        running=$(grep -c '^NodeName=' "$CONF_DIR/slurm.conf")
        grep -q "^NodeName=cat-n" "$CONF_DIR/slurm.conf" || running=1
        [ "$running" = "$nodes" ] || die "a $running-node cluster runs; stop it first"
    fi
    if [ "$nodes" = 1 ]; then
        write_config 1
        start_slurmctld
        if ! our_pid slurmd >/dev/null; then
            before_launch "$HOST"
            rm -f "$STATE/slurmd.pid"
            slurmd || die "slurmd did not start: it exited with status $? (see $STATE/slurmd.log)"
            wait_for_pid "$STATE/slurmd.pid" slurmd "$STATE/slurmd.log"
        fi
        wait_for_nodes "$HOST:slurmd"
    else
        start_network "$nodes"
        write_config "$nodes"
        start_slurmctld
        names=()
        for i in $(seq "$nodes"); do start_node "cat-n$i"; names+=("cat-n$i:slurmd-cat-n$i"); done
        wait_for_nodes "${names[@]}"
    fi
    timeout 10 sinfo
    ;;
fail)
    name=${1:?usage: local_cluster.sh fail NODE}
    node_names | grep -x -- "$name" >/dev/null || die "no node $name of this cluster (its nodes: $(node_names | tr '\n' ' '))"
    ip -n "$name" link set eth0 down  # first the network, so nothing it held says goodbye
    kill_node "$name"
    echo "node $name lost"
    ;;
stop)
    stop_all
    echo "local Slurm stopped"
    ;;
status)
    if our_pid slurmctld >/dev/null; then sinfo; squeue; else echo "not running"; exit 1; fi
    ;;
*)
    die "usage: local_cluster.sh start [--nodes N]|fail NODE|status|stop"
    ;;
esac
