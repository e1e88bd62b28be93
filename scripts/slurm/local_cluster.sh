#!/usr/bin/env bash
# A one-node Slurm on this machine, to try the sbatch templates (and to test them in CI):
#   sudo bash scripts/slurm/local_cluster.sh start     # installs slurm-wlm + munge if missing, starts them
#   sudo bash scripts/slurm/local_cluster.sh status
#   sudo bash scripts/slurm/local_cluster.sh stop
# Idempotent. Debian's packages, munge with a generated key, slurmctld and slurmd as root, one
# partition "local" holding this node (its CPUs and memory), job-completion records for `sacct -c`.
# State and logs live in $CAT_SLURM_DIR (default /tmp/cat-slurm). Needs root.
set -euo pipefail

STATE=${CAT_SLURM_DIR:-/tmp/cat-slurm}
CONF_DIR=/etc/slurm
NODE=$(hostname -s)

die() { echo "local_cluster.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (slurmd runs as root)"

install_packages() {
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
        echo "installing slurm-wlm and munge (Debian packages)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
    fi
}

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
}

write_config() {
    local mem
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    mkdir -p "$CONF_DIR" "$STATE/ctld" "$STATE/spool"
    cat > "$CONF_DIR/slurm.conf" <<CONF
ClusterName=cat-local
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=60
SchedulerParameters=bf_interval=1
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/jobcomp.txt
AccountingStorageType=accounting_storage/none
NodeName=$NODE CPUs=$(nproc) RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
    cat > "$CONF_DIR/cgroup.conf" <<CONF
CgroupPlugin=cgroup/v1
IgnoreSystemd=yes
CONF
}

wait_for_node() {
    for _ in $(seq 60); do
        if sinfo -h -n "$NODE" -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then return 0; fi
        scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
        sleep 1
    done
    die "node $NODE did not come up; see $STATE/slurmctld.log and $STATE/slurmd.log"
}

case "${1:-start}" in
start)
    install_packages
    start_munge
    write_config
    pgrep -x slurmctld >/dev/null || slurmctld
    pgrep -x slurmd >/dev/null || slurmd
    wait_for_node
    sinfo
    ;;
stop)
    scancel --user=root >/dev/null 2>&1 || true
    for daemon in slurmd slurmctld munged; do pkill -x "$daemon" || true; done
    for _ in $(seq 20); do pgrep -x 'slurmd|slurmctld|munged' >/dev/null || break; sleep 0.5; done
    rm -rf "$STATE"
    echo "local Slurm stopped"
    ;;
status)
    if pgrep -x slurmctld >/dev/null && pgrep -x slurmd >/dev/null; then sinfo; squeue; else echo "not running"; exit 1; fi
    ;;
*)
    die "usage: local_cluster.sh start|stop|status"
    ;;
esac
