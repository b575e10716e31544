-- What the status topic says of each task, and what the audit found wrong.

CREATE TABLE task_states (
    task_id uuid PRIMARY KEY,
    tenant text NOT NULL,
    kind text NOT NULL,
    state text NOT NULL,
    reason text,
    version bigint NOT NULL,
    updated_at_us bigint NOT NULL
);
CREATE INDEX task_states_open ON task_states (state, updated_at_us)
    WHERE state IN ('queued', 'waiting', 'running');

-- The last audit's findings: one row per task and kind of finding.
CREATE TABLE audit_findings (
    task_id uuid NOT NULL,
    finding text NOT NULL,
    state text NOT NULL,
    detail text NOT NULL,
    detected_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, finding)
);
