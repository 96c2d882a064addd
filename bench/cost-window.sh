#!/bin/bash
# What a running benchmark costs per step, over a window of its steady state: CPU seconds of
# the worker processes, of the benchmark process (its producers) and of every PostgreSQL
# process, WAL bytes and commits, per 1,000 journal rows written in the window. Runs
# `$AGENTQ bench ARGS…` (a release build by default), waits until its database has journal rows
# (and, with MARK=text, until the benchmark printed that text to stderr, e.g. MARK=10-step for
# the 10-step phase of `--scenario steps`), lets it run 2 s more, then measures WINDOW seconds
# (default 6). Commits are PostgreSQL's cumulative statistics, which backends flush about once a
# second: over a short window they are approximate. Prints one line of figures, then the benchmark's own JSON line.
# Usage: [AGENTQ=path] [MARK=text] [WINDOW=s] bash bench/cost-window.sh --scenario steps --jobs 6000 …
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
AGENTQ=${AGENTQ:-./target/release/agentq}
WINDOW=${WINDOW:-6}
OUT=$(mktemp -d)
P="psql -h ${PGHOST:-127.0.0.1} -U ${PGUSER:-postgres} -At"
DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres} "$AGENTQ" bench "$@" > "$OUT/out" 2> "$OUT/err" &
B=$!
trap 'kill $B 2>/dev/null; rm -rf "$OUT"' EXIT
deadline=$((SECONDS + 300))
DB=""
until [ -n "$DB" ] && [ "$($P -d "$DB" -c "select exists (select 1 from operation_steps)" 2>/dev/null)" = t ]; do
    [ $SECONDS -lt $deadline ] && kill -0 $B 2>/dev/null || { echo "the benchmark wrote no journal row" >&2; cat "$OUT/err" >&2; exit 1; }
    DB=$($P -c "select datname from pg_database where datname like 'agentq_bench_%' order by oid desc limit 1")
    sleep 0.2
done
if [ -n "${MARK:-}" ]; then
    until grep -q -- "$MARK" "$OUT/err"; do
        [ $SECONDS -lt $deadline ] && kill -0 $B 2>/dev/null || { echo "the benchmark never printed $MARK" >&2; exit 1; }
        sleep 0.2
    done
fi
sleep 2
ticks() { for p in "$@"; do awk '{print $14+$15}' /proc/$p/stat 2>/dev/null; done | awk '{s+=$1} END {print s+0}'; }
W=$(pgrep -f "agentq[^ ]* worker" | tr '\n' ' ')
PGS=$(pgrep -u postgres postgres | tr '\n' ' ')
rows() { $P -d "$DB" -c "select count(*) from operation_steps"; }
wal() { $P -c "select pg_current_wal_lsn()"; }
commits() { $P -c "select sum(xact_commit) from pg_stat_database"; }
S0=$(rows); WAL0=$(wal); C0=$(commits); PG0=$(ticks $PGS); W0=$(ticks $W); B0=$(ticks $B); T0=$(date +%s.%N)
sleep "$WINDOW"
T1=$(date +%s.%N); PG1=$(ticks $PGS); W1=$(ticks $W); B1=$(ticks $B)
S1=$(rows); WAL1=$(wal); C1=$(commits)
WALB=$($P -c "select pg_wal_lsn_diff('$WAL1', '$WAL0')::bigint")
for p in $W; do [ -d /proc/$p ] || { echo "a worker exited inside the window: give more jobs or a shorter WINDOW" >&2; exit 1; }; done
HZ=$(getconf CLK_TCK)
awk -v s=$((S1 - S0)) -v t="$(echo "$T1 - $T0" | bc)" -v pg=$((PG1 - PG0)) -v w=$((W1 - W0)) -v b=$((B1 - B0)) \
    -v wal="$WALB" -v c=$((C1 - C0)) -v hz="$HZ" 'BEGIN {
    k = s / 1000; if (k == 0) { print "no journal row written in the window" > "/dev/stderr"; exit 1 }
    printf "window %.1f s: %d journal rows (%.0f/s); CPU s per 1,000 rows: worker %.3f, bench %.3f, PostgreSQL %.3f; WAL bytes per row %.0f; commits per row %.3f\n",
        t, s, s / t, w / hz / k, b / hz / k, pg / hz / k, wal / s, c / s }'
wait $B
tail -1 "$OUT/out"
