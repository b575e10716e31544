-- Intake's projection of fenceline.recovery: the evidence of each task's open
-- `outcome_unknown` case, shown by GET /v1/tasks/{id}.
CREATE TABLE task_cases (
    task_id uuid PRIMARY KEY,
    case_id text NOT NULL,
    evidence jsonb NOT NULL,
    decided_at timestamptz NOT NULL
);
