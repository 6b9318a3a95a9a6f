#!/usr/bin/env bash
# Stop the one-node Slurm cluster that scripts/slurm-up.sh started, by the pids it recorded;
# jobs still running are cancelled first. Safe to run when nothing is up.
set -uo pipefail
dir="${KILN_SLURM_DIR:-/tmp/kiln-slurm}"
export SLURM_CONF="$dir/slurm.conf"
[ -f "$SLURM_CONF" ] && timeout 10 scancel --user="$(id -un)" 2>/dev/null
stop() {  # stop one daemon by its pid file, waiting up to 20 s
    local pidfile="$1" pid
    [ -f "$pidfile" ] || return 0
    pid="$(cat "$pidfile")"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    rm -f "$pidfile"
}
stop "$dir/slurmd.pid"
stop "$dir/slurmctld.pid"
stop "$dir/munged.pid"   # only a munged that slurm-up.sh started itself
exit 0
