#!/usr/bin/env bash
# A SLURM cluster of two nodes, n1 and n2, on this host: one slurmctld, two slurmd (`slurmd -N`,
# SLURM's "multiple slurmd" test setup, each node on a port of its own) and a munged of its own,
# all configured, logged and stopped under one state directory. For trying the slurm launcher
# and tools/slurm/train.sbatch on a laptop, and for the tests (pytest -m slurm).
#
#   sudo tools/slurm/local_cluster.sh up [DIR]     # prints `export SLURM_CONF=DIR/slurm.conf`
#   eval "$(sudo tools/slurm/local_cluster.sh up)" # ... or set it in this shell
#   sinfo; sbatch --nodes=2 --export=ALL,DEVICES_PER_NODE=1 tools/slurm/train.sbatch ...
#   sudo tools/slurm/local_cluster.sh down [DIR]   # cancels its jobs, stops exactly its daemons
#
# DIR: ${MEGAPIPE_SLURM_DIR:-$HOME/.megapipe-slurm}. Ports: MEGAPIPE_SLURM_PORT (slurmctld,
# default 16817), n1 and n2 on the next two. Runs as root (slurmd starts every job as its user);
# installs Debian's slurm-wlm and munge when they are missing. Each node gets all of this host's
# CPUs (the two nodes share them) and its memory; cgroups are not used (task/none,
# proctrack/linuxproc), so a container can run it. A daemon that fails to start: its log, under
# DIR, is printed.
set -euo pipefail

ACTION=${1:-}
DIR=${2:-${MEGAPIPE_SLURM_DIR:-$HOME/.megapipe-slurm}}
PORT=${MEGAPIPE_SLURM_PORT:-16817}
NODES=(n1 n2)
WAIT_S=${MEGAPIPE_SLURM_WAIT_S:-90}

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

usage() { die "usage: $0 up|down [DIR] (DIR: \$MEGAPIPE_SLURM_DIR, default ~/.megapipe-slurm)"; }

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged \
        >/dev/null && command -v sbatch >/dev/null && return
    [ "$(id -u)" = 0 ] || die "slurm-wlm and munge are missing; run as root to install them"
    command -v apt-get >/dev/null || die "install SLURM (slurmctld, slurmd, sbatch) and munge"
    echo "installing slurm-wlm and munge (apt-get)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2 && apt-get install -y -q slurm-wlm munge >&2
}

# pid of a daemon we started, from its pid file, if that process is still that daemon
live_pid() {
    local file=$1 name=$2 pid
    [ -s "$file" ] || return 1
    pid=$(head -n 1 "$file")
    [[ $pid =~ ^[0-9]+$ ]] && [ -d "/proc/$pid" ] || return 1
    grep -q "$name" "/proc/$pid/comm" 2>/dev/null || return 1
    echo "$pid"
}

write_conf() {
    local cpus mem host
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))  # MB, under slurmd's
    host=$(hostname -s)
    cat >"$DIR/slurm.conf" <<EOF
# written by tools/slurm/local_cluster.sh: two nodes on this host
ClusterName=megapipe
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
CredType=cred/munge
StateSaveLocation=$DIR/ctld
SlurmctldPidFile=$DIR/ctld/slurmctld.pid
SlurmctldLogFile=$DIR/ctld/slurmctld.log
SlurmdSpoolDir=$DIR/%n/spool
SlurmdPidFile=$DIR/%n/slurmd.pid
SlurmdLogFile=$DIR/%n/slurmd.log
# no cgroups (a container rarely has them to give): processes tracked by their parent links
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# schedule every 2 s (default 60 s): a job dependent on another, or requeued, starts at once
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# the node lines below are the truth, whatever this host's socket/core layout
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=10
MinJobAge=600
JobRequeue=0
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    local m=$DIR/munge
    mkdir -p "$m" && chmod 0755 "$m"
    if [ ! -s "$m/munge.key" ]; then
        dd if=/dev/urandom of="$m/munge.key" bs=1024 count=1 status=none
    fi
    chmod 0600 "$m/munge.key"
    live_pid "$m/munged.pid" munged >/dev/null && return
    munged --force --socket="$m/munge.socket.2" --key-file="$m/munge.key" \
        --pid-file="$m/munged.pid" --log-file="$m/munged.log" --seed-file="$m/munged.seed" \
        || { cat "$m/munged.log" >&2 || true; die "munged did not start (log above)"; }
}

start_slurm() {
    mkdir -p "$DIR/ctld"
    if ! live_pid "$DIR/ctld/slurmctld.pid" slurmctld >/dev/null; then
        # -c: a fresh controller state (no jobs or node states from an earlier `up`)
        slurmctld -c -f "$DIR/slurm.conf" \
            || { tail -n 20 "$DIR/ctld/slurmctld.log" >&2; die "slurmctld did not start"; }
    fi
    for node in "${NODES[@]}"; do
        mkdir -p "$DIR/$node/spool"
        live_pid "$DIR/$node/slurmd.pid" slurmd >/dev/null && continue
        slurmd -N "$node" -f "$DIR/slurm.conf" \
            || { tail -n 20 "$DIR/$node/slurmd.log" >&2; die "slurmd -N $node did not start"; }
    done
}

wait_idle() {
    local deadline=$((SECONDS + WAIT_S)) states=""
    while [ $SECONDS -lt $deadline ]; do
        states=$(sinfo -h -N -o '%N=%t' 2>/dev/null | sort -u | tr '\n' ' ' || true)
        [[ $states == *"n1=idle"* && $states == *"n2=idle"* ]] && return
        sleep 1
    done
    tail -n 5 "$DIR/ctld/slurmctld.log" "$DIR"/n?/slurmd.log >&2 || true
    die "the nodes are not idle after ${WAIT_S} s (sinfo: ${states:-no answer}); logs above, in $DIR"
}

up() {
    [ "$(id -u)" = 0 ] || die "run as root: slurmd starts every job as its user"
    install_packages
    mkdir -p "$DIR" && chmod 0755 "$DIR"
    DIR=$(cd "$DIR" && pwd)
    export SLURM_CONF=$DIR/slurm.conf
    live_pid "$DIR/ctld/slurmctld.pid" slurmctld >/dev/null || write_conf
    start_munge
    start_slurm
    wait_idle
    echo "local_cluster.sh: nodes n1 n2 idle; state, logs and config in $DIR" >&2
    echo "export SLURM_CONF=$SLURM_CONF"
}

stop() {  # stop the daemon of a pid file, if it is still that daemon; wait until it is gone
    local pid
    pid=$(live_pid "$1" "$2") || { rm -f "$1"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
        [ -d "/proc/$pid" ] || { rm -f "$1"; return 0; }
        sleep 0.2
    done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$1"
}

down() {
    [ -d "$DIR" ] || { echo "local_cluster.sh: no cluster in $DIR" >&2; return 0; }
    DIR=$(cd "$DIR" && pwd)
    export SLURM_CONF=$DIR/slurm.conf
    if live_pid "$DIR/ctld/slurmctld.pid" slurmctld >/dev/null; then
        # the jobs first, so that no slurmstepd outlives its slurmd
        local jobs
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            for _ in $(seq 60); do
                [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
                sleep 0.5
            done
        fi
    fi
    for node in "${NODES[@]}"; do stop "$DIR/$node/slurmd.pid" slurmd; done
    stop "$DIR/ctld/slurmctld.pid" slurmctld
    stop "$DIR/munge/munged.pid" munged
    echo "local_cluster.sh: stopped the cluster of $DIR" >&2
}

case "$ACTION" in
    up) up ;;
    down) down ;;
    *) usage ;;
esac
