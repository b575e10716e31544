-- Intake's projection of fenceline.attempts (and of the recovery decisions about
-- them): every attempt a worker took up and how it ended, for GET /v1/tasks/{id}.
-- Rows may be created by either topic first; each writes only its own columns.
CREATE TABLE task_attempts (
    task_id uuid NOT NULL,
    attempt integer NOT NULL,
    outcome text NOT NULL,
    error_class text,
    detail text,
    money_may_have_been_spent boolean,
    recovery text,
    started_at timestamptz,
    ended_at timestamptz,
    PRIMARY KEY (task_id, attempt)
);
