-- Each provider's adaptive concurrency limit (docs/execution.md, "Adaptive
-- concurrency"), shared by every scheduler instance: the consumer moves it as
-- attempt outcomes arrive (row lock), the dispatcher reads it when it counts slots.
-- No row: the provider is at its configured concurrency.
CREATE TABLE provider_limits (
    provider text PRIMARY KEY,
    -- fenceline_domain::limits::AdaptiveLimit as JSON.
    state jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
