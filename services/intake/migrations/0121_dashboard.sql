-- What the dashboard follows (docs/dashboard.md).
--
-- The last time intake's projections changed each task. Every projection write
-- upserts its row and notifies `<schema>_task_changed` in the same transaction, so
-- the notification leaves on commit; an event stream that reconnects replays the
-- rows changed since its last event id from here.
CREATE TABLE task_changes (
    task_id uuid PRIMARY KEY,
    tenant text NOT NULL,
    changed_at timestamptz NOT NULL
);
CREATE INDEX task_changes_by_tenant ON task_changes (tenant, changed_at);

-- Each task's timeline: every event about it that intake's projections consume
-- (status snapshots, the executor's reports with phases and checkpoints, the
-- reconciler's decisions), with the trace it belongs to. Keyed by the event's id,
-- so a redelivered record adds nothing.
CREATE TABLE task_timeline (
    task_id uuid NOT NULL,
    event_id text NOT NULL,
    at timestamptz NOT NULL,
    source text NOT NULL,
    event_type text NOT NULL,
    attempt integer,
    step text,
    phase text,
    signal_name text,
    detail text,
    trace_id text,
    PRIMARY KEY (task_id, event_id)
);
