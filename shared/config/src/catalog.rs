//! The provider and task-kind catalogue: one JSON file (`FENCELINE_CATALOG`) that
//! the scheduler (slots, rates, lease budgets), the executor (steps, calls) and the
//! reconciler (look-ups, capabilities) read alike. Providers are configured, not
//! coded (docs/architecture.md, "Providers and the catalogue").

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use fenceline_domain::calls::{ErrorTable, ProviderCapabilities};
use fenceline_domain::limits::AdaptivePolicy;
use fenceline_domain::spend::{Amount, Budget};
use fenceline_domain::standing::SendAgain;
use fenceline_domain::vocabulary::ErrorClass;
use serde::Deserialize;

use crate::Error;
use crate::dialect::DialectSpec;

mod checks;

/// Everything the catalogue file declares.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Catalog {
    pub providers: BTreeMap<String, ProviderSpec>,
    pub kinds: BTreeMap<String, KindSpec>,
    /// Daily budgets for paid calls, by tenant; a tenant not named has none.
    #[serde(default)]
    pub budgets: BTreeMap<String, Budget>,
}

/// How to reach one provider and what it can do.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderSpec {
    /// Base URL of the provider protocol (docs/provider-protocol.md).
    pub base_url: String,
    /// Name of an environment variable holding the `Authorization` header value;
    /// the secret itself never sits in the catalogue.
    #[serde(default)]
    pub auth_header_env: Option<String>,
    #[serde(default)]
    pub capabilities: Capabilities,
    /// One HTTP call, send to last byte of the answer.
    pub call_timeout_ms: u64,
    /// Calls in flight at once, across every executor.
    pub concurrency: u32,
    /// Calls started per second across every executor, and the burst above it.
    pub rate_per_second: f64,
    pub burst: f64,
    /// Status codes this provider uses its own way, mapped to an error class.
    #[serde(default)]
    pub status_overrides: HashMap<u16, ErrorClass>,
    /// 5xx statuses this provider answers, with its problem body, only when it did
    /// no work (default: none, so every 5xx may have done the work and is
    /// ambiguous). 502 and 504 are a gateway's and can never be declared safe.
    #[serde(default)]
    pub safe_5xx: BTreeSet<u16>,
    /// How long after a request reaches this provider a look-up by its key is sure
    /// to find it, in milliseconds (default 2,000). A look-up's "never received" is
    /// trusted only once a lost worker's request can no longer arrive and register:
    /// the call timeout plus this, after the loss was reported (docs/execution.md).
    #[serde(default = "default_registration_ms")]
    pub registration_ms: u64,
    /// How the scheduler adapts this provider's concurrency to its health
    /// (docs/execution.md, "Adaptive concurrency"); on by default.
    #[serde(default)]
    pub adaptive_concurrency: AdaptiveConcurrency,
    /// How `https://` connections to this provider, and to the hosts its artifacts
    /// are fetched from, are checked and authenticated (default: the system's roots,
    /// no client certificate).
    #[serde(default)]
    pub tls: ProviderTls,
    /// How to call a provider that speaks its own HTTP API instead of Fenceline's
    /// protocol (docs/catalog.md, "Dialects"); absent: the protocol.
    #[serde(default)]
    pub dialect: Option<DialectSpec>,
    /// What one call to this provider costs, in the currency's minor unit (cents,
    /// to six decimals); a step's own `price_per_call_minor` overrides it.
    #[serde(default)]
    pub price_per_call_minor: Option<Amount>,
    /// Prices per unit of what an answer reports it used, by the names the
    /// dialect's `answer.usage` reads (`{"prompt_tokens": 0.00025}`: $2.50 a
    /// million), added to each call's cost.
    #[serde(default)]
    pub usage_prices: BTreeMap<String, Amount>,
}

/// TLS settings of one provider. Paths are read when a service starts; relative
/// paths are taken from the working directory.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderTls {
    /// PEM file of the CA certificates the provider's certificate must chain to,
    /// instead of the system's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM file of the client certificate (and its chain) for mutual TLS.
    #[serde(default)]
    pub client_certificate_file: Option<PathBuf>,
    /// PEM file of that certificate's private key (PKCS#8, PKCS#1 or SEC1).
    #[serde(default)]
    pub client_key_file: Option<PathBuf>,
}

fn default_registration_ms() -> u64 {
    2_000
}

/// A provider's adaptive concurrency limit: multiplied by `decrease_factor` on
/// timeouts, 5xx, 429 and refused connections (at most once per
/// `decrease_interval_ms`), `increase` added back over each window of successes,
/// between 1 and `concurrency`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveConcurrency {
    /// `false`: the provider always gets its whole `concurrency` (default `true`).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// The limit is multiplied by this on trouble (default 0.5; above 0, below 1).
    #[serde(default = "default_decrease_factor")]
    pub decrease_factor: f64,
    /// At most one decrease per this many milliseconds (default 1,000): the
    /// failures of calls in flight together are one signal.
    #[serde(default = "default_decrease_interval_ms")]
    pub decrease_interval_ms: u64,
    /// Slots added over each window of `limit` successes (default 1).
    #[serde(default = "default_increase")]
    pub increase: f64,
}

impl Default for AdaptiveConcurrency {
    fn default() -> Self {
        AdaptiveConcurrency {
            enabled: true,
            decrease_factor: default_decrease_factor(),
            decrease_interval_ms: default_decrease_interval_ms(),
            increase: default_increase(),
        }
    }
}

fn default_true() -> bool {
    true
}

fn default_decrease_factor() -> f64 {
    0.5
}

fn default_decrease_interval_ms() -> u64 {
    1_000
}

fn default_increase() -> f64 {
    1.0
}

/// What a provider declares it can do.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capabilities {
    #[serde(default)]
    pub idempotency_keys: bool,
    #[serde(default)]
    pub lookup: bool,
    /// Accepted so existing catalogues keep loading, and ignored: the executor
    /// polls any provider that answers `202`, whether or not it declared this.
    #[serde(default, rename = "async_results")]
    _async_results: bool,
}

/// One task kind: its steps in order and its limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KindSpec {
    pub steps: Vec<StepSpec>,
    /// Attempts that may fail (not counting busy or throttled) before a person is asked.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// How long one attempt may run in all; the executor's lease budget.
    pub attempt_budget_ms: u64,
    /// Concurrent attempts per tenant of this kind (0: no limit of its own).
    #[serde(default)]
    pub tenant_concurrency: u32,
}

fn default_max_attempts() -> u32 {
    5
}

/// A step: either a paid call at a provider, or a wait for a named signal.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepSpec {
    pub name: String,
    #[serde(default)]
    pub provider: Option<String>,
    #[serde(default)]
    pub operation: Option<String>,
    /// For an approval step: the signal that lets the task continue.
    #[serde(default)]
    pub approval_signal: Option<String>,
    /// What one call of this step costs, in the currency's minor unit; default its provider's.
    #[serde(default)]
    pub price_per_call_minor: Option<Amount>,
    /// A standing decision for a call whose outcome nobody can establish; absent:
    /// a person decides (docs/catalog.md, "A standing decision for cheap steps").
    #[serde(default)]
    pub on_unknown: Option<OnUnknownSpec>,
}

/// A step's `on_unknown`: what to do, decided in advance, when a call's outcome
/// cannot be established.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OnUnknownSpec {
    /// Send a new operation, as a person's `retry_as_new` does, within these limits.
    pub send_again: SendAgainSpec,
}

/// The limits of `on_unknown.send_again`, per task; both at least 1.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendAgainSpec {
    /// Extra charges (new operations) the policy may make per task.
    pub max_extra_charges: i64,
    /// What those extra charges may cost in all per task, in the currency's minor unit.
    pub max_extra_cost_minor: Amount,
}

impl StepSpec {
    /// The provider and operation of a call step; `None` for an approval.
    pub fn call(&self) -> Option<(&str, &str)> {
        Some((self.provider.as_deref()?, self.operation.as_deref().unwrap_or(&self.name)))
    }
}

impl ProviderSpec {
    pub fn capabilities(&self) -> ProviderCapabilities {
        ProviderCapabilities { idempotency_keys: self.capabilities.idempotency_keys, lookup: self.capabilities.lookup }
    }

    pub fn call_timeout(&self) -> Duration {
        Duration::from_millis(self.call_timeout_ms)
    }

    /// The adaptive limit's arithmetic for this provider; `None` when it is off.
    pub fn adaptive_policy(&self) -> Option<AdaptivePolicy> {
        let adaptive = &self.adaptive_concurrency;
        adaptive.enabled.then(|| AdaptivePolicy {
            ceiling: self.concurrency,
            decrease_factor: adaptive.decrease_factor,
            decrease_interval: i64::try_from(adaptive.decrease_interval_ms.saturating_mul(1_000)).unwrap_or(i64::MAX),
            increase: adaptive.increase,
        })
    }

    /// How long this provider remembers an operation key, if its dialect says.
    pub fn key_memory(&self) -> Option<Duration> {
        self.dialect.as_ref().and_then(DialectSpec::key_memory)
    }

    /// After a worker was reported lost, how long a request it sent may still reach
    /// this provider and register: the call timeout plus the registration time.
    pub fn in_flight_window(&self) -> Duration {
        self.call_timeout() + Duration::from_millis(self.registration_ms)
    }

    /// The status-code overrides, typed: a dialect's throttled, rejected and not
    /// authorised statuses, then the entry's own `status_overrides` over them.
    pub fn overrides(&self) -> HashMap<u16, ErrorClass> {
        let mut overrides = HashMap::new();
        if let Some(dialect) = &self.dialect {
            let statuses = &dialect.answer.statuses;
            for (list, class) in [
                (&statuses.throttled, ErrorClass::Throttled),
                (&statuses.rejected, ErrorClass::Rejected),
                (&statuses.not_authorised, ErrorClass::NotAuthorised),
            ] {
                overrides.extend(list.iter().map(|status| (*status, class)));
            }
        }
        overrides.extend(self.status_overrides.iter().map(|(code, class)| (*code, *class)));
        overrides
    }

    /// How this provider's answers are read (docs/provider-protocol.md).
    pub fn error_table(&self) -> ErrorTable {
        ErrorTable {
            overrides: self.overrides(),
            safe_5xx: self.safe_5xx.clone(),
            dedupes: self.capabilities.idempotency_keys,
            keyed: self.capabilities.idempotency_keys || self.capabilities.lookup,
        }
    }
}

impl KindSpec {
    pub fn attempt_budget(&self) -> Duration {
        Duration::from_millis(self.attempt_budget_ms)
    }

    /// The provider whose slot an attempt of this kind takes: its first call step's.
    pub fn slot_provider(&self) -> Option<&str> {
        self.slot_provider_after(None)
    }

    /// The provider whose slot an attempt that resumes after step `after` takes: the
    /// first call step it will make. An attempt after an approval that only refunds
    /// takes a slot of the payment provider, not of the one that drafted.
    pub fn slot_provider_after(&self, after: Option<&str>) -> Option<&str> {
        self.steps[self.step_index_after(after).min(self.steps.len())..]
            .iter()
            .find_map(|s| s.call().map(|(provider, _)| provider))
            .or_else(|| self.steps.iter().find_map(|s| s.call().map(|(provider, _)| provider)))
    }

    /// Every provider an attempt that resumes after step `after` calls before the
    /// next approval (where it hands its grant back), in the order it first calls
    /// each, with how many calls it makes there. The attempt holds a slot of each
    /// and takes a token of each one's rate per call. The first is the
    /// [`slot_provider_after`](Self::slot_provider_after); an attempt that calls
    /// nothing before the approval holds that provider's slot, with no call.
    pub fn calls_after(&self, after: Option<&str>) -> Vec<(&str, u32)> {
        let ahead = &self.steps[self.step_index_after(after).min(self.steps.len())..];
        let mut calls: Vec<(&str, u32)> = Vec::new();
        for (provider, _) in ahead.iter().take_while(|s| s.approval_signal.is_none()).filter_map(StepSpec::call) {
            match calls.iter_mut().find(|(seen, _)| *seen == provider) {
                Some((_, count)) => *count += 1,
                None => calls.push((provider, 1)),
            }
        }
        if calls.is_empty() {
            calls.extend(self.slot_provider_after(after).map(|provider| (provider, 0)));
        }
        calls
    }

    /// Where the step named `name` is among the kind's steps, if it is one of them.
    pub fn step_index(&self, name: &str) -> Option<usize> {
        self.steps.iter().position(|s| s.name == name)
    }

    /// The step that follows `after` (the first step when `None`).
    pub fn step_index_after(&self, after: Option<&str>) -> usize {
        after.and_then(|name| self.step_index(name)).map_or(0, |i| i + 1)
    }
}

impl Catalog {
    /// Reads and checks the catalogue file.
    pub fn load(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| Error(format!("reading {}: {e}", path.display())))?;
        Self::parse(&text).map_err(|e| Error(format!("{}: {}", path.display(), e.0)))
    }

    /// Parses a catalogue and checks it against the rules of [`checks::check`].
    pub fn parse(text: &str) -> Result<Self, Error> {
        let catalog: Catalog = serde_json::from_str(text)
            .map_err(|e| Error(provider_refused(text).unwrap_or_else(|| format!("catalogue: {e}"))))?;
        checks::check(&catalog)?;
        Ok(catalog)
    }

    /// For every step of every kind that calls `provider`, the names of the steps
    /// that run before it: what that call's templates may read under `steps`.
    pub fn steps_before_calls_to(&self, provider: &str) -> Vec<BTreeSet<&str>> {
        let mut sets = Vec::new();
        for kind in self.kinds.values() {
            for (index, step) in kind.steps.iter().enumerate() {
                if step.call().is_some_and(|(p, _)| p == provider) {
                    sets.push(kind.steps[..index].iter().map(|s| s.name.as_str()).collect());
                }
            }
        }
        sets
    }

    /// The standing decisions of a kind's steps, by step name, each with the price
    /// of one call (checked at load: only call steps, positive limits, a price).
    pub fn send_again(&self, kind: &str) -> Vec<(String, SendAgain)> {
        let Some(spec) = self.kind(kind) else { return Vec::new() };
        spec.steps
            .iter()
            .filter_map(|step| {
                let limits = step.on_unknown.as_ref()?.send_again;
                let price = self.price_per_call_minor(step)?;
                Some((
                    step.name.clone(),
                    SendAgain {
                        max_extra_charges: u32::try_from(limits.max_extra_charges).ok()?,
                        max_extra_cost: limits.max_extra_cost_minor,
                        price_per_call: price,
                    },
                ))
            })
            .collect()
    }

    /// What one call of `step` costs: its own price, else its provider's.
    pub fn price_per_call_minor(&self, step: &StepSpec) -> Option<Amount> {
        step.price_per_call_minor.or_else(|| self.provider(step.call()?.0)?.price_per_call_minor)
    }

    /// The daily budget of `tenant`'s paid calls, if it has one.
    pub fn budget_of(&self, tenant: &str) -> Option<&Budget> {
        self.budgets.get(tenant)
    }

    pub fn kind(&self, kind: &str) -> Option<&KindSpec> {
        self.kinds.get(kind)
    }

    pub fn provider(&self, provider: &str) -> Option<&ProviderSpec> {
        self.providers.get(provider)
    }
}

/// Which provider entry of a catalogue that does not parse is wrong, and why: a
/// whole catalogue's parse error names only a line and a column.
fn provider_refused(text: &str) -> Option<String> {
    let whole: serde_json::Value = serde_json::from_str(text).ok()?;
    whole.get("providers")?.as_object()?.iter().find_map(|(name, entry)| {
        let refused = serde_json::from_value::<ProviderSpec>(entry.clone()).err()?;
        Some(format!("catalogue: provider `{name}`: {refused}"))
    })
}

/// Where the catalogue file is.
#[derive(Debug, Clone, clap::Args)]
pub struct CatalogConfig {
    /// The provider and task-kind catalogue, a JSON file (docs/catalog.md).
    #[arg(long = "catalog", env = "FENCELINE_CATALOG")]
    pub catalog: std::path::PathBuf,
}

impl CatalogConfig {
    pub fn load(&self) -> Result<Catalog, Error> {
        Catalog::load(&self.catalog)
    }
}

/// Where the catalogue file is, for a service that also runs without one (intake,
/// which then cannot tell which signals a task's kind waits for).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct OptionalCatalogConfig {
    /// The provider and task-kind catalogue, a JSON file (docs/catalog.md).
    #[arg(long = "catalog", env = "FENCELINE_CATALOG")]
    pub catalog: Option<std::path::PathBuf>,
}

impl OptionalCatalogConfig {
    /// The catalogue, read and checked as every service reads it; `None` when none is configured.
    pub fn load(&self) -> Result<Option<Catalog>, Error> {
        self.catalog.as_deref().map(Catalog::load).transpose()
    }
}

#[cfg(test)]
mod tests;
