-- The scheduler's tables, after the bus tables: the task lifecycle (the authority
-- on task state), durable timers (`due_at_us`), concurrency slots and rate buckets.

CREATE TABLE tasks (
    task_id uuid PRIMARY KEY,
    tenant text NOT NULL,
    kind text NOT NULL,
    input_json text NOT NULL,
    -- 0 high, 1 normal, 2 low: ascending order is dispatch order.
    priority smallint NOT NULL,
    provider text,
    lifecycle jsonb NOT NULL,
    state text NOT NULL,
    -- The durable timer: when the task may next be granted (backoff, not_before,
    -- busy wait, the deadline); NULL while it may not be.
    due_at_us bigint,
    deadline_us bigint,
    -- The approval an executor reported, until its release arrives.
    pending_signal text,
    pending_step text,
    version bigint NOT NULL DEFAULT 0,
    accepted_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
-- The dispatcher's question: each tenant's next due task, by priority then age.
CREATE INDEX tasks_due ON tasks (tenant, priority, due_at_us) WHERE due_at_us IS NOT NULL;
CREATE INDEX tasks_next_due ON tasks (due_at_us) WHERE due_at_us IS NOT NULL;

-- One row per live grant: the capacity it holds at its provider. A slot whose
-- release is never heard expires, so a lost event cannot leak capacity forever.
CREATE TABLE slots (
    grant_id uuid PRIMARY KEY,
    task_id uuid NOT NULL,
    provider text NOT NULL,
    tenant text NOT NULL,
    kind text NOT NULL,
    expires_at_us bigint NOT NULL
);
CREATE INDEX slots_by_provider ON slots (provider, expires_at_us);

-- Token buckets per provider, shared by every scheduler instance (row lock).
CREATE TABLE rate_buckets (
    provider text PRIMARY KEY,
    tokens double precision NOT NULL,
    refilled_at_us bigint NOT NULL
);

-- When each tenant was last granted: the tenant waiting longest goes first.
CREATE TABLE tenant_turns (
    tenant text PRIMARY KEY,
    last_granted_at_us bigint NOT NULL
);
