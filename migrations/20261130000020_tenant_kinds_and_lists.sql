-- Which kinds a tenant may create operations of, as an admin decided (`agentq tenants kinds`,
-- `PUT /v1/tenants/{tenant}/kinds`). A tenant without a row of its own follows the row of
-- tenant '*' (no tenant id can be '*'), and without that either may use every kind. Checked
-- where an operation is born from a caller (the application layer), and by a spawn's insert
-- (`agentq_kind_allowed` below), so a parent's input cannot name a child of a kind its
-- tenant may not use.
CREATE TABLE tenant_kinds (
    tenant_id   text        PRIMARY KEY,
    kinds       text[]      NOT NULL,
    updated_by  text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION agentq_kind_allowed(tenant text, kind text) RETURNS boolean AS $$
    SELECT COALESCE(
        (SELECT kind = ANY(t.kinds) FROM tenant_kinds t WHERE t.tenant_id = tenant),
        (SELECT kind = ANY(t.kinds) FROM tenant_kinds t WHERE t.tenant_id = '*'),
        true)
$$ LANGUAGE sql STABLE;

-- Lists are per tenant, newest first (`GET /v1/operations`, `agentq list`, the console): this
-- index serves them from the tenant's own rows, so one tenant's lists never read another's.
CREATE INDEX operations_tenant_created ON operations (tenant_id, created_at DESC, id DESC);
