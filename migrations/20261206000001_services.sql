-- Remote kinds: services an admin registered (`agentq services add`), whose kinds run over the
-- step protocol (docs/protocol.md). Every role reads this table to know the kinds a service
-- serves; the worker calls `url` signed with `secret` (Standard Webhooks, `whsec_…`).
CREATE TABLE services (
    name         text        PRIMARY KEY,
    url          text        NOT NULL,
    secret       text        NOT NULL,
    timeout_secs integer     NOT NULL DEFAULT 300 CHECK (timeout_secs BETWEEN 1 AND 86400),
    -- The manifest as the service answered it (`GET {url}/agentq/manifest`), checked.
    manifest     jsonb       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);
