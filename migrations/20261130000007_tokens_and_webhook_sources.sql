-- API bearer tokens: only the SHA-256 of a token is stored; the token is shown once.
CREATE TABLE api_tokens (
    id           uuid        PRIMARY KEY,
    token_sha256 text        NOT NULL UNIQUE,
    prefix       text        NOT NULL,
    tenant_id    text        NOT NULL,
    role         text        NOT NULL CHECK (role IN ('producer', 'operator', 'admin')),
    created_by   text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz,
    revoked_by   text
);

-- Webhook sources (Standard Webhooks): a named sender of a tenant, creating operations of a kind.
CREATE TABLE webhook_sources (
    id         uuid        PRIMARY KEY,
    tenant_id  text        NOT NULL,
    name       text        NOT NULL,
    kind       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, name)
);

-- A source's signing secrets; several are valid at once during a rotation.
CREATE TABLE webhook_secrets (
    source_id  uuid        NOT NULL REFERENCES webhook_sources (id) ON DELETE CASCADE,
    secret     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz
);
CREATE INDEX webhook_secrets_source ON webhook_secrets (source_id);
