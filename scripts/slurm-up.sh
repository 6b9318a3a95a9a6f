#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine (for the Slurm tests), installing Debian's
# slurm-wlm and munge when they are missing. Idempotent: a cluster already up with this
# configuration is left as is. Everything of ours lives under $KILN_SLURM_DIR (default
# /tmp/kiln-slurm): slurm.conf, state, logs and pid files; clients find it through
# SLURM_CONF=$KILN_SLURM_DIR/slurm.conf. Stop it with scripts/slurm-down.sh.
# Exit status 3: Slurm cannot be installed or started here.
set -euo pipefail
dir="${KILN_SLURM_DIR:-/tmp/kiln-slurm}"
conf="$dir/slurm.conf"
export SLURM_CONF="$conf"
fail() { echo "slurm-up: $*" >&2; exit 3; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    [ "$(id -u)" = 0 ] || fail "slurmctld/munged are not installed and we are not root to install them"
    command -v apt-get >/dev/null || fail "slurmctld/munged are not installed and there is no apt-get"
    export DEBIAN_FRONTEND=noninteractive
    (apt-get update -q && apt-get install -y -q slurm-wlm munge) >"/tmp/kiln-slurm-apt.log" 2>&1 \
        || fail "apt-get install slurm-wlm munge failed (see /tmp/kiln-slurm-apt.log)"
fi

host="$(hostname -s)"
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))
wanted="# Written by kiln scripts/slurm-up.sh: a one-node test cluster.
ClusterName=kilntest
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldLogFile=$dir/log/ctld.log
SlurmdLogFile=$dir/log/d.log
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldPort=6917
SlurmdPort=6918
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=30
MinJobAge=600
# Test jobs should not wait for the default 60 s scheduling cycle.
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
NodeName=$host CPUs=$(nproc) RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"

if [ -f "$conf" ] && [ "$(cat "$conf")" = "$wanted" ] \
        && timeout 10 sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
    echo "slurm-up: already running ($conf)"; exit 0
fi
# Not running, or with another configuration: (re)start our daemons from a clean state.
bash "$(dirname "$0")/slurm-down.sh"
mkdir -p "$dir/state" "$dir/spool" "$dir/log"
printf '%s\n' "$wanted" >"$conf"

# munge: one key readable only by its owner; as root it must be started with --force.
if ! (munge -n | unmunge) >/dev/null 2>&1; then
    key=/etc/munge/munge.key
    if [ ! -s "$key" ]; then
        dd if=/dev/urandom bs=1 count=1024 of="$key" 2>/dev/null
        chown munge:munge "$key" 2>/dev/null || true
        chmod 400 "$key"
    fi
    mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
    /usr/sbin/munged --force --pid-file="$dir/munged.pid" || fail "munged did not start"
    (munge -n | unmunge) >/dev/null 2>&1 || fail "munge does not answer after starting munged"
fi

# -c: no jobs or node states left over from an earlier cluster.
/usr/sbin/slurmctld -c -f "$conf" || fail "slurmctld did not start (see $dir/log/ctld.log)"
/usr/sbin/slurmd -f "$conf" || fail "slurmd did not start (see $dir/log/d.log)"
for _ in $(seq 60); do
    if timeout 10 sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
        echo "slurm-up: one-node cluster up ($conf)"; exit 0
    fi
    sleep 1
done
fail "the node did not come up within 60 s: $(sinfo 2>&1 | tail -2) (see $dir/log/)"
