-- The support agent's own table: orders, per tenant. It lives in agentq's database here (the
-- tools reach it through the worker's pool); it could as well live in a database of its own.
CREATE TABLE IF NOT EXISTS support_orders (
    tenant      text   NOT NULL,
    order_id    text   NOT NULL,
    customer    text   NOT NULL,
    total_cents bigint NOT NULL CHECK (total_cents >= 0),
    status      text   NOT NULL,
    PRIMARY KEY (tenant, order_id)
);
