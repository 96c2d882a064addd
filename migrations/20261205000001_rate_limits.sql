-- Rate limits by units per window, kept here so that every worker shares them.
--
-- A limit caps the tokens and/or requests of model calls in any window of `window_secs`: for
-- a provider or one of its models (scope `model`, name `<provider>` or `<provider>/<model>`),
-- for a tenant (scope `tenant`, name the tenant), or for a key operations name (scope `key`,
-- name the `rate_key`, within `tenant_id`'s operations: a tenant cannot spend another's key).
CREATE TABLE rate_limits (
    id uuid PRIMARY KEY,
    scope text NOT NULL CHECK (scope IN ('model', 'tenant', 'key')),
    name text NOT NULL,
    tenant_id text NOT NULL DEFAULT '',
    window_secs integer NOT NULL CHECK (window_secs BETWEEN 1 AND 86400),
    max_tokens bigint CHECK (max_tokens > 0),
    max_requests bigint CHECK (max_requests > 0),
    -- Reservations are a call's estimate times this: the largest recent ratio of a call's
    -- reported usage to its estimate (never below 1), learned as calls return. Once per
    -- window it decays halfway to 1, never below `ratio_peak`, the largest ratio a call
    -- needed since the last decay: a ratio calls keep needing is kept.
    usage_ratio double precision NOT NULL DEFAULT 1 CHECK (usage_ratio >= 1),
    ratio_peak double precision NOT NULL DEFAULT 1,
    ratio_decayed_at timestamptz NOT NULL DEFAULT now(),
    -- The smallest call refused since the limit last woke its parked operations, and when:
    -- a settlement that leaves room for it wakes as many as fit, not a window later.
    refused_need bigint,
    refused_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    CHECK (max_tokens IS NOT NULL OR max_requests IS NOT NULL),
    CHECK ((scope = 'key') = (tenant_id <> '')),
    UNIQUE (scope, tenant_id, name)
);

-- What calls sent in each hundredth of a limit's window reserved (corrected to their reported
-- usage when they return). Buckets older than the window are deleted as calls pass.
CREATE TABLE rate_usage (
    limit_id uuid NOT NULL REFERENCES rate_limits ON DELETE CASCADE,
    bucket bigint NOT NULL,
    tokens bigint NOT NULL DEFAULT 0,
    requests bigint NOT NULL DEFAULT 0,
    -- Calls reserved here and not yet corrected: calls in flight (or whose worker died).
    pending bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (limit_id, bucket)
);

-- The key an operation's model calls count against (scope `key` limits of its tenant).
ALTER TABLE operations ADD COLUMN rate_key text;

-- Operations parked on a rate limit, as a settlement that makes room finds them.
CREATE INDEX operations_rate_parked ON operations (waiting_for, run_at)
    WHERE status = 'waiting' AND waiting_for LIKE '(rate limit %';

-- A claim says whether a budget is over the operation; a worker then probes again before a
-- model call only if a budget was born apart from its operation (`agentq budget set`, a
-- batch's, a tenant's) since that claim: the newest such birth is one indexed read.
ALTER TABLE budgets
    ADD COLUMN created_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN born_apart boolean NOT NULL DEFAULT true;
CREATE INDEX budgets_born_apart ON budgets (created_at) WHERE born_apart;

-- Grants a worker process room for calls of about `estimate` tokens in every limit of `ids`,
-- or in none: at least one such call, at most `want` of them, and never more than a quarter of
-- what any of the limits has left (so that other processes find room too; near a limit a grant
-- is one call). Grants are in estimate units: limit l counts `ceil(units * usage_ratio_l)`
-- tokens and `requests` calls in the current bucket. The process hands the grant out to its
-- calls until the bucket ends (`r_expires_ms` from now, as this server's clock tells it), then
-- settles it (`agentq_rate_settle`): the unused part is returned and the calls' reported usage
-- replaces their share.
--
-- Each limit row is locked (in id order, as every grant takes them) before its window is read,
-- so grants on one limit from every worker queue here and each sees the ones before it. A
-- limit's window is read as its 100 buckets, the current one, and a margin of at least two
-- buckets and 500 ms for calls that reach the provider a little after they were granted.
-- Answers one row per limit: granted (`r_bucket` set), or refused with the time the oldest
-- buckets leave room for one call (`r_reopens_at`) and whether grants in flight in the window
-- (`r_settling`) may make room sooner when they settle, or `r_never` when one call's
-- reservation alone is more than the limit.
CREATE FUNCTION agentq_rate_reserve(ids uuid[], estimate bigint, want integer)
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
        SELECT coalesce(sum(u.tokens), 0), coalesce(sum(u.requests), 0),
               coalesce(sum(u.pending), 0)
          INTO used_tokens, used_requests, in_flight
          FROM rate_usage u WHERE u.limit_id = l.id AND u.bucket >= lo;
        IF (l.max_tokens IS NOT NULL AND used_tokens + res > l.max_tokens)
           OR (l.max_requests IS NOT NULL AND used_requests + 1 > l.max_requests) THEN
            SELECT min(s.bucket) INTO first_free FROM (
                SELECT u.bucket, sum(u.tokens) OVER w AS t, sum(u.requests) OVER w AS r
                  FROM rate_usage u WHERE u.limit_id = l.id AND u.bucket >= lo
                WINDOW w AS (ORDER BY u.bucket)) s
             WHERE (l.max_tokens IS NULL OR used_tokens - s.t + res <= l.max_tokens)
               AND (l.max_requests IS NULL OR used_requests - s.r + 1 <= l.max_requests);
            UPDATE rate_limits rl SET refused_need = least(coalesce(rl.refused_need, res), res),
                                      refused_at = now()
             WHERE rl.id = l.id;
            -- Bucket b leaves the window read when the current bucket is b + (cur - lo) + 1.
            RETURN QUERY SELECT l.id, NULL::bigint, res, 0::bigint, l.usage_ratio, 0::bigint,
                0::bigint,
                to_timestamp((coalesce(first_free, cur) + (cur - lo) + 1) * width / 1000.0),
                false, in_flight > 0;
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
        RETURN QUERY SELECT l.id, cur, res, requests, l.usage_ratio, units,
                            (cur + 1) * width - floor(extract(epoch FROM clock_timestamp())
                                                      * 1000)::bigint,
                            NULL::timestamptz, false, false;
    END LOOP;
END
$$;

-- Settles what a process holds in limits `ids` at `buckets`: adds `add_tokens` and
-- `add_requests` (negative: a grant's unused part returned, or calls that used less than their
-- share) and `add_pending` (-1 for a settled grant), and records in each limit `ratios`, the
-- largest ratio of a call's reported usage to its estimate (when above 1). A limit that
-- refused a call in its current window and now has room for it wakes as many of the
-- operations parked on it as fit (the earliest due first): they reserve again at once.
CREATE FUNCTION agentq_rate_settle(ids uuid[], buckets bigint[], add_tokens bigint[],
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
                SELECT p.id FROM operations p
                 WHERE p.status = 'waiting' AND p.waiting_for LIKE '(rate limit %'
                   AND starts_with(p.waiting_for, '(rate limit ' || l.scope || ' '
                       || CASE WHEN l.scope = 'key' THEN l.tenant_id || ':' || l.name
                               ELSE l.name END || ' ')
                   AND p.run_at > now()
                 ORDER BY p.run_at LIMIT fit)
               AND o.status = 'waiting';
        END IF;
    END LOOP;
END
$$;
