-- Intake's tables, after the bus tables. Versions of services start at 0100.

CREATE TABLE tenants (
    tenant text PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Bearer tokens, stored as sha256 of the token; the token itself is shown once.
CREATE TABLE api_tokens (
    token_id uuid PRIMARY KEY,
    tenant text NOT NULL REFERENCES tenants (tenant),
    token_sha256 bytea NOT NULL UNIQUE,
    label text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);

-- One row per (tenant, key): the fingerprint of the canonical request and the task
-- it created. A concurrent second request with the same key blocks on this row's
-- unique index until the first commits, then replays its answer.
CREATE TABLE idempotency_keys (
    tenant text NOT NULL,
    idempotency_key text NOT NULL,
    fingerprint bytea NOT NULL,
    task_id uuid NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, idempotency_key)
);
CREATE INDEX idempotency_keys_by_age ON idempotency_keys (created_at);

-- Every accepted task, as accepted. A task is readable from the moment its
-- submission commits, before any other service has seen it.
CREATE TABLE tasks (
    task_id uuid PRIMARY KEY,
    tenant text NOT NULL,
    kind text NOT NULL,
    input jsonb NOT NULL,
    priority text NOT NULL,
    deadline timestamptz,
    not_before timestamptz,
    labels jsonb NOT NULL,
    source text NOT NULL,
    accepted_at timestamptz NOT NULL
);
CREATE INDEX tasks_by_tenant ON tasks (tenant, accepted_at DESC);

-- The read model: the latest fenceline.status snapshot of each task.
CREATE TABLE task_view (
    task_id uuid PRIMARY KEY,
    tenant text NOT NULL,
    kind text NOT NULL,
    state text NOT NULL,
    reason text,
    attempt integer NOT NULL,
    step text,
    phase text,
    next_attempt_at timestamptz,
    result jsonb,
    case_id text,
    updated_at timestamptz NOT NULL,
    version bigint NOT NULL
);
