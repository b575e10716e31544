-- The executor consumes `fenceline.dispatch` and `fenceline.status` with one
-- consumer group, `executor.from_scheduler`, where two groups did
-- (`executor.grants`, `executor.status`; docs/decisions.md, entry 59). The new
-- group starts where the two had got to, and remembers the event ids they
-- remembered (cancellations), so that nothing is applied twice that the old
-- groups applied once. A group's name carries the deployment's topic prefix: the
-- new name keeps it.
--
-- During a rolling upgrade the previous release's instances go on with the old
-- groups after this copy was taken, and the new group applies their later events
-- a second time: a grant's execution is keyed by its grant id and inserts nothing
-- again, a cancellation only turns a flag on, and a final state writes only when
-- newer (docs/bus.md, item 12). The old groups' rows are left for those
-- instances; docs/deploy.md, "Rolling upgrades", says how to remove them once
-- none runs.

INSERT INTO consumer_partitions (consumer_group, topic, partition, epoch, next_offset, owner)
SELECT substr(c.consumer_group, 1, length(c.consumer_group) - length(r.old)) || 'executor.from_scheduler',
       c.topic, c.partition, c.epoch, c.next_offset, c.owner
FROM consumer_partitions c
JOIN (VALUES ('executor.grants'), ('executor.status')) AS r (old)
  ON substr(c.consumer_group, length(c.consumer_group) - length(r.old) + 1) = r.old
ON CONFLICT DO NOTHING;

INSERT INTO processed_events (consumer_group, event_id, processed_at)
SELECT substr(p.consumer_group, 1, length(p.consumer_group) - length(r.old)) || 'executor.from_scheduler',
       p.event_id, p.processed_at
FROM processed_events p
JOIN (VALUES ('executor.grants'), ('executor.status')) AS r (old)
  ON substr(p.consumer_group, length(p.consumer_group) - length(r.old) + 1) = r.old
ON CONFLICT DO NOTHING;
