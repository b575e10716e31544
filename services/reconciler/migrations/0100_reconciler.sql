-- The reconciler's tables, after the bus tables: watches on grants, the calls each
-- attempt announced, and the cases it decides with evidence.

-- Every grant seen on the dispatch topic, kept whole so a lost one can be
-- re-issued with the same grant id (the executor records it once).
CREATE TABLE grants (
    grant_id uuid PRIMARY KEY,
    task_id uuid NOT NULL,
    attempt integer NOT NULL,
    kind text NOT NULL,
    provider text NOT NULL,
    deadline_us bigint,
    granted jsonb NOT NULL,
    claimed boolean NOT NULL DEFAULT false,
    ended boolean NOT NULL DEFAULT false,
    claim_deadline_us bigint NOT NULL,
    reissues integer NOT NULL DEFAULT 0
);
CREATE INDEX grants_unclaimed ON grants (claim_deadline_us) WHERE NOT claimed AND NOT ended;

-- The last call each attempt announced (CallIntentRecorded, ProviderAccepted).
CREATE TABLE calls (
    task_id uuid NOT NULL,
    attempt integer NOT NULL,
    step text NOT NULL,
    provider text NOT NULL,
    operation_key text NOT NULL,
    provider_request_id text,
    intent_at_us bigint NOT NULL,
    PRIMARY KEY (task_id, attempt)
);

-- One case per attempt that ended without a clean result.
CREATE TABLE cases (
    case_id uuid PRIMARY KEY,
    task_id uuid NOT NULL,
    attempt integer NOT NULL,
    kind text NOT NULL,
    step text,
    provider text,
    operation_key text,
    provider_request_id text,
    last_phase text NOT NULL,
    last_phase_at_us bigint NOT NULL,
    -- asking | decided
    state text NOT NULL,
    decision text,
    asked integer NOT NULL DEFAULT 0,
    next_ask_at_us bigint,
    ask_until_us bigint NOT NULL,
    evidence jsonb NOT NULL DEFAULT '[]',
    opened_at timestamptz NOT NULL DEFAULT now(),
    decided_at timestamptz,
    UNIQUE (task_id, attempt)
);
CREATE INDEX cases_asking ON cases (next_ask_at_us) WHERE state = 'asking';
