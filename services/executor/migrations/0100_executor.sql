-- The executor's tables, after the bus tables: executions (leases, fencing
-- tokens, phases, provider request ids), step checkpoints and call sequences.

-- One row per grant. The consumer only inserts it; workers claim it with a lease
-- and a fencing token that grows on every claim. Every later write is
-- conditional on (fencing_token, phase): zero rows means the writer was fenced.
CREATE TABLE executions (
    grant_id uuid PRIMARY KEY,
    task_id uuid NOT NULL,
    tenant text NOT NULL,
    attempt integer NOT NULL,
    generation integer NOT NULL,
    kind text NOT NULL,
    input_json text NOT NULL,
    resume_after_step text,
    provider text NOT NULL,
    deadline_us bigint,
    lease_budget_ms bigint NOT NULL,
    -- ready | running | succeeded | failed | released | lost
    status text NOT NULL DEFAULT 'ready',
    fencing_token bigint NOT NULL DEFAULT 0,
    worker text,
    lease_expires_at_us bigint,
    -- Whether the last claim took over a lease that had expired.
    takeover boolean NOT NULL DEFAULT false,
    first_claimed_at_us bigint,
    phase text,
    phase_at_us bigint,
    step text,
    operation_key text,
    provider_request_id text,
    cancel_requested boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX executions_claimable ON executions (created_at) WHERE status IN ('ready', 'running');

-- What each finished step produced; a new attempt resumes after the last one.
CREATE TABLE checkpoints (
    task_id uuid NOT NULL,
    generation integer NOT NULL,
    step text NOT NULL,
    output jsonb NOT NULL,
    sha256 text NOT NULL,
    attempt integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, generation, step)
);

-- The `seq` of each step's operation key. It grows only after a definite answer
-- that nothing was done, so a retry after an unknown outcome reuses the key.
CREATE TABLE call_sequences (
    task_id uuid NOT NULL,
    generation integer NOT NULL,
    step text NOT NULL,
    seq integer NOT NULL DEFAULT 0,
    PRIMARY KEY (task_id, generation, step)
);
