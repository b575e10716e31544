-- Intake projects `fenceline.status`, `fenceline.attempts` and `fenceline.recovery`
-- with one consumer group, `intake.projections`, where three groups did
-- (`intake.status`, `intake.attempts`, `intake.cases`; docs/decisions.md, entry 58).
-- The new group starts where the three had got to, and remembers the event ids
-- they remembered, so that nothing is applied twice that the old groups applied
-- once. A group's name carries the deployment's topic prefix: the new name keeps it.
--
-- During a rolling upgrade the previous release's instances go on with the old
-- groups after this copy was taken: the new group applies their later events a
-- second time, in each partition's order. A snapshot or a report applied twice
-- changes nothing (docs/bus.md, item 12); an attempt's end and a recovery decision
-- are written again in the order they were first written, so the projection ends
-- as it was. The old groups' rows are left for those instances; docs/deploy.md,
-- "Rolling upgrades", says how to remove them once none runs.

INSERT INTO consumer_partitions (consumer_group, topic, partition, epoch, next_offset, owner)
SELECT substr(c.consumer_group, 1, length(c.consumer_group) - length(r.old)) || 'intake.projections',
       c.topic, c.partition, c.epoch, c.next_offset, c.owner
FROM consumer_partitions c
JOIN (VALUES ('intake.status'), ('intake.attempts'), ('intake.cases')) AS r (old)
  ON substr(c.consumer_group, length(c.consumer_group) - length(r.old) + 1) = r.old
ON CONFLICT DO NOTHING;

INSERT INTO processed_events (consumer_group, event_id, processed_at)
SELECT substr(p.consumer_group, 1, length(p.consumer_group) - length(r.old)) || 'intake.projections',
       p.event_id, p.processed_at
FROM processed_events p
JOIN (VALUES ('intake.status'), ('intake.attempts'), ('intake.cases')) AS r (old)
  ON substr(p.consumer_group, length(p.consumer_group) - length(r.old) + 1) = r.old
ON CONFLICT DO NOTHING;
