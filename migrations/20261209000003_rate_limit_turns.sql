-- A limit shared by tenants gives its room to them in turn. Room went to whichever call asked
-- first: under 10 requests per 10 s, one tenant's 200 waiting calls got 161 through while
-- another's third call waited 156 s. Now a limit knows which tenants have calls waiting on it
-- (`rate_waiters`, one row per tenant, not per call) and which tenant it granted last
-- (`last_tenant`); while other tenants wait, the next room is the next waiting tenant's in
-- the ring of tenant ids after `last_tenant`: a call of another tenant is granted only if the
-- window holds room for it and the turn's call too (work-conserving), and a grant is one call,
-- so no batch of calls passes a turn. A tenant served leaves the ring and joins it again at its
-- next refusal. A waiter row lapses at `until` (when its refused call was due back, and ten
-- seconds more): a tenant whose calls gave up holds no turn.
--
-- Parked operations are matched to their limit by its id, never by its label (`tenant:key`
-- labels of two tenants could read the same): `waiting_for` now names the limit's id first,
-- `(rate limit <id> <scope> <label> <time>)`.
ALTER TABLE rate_limits ADD COLUMN last_tenant text;

CREATE TABLE rate_waiters (
    limit_id  uuid        NOT NULL REFERENCES rate_limits ON DELETE CASCADE,
    tenant_id text        NOT NULL,
    -- The tokens its last refused call would reserve in this limit.
    need      bigint      NOT NULL,
    since     timestamptz NOT NULL DEFAULT now(),
    until     timestamptz NOT NULL,
    PRIMARY KEY (limit_id, tenant_id)
);

DROP FUNCTION agentq_rate_reserve(uuid[], bigint, integer);

-- As before (migration 20261205000001), for the calls of `tenant` (NULL: no turns, as a worker
-- of the previous release asks).
CREATE FUNCTION agentq_rate_reserve(ids uuid[], estimate bigint, want integer,
                                    tenant text DEFAULT NULL)
RETURNS TABLE (r_limit uuid, r_bucket bigint, r_tokens bigint, r_requests bigint,
               r_ratio double precision, r_units bigint, r_expires_ms bigint,
               r_reopens_at timestamptz, r_never boolean, r_settling boolean)
LANGUAGE plpgsql AS $$
DECLARE
    l record;
    now_ms bigint := floor(extract(epoch FROM clock_timestamp()) * 1000);
    width bigint;
    cur bigint;
    lo bigint;
    res bigint;
    used_tokens bigint;
    used_requests bigint;
    in_flight bigint;
    first_free bigint;
    refused boolean := false;
    units bigint := estimate * want;
    requests bigint := want;
    turn text;
    turn_need bigint;
    extra_tokens bigint;
    extra_requests bigint;
    reopens timestamptz;
BEGIN
    PERFORM 1 FROM rate_limits rl WHERE rl.id = ANY(ids) ORDER BY rl.id FOR UPDATE;
    FOR l IN SELECT * FROM rate_limits rl WHERE rl.id = ANY(ids) ORDER BY rl.id LOOP
        width := l.window_secs * 10;
        cur := now_ms / width;
        lo := cur - 100 - greatest(2, ceil(500.0 / width)::bigint);
        DELETE FROM rate_usage u WHERE u.limit_id = l.id AND u.bucket < lo;
        -- Once per window the learned ratio decays halfway to 1, never below the largest
        -- ratio a call needed in that window.
        IF l.usage_ratio > 1
           AND l.ratio_decayed_at < now() - l.window_secs * interval '1 second' THEN
            l.usage_ratio := greatest(l.ratio_peak, 1 + (l.usage_ratio - 1) / 2);
            UPDATE rate_limits rl SET usage_ratio = l.usage_ratio, ratio_peak = 1,
                                      ratio_decayed_at = now()
             WHERE rl.id = l.id;
        END IF;
        res := ceil(estimate * l.usage_ratio);
        IF l.max_tokens IS NOT NULL AND res > l.max_tokens THEN
            RETURN QUERY SELECT l.id, NULL::bigint, res, 0::bigint, l.usage_ratio, 0::bigint,
                                0::bigint, NULL::timestamptz, true, false;
            refused := true;
            CONTINUE;
        END IF;
        -- Whose turn it is: while another tenant waits, the next waiting tenant after the one
        -- granted last (the ring of tenant ids); this call must leave room for that one's.
        turn := NULL;
        turn_need := 0;
        IF tenant IS NOT NULL AND EXISTS (
               SELECT 1 FROM rate_waiters w
                WHERE w.limit_id = l.id AND w.tenant_id <> tenant AND w.until > now()) THEN
            SELECT w.tenant_id, w.need INTO turn, turn_need FROM (
                SELECT w.tenant_id, w.need FROM rate_waiters w
                 WHERE w.limit_id = l.id AND w.until > now() AND w.tenant_id <> tenant
                UNION ALL SELECT tenant, res) w
             ORDER BY (w.tenant_id <= coalesce(l.last_tenant, '')), w.tenant_id
             LIMIT 1;
            IF turn = tenant THEN
                turn_need := 0;
            END IF;
            -- No batch of calls passes a turn.
            units := estimate;
            requests := 1;
        END IF;
        extra_tokens := CASE WHEN turn IS NULL OR turn = tenant THEN 0 ELSE turn_need END;
        extra_requests := CASE WHEN extra_tokens > 0 OR (turn IS NOT NULL AND turn <> tenant)
                               THEN 1 ELSE 0 END;
        SELECT coalesce(sum(u.tokens), 0), coalesce(sum(u.requests), 0),
               coalesce(sum(u.pending), 0)
          INTO used_tokens, used_requests, in_flight
          FROM rate_usage u WHERE u.limit_id = l.id AND u.bucket >= lo;
        IF (l.max_tokens IS NOT NULL AND used_tokens + res + extra_tokens > l.max_tokens)
           OR (l.max_requests IS NOT NULL
               AND used_requests + 1 + extra_requests > l.max_requests) THEN
            SELECT min(s.bucket) INTO first_free FROM (
                SELECT u.bucket, sum(u.tokens) OVER w AS t, sum(u.requests) OVER w AS r
                  FROM rate_usage u WHERE u.limit_id = l.id AND u.bucket >= lo
                WINDOW w AS (ORDER BY u.bucket)) s
             WHERE (l.max_tokens IS NULL
                    OR used_tokens - s.t + res + extra_tokens <= l.max_tokens)
               AND (l.max_requests IS NULL
                    OR used_requests - s.r + 1 + extra_requests <= l.max_requests);
            UPDATE rate_limits rl SET refused_need = least(coalesce(rl.refused_need, res), res),
                                      refused_at = now()
             WHERE rl.id = l.id;
            -- Bucket b leaves the window read when the current bucket is b + (cur - lo) + 1.
            reopens := to_timestamp((coalesce(first_free, cur) + (cur - lo) + 1) * width / 1000.0);
            IF tenant IS NOT NULL THEN
                INSERT INTO rate_waiters AS w (limit_id, tenant_id, need, until)
                VALUES (l.id, tenant, res, reopens + interval '10 seconds')
                ON CONFLICT (limit_id, tenant_id) DO UPDATE
                   SET need = EXCLUDED.need, until = greatest(w.until, EXCLUDED.until),
                       since = CASE WHEN w.until > now() THEN w.since ELSE now() END;
            END IF;
            RETURN QUERY SELECT l.id, NULL::bigint, res, 0::bigint, l.usage_ratio, 0::bigint,
                0::bigint, reopens, false, in_flight > 0;
            refused := true;
            CONTINUE;
        END IF;
        IF l.max_tokens IS NOT NULL THEN
            units := least(units, greatest(estimate,
                floor((l.max_tokens - used_tokens) / l.usage_ratio / 4)::bigint));
        END IF;
        IF l.max_requests IS NOT NULL THEN
            requests := least(requests, greatest(1, (l.max_requests - used_requests) / 4));
        END IF;
    END LOOP;
    IF refused THEN
        RETURN;
    END IF;
    FOR l IN SELECT * FROM rate_limits rl WHERE rl.id = ANY(ids) ORDER BY rl.id LOOP
        width := l.window_secs * 10;
        cur := now_ms / width;
        res := ceil(units * l.usage_ratio);
        INSERT INTO rate_usage AS u (limit_id, bucket, tokens, requests, pending)
        VALUES (l.id, cur, res, requests, 1)
        ON CONFLICT (limit_id, bucket)
        DO UPDATE SET tokens = u.tokens + EXCLUDED.tokens,
                      requests = u.requests + EXCLUDED.requests, pending = u.pending + 1;
        IF tenant IS NOT NULL THEN
            -- Served: out of the ring until its next refusal, and the turn moves past it.
            DELETE FROM rate_waiters w WHERE w.limit_id = l.id AND w.tenant_id = tenant;
            IF l.last_tenant IS DISTINCT FROM tenant THEN
                UPDATE rate_limits rl SET last_tenant = tenant WHERE rl.id = l.id;
            END IF;
        END IF;
        RETURN QUERY SELECT l.id, cur, res, requests, l.usage_ratio, units,
                            (cur + 1) * width - floor(extract(epoch FROM clock_timestamp())
                                                      * 1000)::bigint,
                            NULL::timestamptz, false, false;
    END LOOP;
END
$$;

-- As before (migration 20261205000001), but the operations woken are those parked on the
-- limit by its id, as many as fit, the tenants in turn (each one's earliest due first, the
-- tenant whose turn it is first).
CREATE OR REPLACE FUNCTION agentq_rate_settle(ids uuid[], buckets bigint[], add_tokens bigint[],
                                              add_requests bigint[], add_pending bigint[],
                                              ratios float8[])
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    l record;
    width bigint;
    lo bigint;
    used_tokens bigint;
    used_requests bigint;
    fit bigint;
BEGIN
    -- The limits' rows first, in id order, as a grant takes them (then their buckets).
    PERFORM 1 FROM rate_limits rl WHERE rl.id = ANY(ids) ORDER BY rl.id FOR UPDATE;
    UPDATE rate_usage u SET tokens = greatest(0, u.tokens + c.tokens),
                            requests = greatest(0, u.requests + c.requests),
                            pending = greatest(0, u.pending + c.pending)
      FROM unnest(ids, buckets, add_tokens, add_requests, add_pending)
           AS c(id, bucket, tokens, requests, pending)
     WHERE u.limit_id = c.id AND u.bucket = c.bucket;
    UPDATE rate_limits rl
       SET usage_ratio = greatest(rl.usage_ratio, least(c.ratio, 16)),
           ratio_peak = greatest(rl.ratio_peak, least(c.ratio, 16))
      FROM unnest(ids, ratios) AS c(id, ratio)
     WHERE rl.id = c.id AND c.ratio > 1 AND rl.ratio_peak < least(c.ratio, 16);
    FOR l IN SELECT * FROM rate_limits rl
              WHERE rl.id = ANY(ids) AND rl.refused_need IS NOT NULL
                AND rl.refused_at > now() - rl.window_secs * interval '1 second' LOOP
        width := l.window_secs * 10;
        lo := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint / width - 100
              - greatest(2, ceil(500.0 / width)::bigint);
        SELECT coalesce(sum(u.tokens), 0), coalesce(sum(u.requests), 0)
          INTO used_tokens, used_requests
          FROM rate_usage u WHERE u.limit_id = l.id AND u.bucket >= lo;
        fit := least(
            CASE WHEN l.max_tokens IS NULL THEN 1000
                 ELSE (l.max_tokens - used_tokens) / greatest(l.refused_need, 1) END,
            CASE WHEN l.max_requests IS NULL THEN 1000
                 ELSE l.max_requests - used_requests END);
        IF fit >= 1 THEN
            UPDATE rate_limits rl SET refused_need = NULL WHERE rl.id = l.id;
            UPDATE operations o SET run_at = now(), updated_at = now()
             WHERE o.id IN (
                SELECT p.id FROM (
                    SELECT p.id, p.tenant_id, p.run_at,
                           row_number() OVER (PARTITION BY p.tenant_id ORDER BY p.run_at) AS nth
                      FROM operations p
                     WHERE p.status = 'waiting' AND p.waiting_for LIKE '(rate limit %'
                       AND starts_with(p.waiting_for, '(rate limit ' || l.id || ' ')
                       AND p.run_at > now()) p
                 ORDER BY p.nth, (p.tenant_id <= coalesce(l.last_tenant, '')), p.tenant_id,
                          p.run_at
                 LIMIT fit)
               AND o.status = 'waiting';
        END IF;
    END LOOP;
END
$$;

-- Operations parked under the old `waiting_for` (without the limit's id) reserve again now, and
-- park under the new one if they must.
UPDATE operations SET run_at = now(), updated_at = now()
 WHERE status = 'waiting' AND waiting_for LIKE '(rate limit %' AND run_at > now();
