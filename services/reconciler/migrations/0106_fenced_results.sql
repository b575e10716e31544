-- Verified results reported by workers whose lease had been taken over
-- (FencedResultReported), one per attempt and step: a report delivered twice adds
-- nothing, and a report heard before its attempt's case is applied when the case
-- opens (docs/execution.md, "Reconciler: evidence, then a decision").
CREATE TABLE fenced_results (
    task_id uuid NOT NULL,
    attempt integer NOT NULL,
    step text NOT NULL,
    operation_key text NOT NULL,
    report jsonb NOT NULL,
    heard_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, attempt, step)
);
