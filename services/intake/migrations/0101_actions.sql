-- What people asked of accepted tasks. Each row is the dedup identity of one
-- event on fenceline.tasks: a repeated request finds its row and sends nothing.

CREATE TABLE cancellations (
    task_id uuid PRIMARY KEY REFERENCES tasks (task_id),
    requested_by text NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE signals (
    task_id uuid NOT NULL REFERENCES tasks (task_id),
    signal_name text NOT NULL,
    signal_id text NOT NULL,
    payload jsonb NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, signal_name, signal_id)
);

CREATE TABLE resolutions (
    task_id uuid NOT NULL REFERENCES tasks (task_id),
    case_id text NOT NULL,
    action text NOT NULL,
    charge_acknowledged boolean NOT NULL,
    attached_result jsonb,
    decided_by text NOT NULL,
    decided_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, case_id)
);
