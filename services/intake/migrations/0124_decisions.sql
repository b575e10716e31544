-- What a person deciding an approval needs to see, and the record of what they
-- decided.

-- Intake's projection of the executor's StepCheckpointed: what each finished step
-- produced, per generation, for GET /v1/tasks/{id} and the cards of approvals.
-- `output` is null when the executor did not send it (too large to travel, or an
-- executor from before outputs travelled); `output_ref` then still says where it is.
CREATE TABLE task_steps (
    task_id uuid NOT NULL,
    generation integer NOT NULL,
    step text NOT NULL,
    output jsonb,
    output_ref text NOT NULL,
    sha256 text NOT NULL,
    checkpointed_at timestamptz NOT NULL,
    PRIMARY KEY (task_id, generation, step)
);

-- A person's decision about one wait of an approval step (its step and
-- generation): approve or reject, who decided (the name they gave and the token
-- they used), their note, and what they decided on: the digest of the card they
-- read, if they named one, and the outputs the approval rested on as intake held
-- them at that instant. One decision per wait.
CREATE TABLE decisions (
    task_id uuid NOT NULL REFERENCES tasks (task_id),
    step text NOT NULL,
    generation integer NOT NULL,
    signal_name text NOT NULL,
    decision text NOT NULL,
    decided_by text NOT NULL,
    token_identity text NOT NULL,
    note text,
    digest text,
    rests_on jsonb NOT NULL,
    decided_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, step, generation)
);
