#!/bin/bash
# Profiles workload B (`agentq bench --scenario steps`, ten durable no-op steps per job) while
# its 10-step phase runs: perf samples of the worker process (perf.data in $OUT), the
# statements PostgreSQL ran for the benchmark's database (pg_stat_statements, top 25 by time),
# WAL bytes, commits, and the CPU time of the worker and of every PostgreSQL process over the
# same window, per step. Needs perf, a release build, and pg_stat_statements preloaded
# (ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'; restart PostgreSQL).
# Usage: bash bench/profile-steps.sh [JOBS]   (default 6000: a 10-step phase of ~15 s)
set -u
JOBS=${1:-6000}
OUT=${OUT:-/tmp/agentq-profile}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
P="psql -h ${PGHOST:-127.0.0.1} -U ${PGUSER:-postgres} -At"
$P -c "create extension if not exists pg_stat_statements" >/dev/null
DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres ./target/release/agentq bench --scenario steps --jobs $JOBS --concurrency 64 --producers 32 > $OUT/bench.out 2> $OUT/bench.err &
B=$!
until grep -q "10-step" $OUT/bench.err; do sleep 0.1; done
sleep 2
DB=$($P -c "select datname from pg_database where datname like 'agentq_bench_%' order by oid desc limit 1")
DBID=$($P -c "select oid from pg_database where datname = '$DB'")
W=$(pgrep -f "agentq worker" | tail -1)
pgcpu() { for p in $(pgrep -u postgres postgres); do awk '{print $14+$15}' /proc/$p/stat 2>/dev/null; done | awk '{s+=$1} END {print s}'; }
wcpu() { awk '{print $14+$15}' /proc/$W/stat; }
$P -c "select pg_stat_statements_reset()" >/dev/null
S0=$($P -d $DB -c "select count(*) from operation_steps")
WAL0=$($P -c "select wal_bytes from pg_stat_wal")
C0=$($P -d $DB -c "select xact_commit from pg_stat_database where datname = current_database()")
PG0=$(pgcpu); W0=$(wcpu); T0=$(date +%s.%N)
perf record -F 499 -g -p $W -o $OUT/perf.data -- sleep 8 2>/dev/null
T1=$(date +%s.%N); PG1=$(pgcpu); W1=$(wcpu)
[ -d /proc/$W ] || { echo "the 10-step phase ended inside the window: give more JOBS" >&2; exit 1; }
S1=$($P -d $DB -c "select count(*) from operation_steps")
WAL1=$($P -c "select wal_bytes from pg_stat_wal")
C1=$($P -d $DB -c "select xact_commit from pg_stat_database where datname = current_database()")
echo "db $DB window $(echo "$T1 - $T0" | bc) s steps $((S1-S0)) wal_bytes $((WAL1-WAL0)) commits $((C1-C0)) pg_cpu_ticks $((PG1-PG0)) worker_cpu_ticks $((W1-W0))" > $OUT/summary.txt
wait $B
tail -1 $OUT/bench.out >> $OUT/summary.txt
# The benchmark dropped its database and namespace; its statements' statistics stay, by dbid.
$P -d postgres -c "select calls, rows, round(total_exec_time::numeric,1) ms, round((total_exec_time/calls)::numeric,3) ms_per_call, left(regexp_replace(query, '\s+', ' ', 'g'), 160) from pg_stat_statements where dbid = $DBID order by total_exec_time desc limit 25" > $OUT/statements.txt
cat $OUT/summary.txt
echo "statements: $OUT/statements.txt; worker profile: perf report -i $OUT/perf.data --no-children --sort dso,symbol"
