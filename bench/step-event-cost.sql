-- The cost of a journal row's event trigger (operation_steps_event_insert): 20,000 step rows
-- inserted with it, then 20,000 without it, with the time and WAL bytes of each. Run on a
-- scratch database only (it disables the trigger): createdb agentq_trigcost;
-- DATABASE_URL=postgres://…/agentq_trigcost agentq migrate; psql -d agentq_trigcost -f
-- bench/step-event-cost.sql; dropdb agentq_trigcost.
INSERT INTO operations (id, tenant_id, kind, lane, input, input_sha256, max_attempts, status, epoch)
SELECT gen_random_uuid(), 't', 'script', 'interactive', '{}'::jsonb, 'x', 5, 'running', 1 FROM generate_series(1, 2000);
-- Ten step rows (seq lo..lo+9) for each of the 2,000 operations, one statement per seq.
CREATE PROCEDURE pg_temp.insert_steps(lo int) LANGUAGE plpgsql AS $$
BEGIN
  FOR r IN lo..lo + 9 LOOP
    INSERT INTO operation_steps (op_id, seq, name, kind, replay, idempotency_key, status, output, epoch, started_at, completed_at)
    SELECT id, r, 's', 'custom', 'safe', md5(id::text || r), 'completed', '{"i":1}'::jsonb, 1, now(), now() FROM operations;
  END LOOP;
END $$;
CHECKPOINT;
SELECT pg_current_wal_lsn() AS a \gset
\timing on
CALL pg_temp.insert_steps(0);
\timing off
SELECT pg_current_wal_lsn() AS b \gset
SELECT 'with trigger: wal bytes per row ' || (pg_wal_lsn_diff(:'b', :'a') / 20000)::int;
ALTER TABLE operation_steps DISABLE TRIGGER operation_steps_event_insert;
CHECKPOINT;
SELECT pg_current_wal_lsn() AS c \gset
\timing on
CALL pg_temp.insert_steps(10);
\timing off
SELECT pg_current_wal_lsn() AS d \gset
SELECT 'without: wal bytes per row ' || (pg_wal_lsn_diff(:'d', :'c') / 20000)::int;
