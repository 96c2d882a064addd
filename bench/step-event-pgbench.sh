#!/bin/bash
# The journal statement in isolation, with and without its step event rows: pgbench runs a
# fenced journal write shaped like `record_steps_many` (lock 14 running operations FOR SHARE
# in id order, upsert one step row each) from 4 clients, each on its own operations, first with
# the per-row event trigger as migrated, then with both step event triggers disabled. Prints
# statements/s (14 step rows each) for both, alternating ROUNDS times. A scratch database is
# created, migrated with psql and dropped.
# Usage: bash bench/step-event-pgbench.sh [ROUNDS] [SECONDS]   (default 2 rounds of 15 s)
set -eu
ROUNDS=${1:-2}
SECS=${2:-15}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DB=agentq_stepevents_$$
P="psql -h ${PGHOST:-127.0.0.1} -U ${PGUSER:-postgres} -q -v ON_ERROR_STOP=1"
SCRIPT=$(mktemp)
trap 'dropdb -h ${PGHOST:-127.0.0.1} -U ${PGUSER:-postgres} --if-exists $DB; rm -f $SCRIPT' EXIT
createdb -h "${PGHOST:-127.0.0.1}" -U "${PGUSER:-postgres}" $DB
for f in migrations/*.sql; do $P -d $DB -f "$f" >/dev/null; done
$P -d $DB -c "INSERT INTO operations (id, tenant_id, kind, lane, input, input_sha256, max_attempts, status, epoch)
              SELECT gen_random_uuid(), 't', 'script', 'interactive', '{}'::jsonb, 'x', 5, 'running', 1
                FROM generate_series(1, 2800);
              CREATE TABLE bench_ops AS SELECT row_number() OVER (ORDER BY id) - 1 AS n, id FROM operations;
              CREATE INDEX ON bench_ops (n);
              ANALYZE"
cat > "$SCRIPT" <<'SQL'
\set b :client_id * 50 + random(0, 49)
\set s random(1, 2000000000)
WITH input AS (SELECT id, 1::bigint AS epoch FROM bench_ops WHERE n BETWEEN :b * 14 AND :b * 14 + 13),
lease AS (SELECT o.id, o.epoch FROM operations o JOIN input i ON o.id = i.id
           WHERE o.epoch = i.epoch AND o.status = 'running' ORDER BY o.id FOR SHARE OF o),
journal AS (INSERT INTO operation_steps (op_id, seq, name, kind, replay, idempotency_key, status,
                                         output, epoch, started_at, completed_at)
            SELECT lease.id, :s, 's', 'custom', 'safe', 'k', 'completed', '{"i":1}'::jsonb,
                   lease.epoch, now(), now() FROM lease
            ON CONFLICT (op_id, seq) DO UPDATE SET status = EXCLUDED.status)
SELECT id FROM lease;
SQL
run() { pgbench -h "${PGHOST:-127.0.0.1}" -U "${PGUSER:-postgres}" -n -M prepared -c 4 -T "$SECS" -f "$SCRIPT" $DB 2>/dev/null | awk '/^tps/ {printf "%.0f", $3}'; }
for r in $(seq "$ROUNDS"); do
    $P -d $DB -c "ALTER TABLE operation_steps ENABLE TRIGGER operation_steps_event_insert; ALTER TABLE operation_steps ENABLE TRIGGER operation_steps_event_status"
    echo "round $r: with step event rows $(run) statements/s"
    $P -d $DB -c "ALTER TABLE operation_steps DISABLE TRIGGER operation_steps_event_insert; ALTER TABLE operation_steps DISABLE TRIGGER operation_steps_event_status"
    echo "round $r: without           $(run) statements/s"
done
