#!/usr/bin/env bash
# A single-node Slurm (slurmctld + slurmd + munged) on this machine, for tests and for trying the
# batch templates without a cluster. Needs root and Debian's slurmd, slurmctld, slurm-client, munge.
#
#   eval "$(scripts/slurm/local_cluster.sh start DIR)"   # prints `export SLURM_CONF=...`
#   sbatch --wait ... ; scripts/slurm/local_cluster.sh stop DIR
#
# Everything it writes lives under DIR; `stop` ends exactly the daemons `start` began (by pid file).
set -euo pipefail
cmd=${1:?start or stop}
dir=$(mkdir -p "${2:?state directory}" && cd "$2" && pwd)
conf=$dir/slurm.conf

stop() {
    for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munged.pid"; do
        if [ -s "$pidfile" ]; then kill "$(cat "$pidfile")" 2>/dev/null || true; fi
        rm -f "$pidfile"
    done
    if [ -s "$dir/munge_dir" ]; then rm -rf "$(cat "$dir/munge_dir")"; rm -f "$dir/munge_dir"; fi
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
for tool in slurmctld slurmd munged sinfo; do
    command -v "$tool" >/dev/null || { echo "$tool not found: apt-get install slurmd slurmctld slurm-client munge" >&2; exit 3; }
done
host=$(hostname -s)
# The node offers ELASTIC_LOCAL_CPUS task slots (default 16) whatever the cores, so that a job of
# actives + spares fits on a small machine; slurmd is told to trust the configuration.
cpus=${ELASTIC_LOCAL_CPUS:-16}
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p "$dir/state" "$dir/spool" "$dir/log"
# munged runs as the munge user, which may not reach into DIR (pytest's tmp is root-only).
munge=$(mktemp -d /tmp/elastic-munge.XXXXXX)
echo "$munge" > "$dir/munge_dir"
chmod 755 "$munge" && chown munge:munge "$munge"
[ -s /etc/munge/munge.key ] || runuser -u munge -- /usr/sbin/mungekey --create
runuser -u munge -- /usr/sbin/munged --socket="$munge/munge.socket" --pid-file="$munge/munged.pid" \
    --log-file="$munge/munged.log" --seed-file="$munge/munged.seed" --force
cp "$munge/munged.pid" "$dir/munged.pid"
cat > "$conf" <<CONF
ClusterName=elastic-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$munge/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF=$conf
slurmctld -f "$conf"
slurmd -f "$conf"
# Poll (bounded) until the node takes jobs.
for _ in $(seq 100); do
    if sinfo -h -o %t 2>/dev/null | grep -qx idle; then echo "export SLURM_CONF=$conf"; exit 0; fi
    sleep 0.2
done
echo "slurm did not come up in 20 s; logs in $dir/log" >&2
stop
exit 1
