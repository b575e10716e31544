-- The dispatcher's heads (docs/performance.md, "The dispatcher's heads"): each
-- tenant's next due tasks are read per tenant and provider, a few entries each,
-- instead of ranking every due task on every round. A provider at its limit with
-- a large queue of due tasks then costs a round nothing, and a provider it
-- excludes is skipped by the index rather than filtered row by row. The new index
-- replaces `tasks_due`, which only the previous release's ranking used (it reads
-- the same rows without it, by another plan).
CREATE INDEX tasks_due_by_provider ON tasks (tenant, (coalesce(provider, '')), priority, due_at_us)
    WHERE due_at_us IS NOT NULL;
DROP INDEX tasks_due;
