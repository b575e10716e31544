-- The latest status of each task, from fenceline.status (the scheduler is the
-- authority): the executor purges a task's executions, checkpoints and call
-- sequences only once this says the task is final and has been for the retention
-- (docs/decisions.md, entry 13). The highest version wins.
CREATE TABLE task_states (
    task_id uuid PRIMARY KEY,
    state text NOT NULL,
    version bigint NOT NULL,
    -- The scheduler's time of the change, in microseconds.
    updated_at_us bigint NOT NULL
);
CREATE INDEX task_states_finished ON task_states (updated_at_us)
    WHERE state IN ('succeeded', 'failed', 'cancelled');
CREATE INDEX executions_by_task ON executions (task_id);
