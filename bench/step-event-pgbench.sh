#!/bin/bash
# The journal statement in isolation, before and after step events were served from the
# journal (migration 20261207000001): pgbench runs a fenced journal write shaped like
# `record_steps_many` (lock 14 running operations in id order, upsert one step row each) from 4
# clients, each on its own operations, on two scratch databases: one migrated up to the
# migration before (a per-row trigger writes each step's event row; the lock is FOR SHARE) and
# one migrated fully (the journal row is the event; the lock is FOR NO KEY UPDATE, as the
# worker's statement takes it). Prints, alternating ROUNDS times, statements/s (14 step rows
# each) and WAL bytes per step row for both. The databases are created, migrated with psql and
# dropped.
# Usage: bash bench/step-event-pgbench.sh [ROUNDS] [SECONDS]   (default 2 rounds of 15 s)
set -eu
ROUNDS=${1:-2}
SECS=${2:-15}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
H=${PGHOST:-127.0.0.1}
U=${PGUSER:-postgres}
P="psql -h $H -U $U -q -v ON_ERROR_STOP=1"
CUT=20261207000001
OLD=agentq_stepevents_old_$$
NEW=agentq_stepevents_new_$$
DIR=$(mktemp -d)
trap 'dropdb -h $H -U $U --if-exists $OLD; dropdb -h $H -U $U --if-exists $NEW; rm -rf $DIR' EXIT
for db in $OLD $NEW; do
    createdb -h "$H" -U "$U" $db
    for f in migrations/*.sql; do
        if [ $db = $OLD ] && [[ $(basename "$f") > $CUT ]]; then break; fi
        $P -d $db -f "$f" >/dev/null
    done
    $P -d $db -c "INSERT INTO operations (id, tenant_id, kind, lane, input, input_sha256, max_attempts, status, epoch)
                  SELECT gen_random_uuid(), 't', 'script', 'interactive', '{}'::jsonb, 'x', 5, 'running', 1
                    FROM generate_series(1, 2800);
                  CREATE TABLE bench_ops AS SELECT row_number() OVER (ORDER BY id) - 1 AS n, id FROM operations;
                  CREATE INDEX ON bench_ops (n);
                  ANALYZE"
done
statement() {
    cat <<SQL
\set b :client_id * 50 + random(0, 49)
\set s random(1, 2000000000)
WITH input AS (SELECT id, 1::bigint AS epoch FROM bench_ops WHERE n BETWEEN :b * 14 AND :b * 14 + 13),
lease AS (SELECT o.id, o.epoch FROM operations o JOIN input i ON o.id = i.id
           WHERE o.epoch = i.epoch AND o.status = 'running' ORDER BY o.id FOR $1 OF o),
journal AS (INSERT INTO operation_steps (op_id, seq, name, kind, replay, idempotency_key, status,
                                         output, epoch, started_at, completed_at)
            SELECT lease.id, :s, 's', 'custom', 'safe', 'k', 'completed', '{"i":1}'::jsonb,
                   lease.epoch, now(), now() FROM lease
            ON CONFLICT (op_id, seq) DO UPDATE SET status = EXCLUDED.status)
SELECT id FROM lease;
SQL
}
statement "SHARE" > "$DIR/old.sql"
statement "NO KEY UPDATE" > "$DIR/new.sql"
# run DB SCRIPT: "<statements/s> <WAL bytes per step row>"
run() {
    local a b rows0 rows1 tps
    a=$($P -d "$1" -Atc "SELECT pg_current_wal_lsn()")
    rows0=$($P -d "$1" -Atc "SELECT count(*) FROM operation_steps")
    tps=$(pgbench -h "$H" -U "$U" -n -M prepared -c 4 -T "$SECS" -f "$2" "$1" 2>/dev/null | awk '/^tps/ {printf "%.0f", $3}')
    b=$($P -d "$1" -Atc "SELECT pg_current_wal_lsn()")
    rows1=$($P -d "$1" -Atc "SELECT count(*) FROM operation_steps")
    echo "$tps statements/s, $($P -d "$1" -Atc "SELECT (pg_wal_lsn_diff('$b', '$a') / GREATEST($rows1 - $rows0, 1))::int") WAL bytes per step row"
}
for r in $(seq "$ROUNDS"); do
    echo "round $r: a step event row per step (before $CUT): $(run $OLD "$DIR/old.sql")"
    echo "round $r: step events from the journal:              $(run $NEW "$DIR/new.sql")"
done
