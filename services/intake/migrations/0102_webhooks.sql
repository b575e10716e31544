-- Webhook senders: which tenant and task kind a source's deliveries become, and the
-- secrets they sign with. Two secrets may be active at once, for rotation. Secrets
-- are needed in clear to verify HMACs; protect this schema (or encrypt the column
-- with the platform's key service) accordingly.

CREATE TABLE webhook_sources (
    source text PRIMARY KEY,
    tenant text NOT NULL REFERENCES tenants (tenant),
    kind text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE webhook_secrets (
    secret_id uuid PRIMARY KEY,
    source text NOT NULL REFERENCES webhook_sources (source),
    secret text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    retired_at timestamptz
);
CREATE INDEX webhook_secrets_active ON webhook_secrets (source) WHERE retired_at IS NULL;
