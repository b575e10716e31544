-- What each tenant's paid calls cost per UTC day, as the executor's checkpoints
-- priced them: the figure a tenant's daily budget is held against.
CREATE TABLE tenant_spend (
    tenant      text   NOT NULL,
    day         date   NOT NULL,
    cost_micros bigint NOT NULL,
    PRIMARY KEY (tenant, day)
);
