-- The `kv_put` / `kv_get` tools of the built-in `agent` kind: a small key-value store per tenant.
CREATE TABLE agent_kv (
    tenant_id  text        NOT NULL,
    key        text        NOT NULL,
    value      jsonb       NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, key)
);
