-- Which sources may submit tasks for which tenant through fenceline.intake.requests.
-- A record naming a tenant its source is not configured for is refused
-- (`unknown-source`): a producer allowed on the topic cannot create another
-- tenant's billable tasks. A source may serve several tenants, one row each.
CREATE TABLE upstream_sources (
    source text NOT NULL,
    tenant text NOT NULL REFERENCES tenants (tenant),
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, tenant)
);

-- Pairs already in use keep working across the upgrade; review them after it
-- (`SELECT * FROM intake.upstream_sources`) and remove any that should not be.
INSERT INTO upstream_sources (source, tenant)
SELECT DISTINCT substr(t.source, length('topic:') + 1), t.tenant
FROM tasks t JOIN tenants USING (tenant)
WHERE t.source LIKE 'topic:%'
ON CONFLICT DO NOTHING;
