//! The provider and task-kind catalogue: one JSON file (`FENCELINE_CATALOG`) that
//! the scheduler (slots, rates, lease budgets), the executor (steps, calls) and the
//! reconciler (look-ups, capabilities) read alike. Providers are configured, not
//! coded (docs/architecture.md, "Providers and the catalogue").

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use fenceline_domain::calls::{ErrorTable, GATEWAY_STATUSES, ProviderCapabilities};
use fenceline_domain::limits::AdaptivePolicy;
use fenceline_domain::spend::{Amount, Budget};
use fenceline_domain::standing::SendAgain;
use fenceline_domain::vocabulary::ErrorClass;
use serde::Deserialize;

use crate::dialect::DialectSpec;
use crate::{Error, require_nested};

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

    /// The step that follows `after` (the first step when `None`).
    pub fn step_index_after(&self, after: Option<&str>) -> usize {
        after.and_then(|name| self.steps.iter().position(|s| s.name == name)).map_or(0, |i| i + 1)
    }
}

impl Catalog {
    /// Reads and checks the catalogue file.
    pub fn load(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| Error(format!("reading {}: {e}", path.display())))?;
        Self::parse(&text).map_err(|e| Error(format!("{}: {}", path.display(), e.0)))
    }

    /// Parses and checks a catalogue: every step names a known provider or a
    /// signal, status overrides are known classes, a 5xx is declared safe only if
    /// a gateway cannot answer it, an override turns no undeclared 5xx into
    /// "nothing done", and timeouts nest (one call is shorter than the attempt
    /// that makes it).
    pub fn parse(text: &str) -> Result<Self, Error> {
        let catalog: Catalog = serde_json::from_str(text)
            .map_err(|e| Error(provider_refused(text).unwrap_or_else(|| format!("catalogue: {e}"))))?;
        for (name, provider) in &catalog.providers {
            for status in &provider.safe_5xx {
                if !(500..=599).contains(status) || GATEWAY_STATUSES.contains(status) {
                    return Err(Error(format!(
                        "provider `{name}`: safe_5xx may name 5xx statuses other than 502 and 504 (a gateway's \
                         answers after it forwarded the request), not {status}"
                    )));
                }
            }
            for (status, class) in &provider.overrides() {
                let class = *class;
                // An undeclared 5xx may have done the work: an override must not hide that.
                if (500..=599).contains(status) && class != ErrorClass::Ambiguous && !provider.safe_5xx.contains(status)
                {
                    return Err(Error(format!(
                        "provider `{name}`: status_overrides (or dialect.answer.statuses) maps {status} to `{class}`, \
                         but {status} may have done the work unless it is listed in safe_5xx"
                    )));
                }
            }
            let adaptive = &provider.adaptive_concurrency;
            let factor_decreases = adaptive.decrease_factor > 0.0 && adaptive.decrease_factor < 1.0;
            if !(factor_decreases && adaptive.increase > 0.0) {
                return Err(Error(format!(
                    "provider `{name}`: adaptive_concurrency needs a decrease_factor above 0 and below 1 and a \
                     positive increase"
                )));
            }
            if provider.tls.client_certificate_file.is_some() != provider.tls.client_key_file.is_some() {
                return Err(Error(format!(
                    "provider `{name}`: tls.client_certificate_file and tls.client_key_file go together"
                )));
            }
            let reads = provider.dialect.as_ref().map(|d| &d.answer.usage);
            for priced in provider.usage_prices.keys() {
                if !reads.is_some_and(|reads| reads.contains_key(priced)) {
                    return Err(Error(format!(
                        "provider `{name}`: usage_prices: `{priced}` is no count its answers carry (the dialect's \
                         answer.usage names {})",
                        reads.map_or("none".to_owned(), |r| r.keys().cloned().collect::<Vec<_>>().join(", "))
                    )));
                }
            }
            if provider.concurrency == 0 || provider.rate_per_second <= 0.0 || provider.burst < 1.0 {
                return Err(Error(format!(
                    "provider `{name}`: concurrency, rate_per_second and burst must be positive"
                )));
            }
        }
        for (kind, spec) in &catalog.kinds {
            if spec.steps.is_empty() {
                return Err(Error(format!("kind `{kind}` has no steps")));
            }
            if spec.max_attempts == 0 {
                return Err(Error(format!("kind `{kind}`: max_attempts must be at least 1")));
            }
            // A step's name is what its checkpoint, its call's key and a resumed
            // attempt's place are kept under.
            let mut named = BTreeSet::new();
            if let Some(twice) = spec.steps.iter().find(|step| !named.insert(step.name.as_str())) {
                return Err(Error(format!(
                    "kind `{kind}` names two steps `{}`; each step needs a name of its own",
                    twice.name
                )));
            }
            for step in &spec.steps {
                match (step.call(), &step.approval_signal) {
                    (Some((provider, _)), None) => {
                        let Some(p) = catalog.providers.get(provider) else {
                            return Err(Error(format!("kind `{kind}` step `{}`: no provider `{provider}`", step.name)));
                        };
                        require_nested(
                            &format!("provider `{provider}` call timeout"),
                            p.call_timeout(),
                            &format!("kind `{kind}` attempt budget"),
                            spec.attempt_budget(),
                        )?;
                    }
                    (None, Some(_)) => {}
                    _ => {
                        return Err(Error(format!(
                            "kind `{kind}` step `{}` needs exactly one of `provider` or `approval_signal`",
                            step.name
                        )));
                    }
                }
            }
            for step in &spec.steps {
                check_standing_decision(&catalog, kind, step)?;
            }
            if spec.slot_provider().is_none() {
                return Err(Error(format!("kind `{kind}` makes no provider call")));
            }
        }
        for (name, provider) in &catalog.providers {
            if let Some(dialect) = &provider.dialect {
                if provider.auth_header_env.is_some()
                    && let Some(header) =
                        dialect.request.headers.keys().find(|h| h.eq_ignore_ascii_case(&dialect.auth_header))
                {
                    return Err(Error(format!(
                        "provider `{name}`: dialect.request.headers.{header}: the credential comes from \
                         auth_header_env; a template would send a second {header} header"
                    )));
                }
                let caps = &provider.capabilities;
                let earlier = catalog.steps_before_calls_to(name);
                crate::dialect::check(name, dialect, caps.idempotency_keys, caps.lookup, &earlier)?;
            }
        }
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

/// Refuses a standing decision that could not work as written: on an approval, a
/// limit below 1 or beyond range, no price to count the amount by, or an amount
/// below one call's price (it could never send).
fn check_standing_decision(catalog: &Catalog, kind: &str, step: &StepSpec) -> Result<(), Error> {
    let at = |field: &str, why: String| Error(format!("kind `{kind}` step `{}`: {field}: {why}", step.name));
    if step.price_per_call_minor.is_some() && step.call().is_none() {
        return Err(at("price_per_call_minor", "an approval step makes no call to price".into()));
    }
    let Some(on_unknown) = &step.on_unknown else { return Ok(()) };
    let Some((provider, _)) = step.call() else {
        return Err(at("on_unknown", "an approval step makes no call whose outcome could be unknown".into()));
    };
    let limits = on_unknown.send_again;
    if !(1..=i64::from(u32::MAX)).contains(&limits.max_extra_charges) {
        return Err(at(
            "on_unknown.send_again.max_extra_charges",
            format!("must be at least 1, not {}", limits.max_extra_charges),
        ));
    }
    if limits.max_extra_cost_minor == Amount::ZERO {
        return Err(at("on_unknown.send_again.max_extra_cost_minor", "must be more than 0".into()));
    }
    let Some(price) = catalog.price_per_call_minor(step) else {
        return Err(at(
            "on_unknown.send_again",
            format!(
                "needs a price_per_call_minor on the step or on provider `{provider}` to hold max_extra_cost_minor"
            ),
        ));
    };
    if price > limits.max_extra_cost_minor {
        return Err(at(
            "on_unknown.send_again.max_extra_cost_minor",
            format!(
                "{} is less than one call's price ({price}): it could never send again",
                limits.max_extra_cost_minor
            ),
        ));
    }
    Ok(())
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
mod tests {
    use super::*;

    const GOOD: &str = r#"{
        "providers": {"img": {"base_url": "http://x", "call_timeout_ms": 1000, "concurrency": 2,
                              "rate_per_second": 5, "burst": 5, "status_overrides": {"409": "ambiguous"}}},
        "kinds": {"image.generate": {"steps": [{"name": "render", "provider": "img"}], "attempt_budget_ms": 5000},
                  "ticket.triage": {"steps": [{"name": "approve", "approval_signal": "ok"},
                                              {"name": "refund", "provider": "img", "operation": "pay"}],
                                    "attempt_budget_ms": 5000}}
    }"#;

    #[test]
    fn a_good_catalogue_parses_with_its_defaults() {
        let catalog = Catalog::parse(GOOD).expect("valid");
        let kind = catalog.kind("ticket.triage").expect("kind");
        assert_eq!(kind.max_attempts, 5);
        assert_eq!(kind.slot_provider(), Some("img"));
        assert_eq!(kind.steps[1].call(), Some(("img", "pay")));
        assert_eq!(kind.step_index_after(None), 0);
        assert_eq!(kind.step_index_after(Some("approve")), 1);
        assert_eq!(kind.calls_after(None), vec![("img", 0)], "the first attempt stops at the approval");
        assert_eq!(kind.calls_after(Some("approve")), vec![("img", 1)]);
        let img = catalog.provider("img").expect("img");
        assert_eq!(img.overrides().get(&409), Some(&ErrorClass::Ambiguous));
        assert!(img.error_table().safe_5xx.is_empty(), "no 5xx is safe unless declared");
        let adaptive = img.adaptive_policy().expect("adaptive by default");
        assert_eq!((adaptive.ceiling, adaptive.decrease_factor, adaptive.decrease_interval), (2, 0.5, 1_000_000));
    }

    #[test]
    fn adaptive_concurrency_is_configured_per_provider_and_checked() {
        let off = GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"adaptive_concurrency\": {\"enabled\": false},");
        assert!(Catalog::parse(&off).expect("valid").provider("img").expect("img").adaptive_policy().is_none());
        let tuned = GOOD.replace(
            "\"burst\": 5,",
            "\"burst\": 5, \"adaptive_concurrency\": {\"decrease_factor\": 0.7, \"decrease_interval_ms\": 250},",
        );
        let policy = Catalog::parse(&tuned).expect("valid").provider("img").expect("img").adaptive_policy();
        assert_eq!(policy.map(|p| (p.decrease_factor, p.decrease_interval)), Some((0.7, 250_000)));
        let wrong =
            GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"adaptive_concurrency\": {\"decrease_factor\": 1.5},");
        let error = Catalog::parse(&wrong).expect_err("a factor above 1 grows on trouble");
        assert!(error.0.contains("decrease_factor"), "{}", error.0);
    }

    #[test]
    fn a_provider_may_declare_its_own_5xx_safe_and_then_override_it() {
        let text = GOOD.replace("\"409\": \"ambiguous\"", "\"503\": \"throttled\"").replace(
            "\"burst\": 5,",
            "\"burst\": 5, \"safe_5xx\": [500, 503], \"capabilities\": {\"idempotency_keys\": true},",
        );
        let catalog = Catalog::parse(&text).expect("valid");
        let table = catalog.provider("img").expect("img").error_table();
        assert_eq!(table.safe_5xx, BTreeSet::from([500, 503]));
        assert_eq!(table.overrides.get(&503), Some(&ErrorClass::Throttled));
        assert!(table.dedupes);
    }

    #[test]
    fn bad_catalogues_are_refused_with_the_reason() {
        let cases = [
            (GOOD.replace("\"provider\": \"img\"}]", "\"provider\": \"nope\"}]"), "no provider `nope`"),
            (GOOD.replace("\"attempt_budget_ms\": 5000}}", "\"attempt_budget_ms\": 500}}"), "must be shorter"),
            (GOOD.replace("\"ambiguous\"", "\"maybe\""), "provider `img`: `maybe` is not a known error class"),
            (GOOD.replace("\"concurrency\": 2", "\"concurrency\": 0"), "must be positive"),
            (GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"colour\": 1,"), "unknown field"),
            (GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"safe_5xx\": [504],"), "not 504"),
            (GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"safe_5xx\": [429],"), "not 429"),
            (GOOD.replace("\"409\": \"ambiguous\"", "\"503\": \"throttled\""), "unless it is listed in safe_5xx"),
            (GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"tls\": {\"client_key_file\": \"/k.pem\"},"), "go together"),
            (GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"tls\": {\"ca\": \"/ca.pem\"},"), "unknown field"),
            (GOOD.replace("\"name\": \"approve\"", "\"name\": \"refund\""), "names two steps `refund`"),
        ];
        for (text, expected) in cases {
            let err = Catalog::parse(&text).expect_err(expected).to_string();
            assert!(err.contains(expected), "{err} should mention {expected}");
        }
    }

    fn with_standing_decision(step: serde_json::Value) -> String {
        standing_decision_catalogue(step).to_string()
    }

    fn standing_decision_catalogue(step: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "providers": {"llm": {"base_url": "http://x", "call_timeout_ms": 1000, "concurrency": 2,
                                  "rate_per_second": 5, "burst": 5, "price_per_call_minor": 10}},
            "kinds": {"ticket.triage": {"steps": [
                step,
                {"name": "approve", "approval_signal": "ok"},
                {"name": "draft", "provider": "llm"}
            ], "attempt_budget_ms": 5000}}
        })
    }

    #[test]
    fn a_step_may_carry_a_standing_decision_priced_by_its_provider_or_itself() {
        let policy = serde_json::json!({"send_again": {"max_extra_charges": 2, "max_extra_cost_minor": 20}});
        let text =
            with_standing_decision(serde_json::json!({"name": "classify", "provider": "llm", "on_unknown": policy}));
        let catalog = Catalog::parse(&text).expect("valid");
        let expected = SendAgain {
            max_extra_charges: 2,
            max_extra_cost: Amount::from_minor(20),
            price_per_call: Amount::from_minor(10),
        };
        assert_eq!(catalog.send_again("ticket.triage"), vec![("classify".to_owned(), expected)]);
        let own =
            serde_json::json!({"name": "classify", "provider": "llm", "price_per_call_minor": 4, "on_unknown": policy});
        let catalog = Catalog::parse(&with_standing_decision(own)).expect("valid");
        assert_eq!(catalog.send_again("ticket.triage")[0].1.price_per_call, Amount::from_minor(4));
        assert!(
            Catalog::parse(GOOD).expect("valid").send_again("ticket.triage").is_empty(),
            "absent: a person decides"
        );
    }

    #[test]
    fn a_standing_decision_that_cannot_work_is_refused_naming_kind_step_and_field() {
        let policy = |charges: i64, cost: i64| serde_json::json!({"send_again": {"max_extra_charges": charges, "max_extra_cost_minor": cost}});
        let cases = [
            (
                serde_json::json!({"name": "classify", "provider": "llm", "on_unknown": policy(0, 20)}),
                "kind `ticket.triage` step `classify`: on_unknown.send_again.max_extra_charges: must be at least 1, not 0",
            ),
            (
                serde_json::json!({"name": "classify", "provider": "llm", "on_unknown": policy(2, 0)}),
                "kind `ticket.triage` step `classify`: on_unknown.send_again.max_extra_cost_minor: must be more than 0",
            ),
            (
                serde_json::json!({"name": "classify", "provider": "llm", "on_unknown": policy(2, -5)}),
                "-5 is not an amount in the currency's minor unit",
            ),
            (
                serde_json::json!({"name": "classify", "approval_signal": "go", "on_unknown": policy(2, 20)}),
                "kind `ticket.triage` step `classify`: on_unknown: an approval step makes no call",
            ),
            (
                serde_json::json!({"name": "classify", "provider": "llm", "price_per_call_minor": -1}),
                "-1 is not an amount in the currency's minor unit",
            ),
            (
                serde_json::json!({"name": "classify", "provider": "llm", "price_per_call_minor": 30, "on_unknown": policy(2, 20)}),
                "step `classify`: on_unknown.send_again.max_extra_cost_minor: 20 is less than one call's price (30)",
            ),
            (
                serde_json::json!({"name": "classify", "provider": "llm", "on_unknown": {"send_again": {"max_extra_charges": 2}}}),
                "max_extra_cost_minor",
            ),
        ];
        for (step, expected) in cases {
            let err = Catalog::parse(&with_standing_decision(step)).expect_err(expected).to_string();
            assert!(err.contains(expected), "{err} should mention {expected}");
        }
        let mut unpriced = standing_decision_catalogue(
            serde_json::json!({"name": "classify", "provider": "llm", "on_unknown": policy(2, 20)}),
        );
        unpriced["providers"]["llm"].as_object_mut().map(|llm| llm.remove("price_per_call_minor"));
        let err = Catalog::parse(&unpriced.to_string()).expect_err("no price").to_string();
        assert!(err.contains("step `classify`: on_unknown.send_again: needs a price_per_call_minor"), "{err}");
    }

    #[test]
    fn prices_and_budgets_are_read_and_a_price_for_a_count_no_answer_carries_is_refused() {
        let mut catalog: serde_json::Value = serde_json::from_str(&with_dialect(
            serde_json::json!({"request": {"path": "/v1/chat/completions", "body": "{}"},
                               "answer": {"result": "/choices/0/message",
                                          "usage": {"prompt_tokens": "/usage/prompt_tokens"}}}),
            serde_json::json!({}),
        ))
        .expect("json");
        catalog["providers"]["llm"]["usage_prices"] = serde_json::json!({"prompt_tokens": 0.00025});
        catalog["providers"]["llm"]["price_per_call_minor"] = serde_json::json!(0.79);
        catalog["budgets"] = serde_json::json!({"acme": {"per_day_minor": 500}});
        let parsed = Catalog::parse(&catalog.to_string()).expect("valid");
        let llm = parsed.provider("llm").expect("llm");
        assert_eq!(llm.usage_prices["prompt_tokens"], Amount::from_micros(250));
        assert_eq!(llm.price_per_call_minor, Some(Amount::from_micros(790_000)));
        assert_eq!(parsed.budget_of("acme").map(|b| b.per_day_minor), Some(Amount::from_minor(500)));
        assert_eq!(parsed.budget_of("globex"), None);
        catalog["providers"]["llm"]["usage_prices"] = serde_json::json!({"output_tokens": 0.001});
        let err = Catalog::parse(&catalog.to_string()).expect_err("an unread count").to_string();
        assert!(
            err.contains("provider `llm`: usage_prices: `output_tokens` is no count its answers carry")
                && err.contains("names prompt_tokens"),
            "{err}"
        );
    }

    /// A catalogue with an OpenAI-compatible chat provider and a kind that drafts
    /// from a classification.
    fn with_dialect(dialect: serde_json::Value, capabilities: serde_json::Value) -> String {
        serde_json::json!({
            "providers": {
                "img": {"base_url": "http://x", "call_timeout_ms": 1000, "concurrency": 2,
                        "rate_per_second": 5, "burst": 5},
                "llm": {"base_url": "http://llm", "call_timeout_ms": 1000, "concurrency": 2,
                        "auth_header_env": "LLM_AUTHORIZATION",
                        "rate_per_second": 5, "burst": 5, "capabilities": capabilities, "dialect": dialect}
            },
            "kinds": {"ticket.triage": {"steps": [
                {"name": "classify", "provider": "img"},
                {"name": "draft", "provider": "llm"}
            ], "attempt_budget_ms": 5000}}
        })
        .to_string()
    }

    fn chat_dialect() -> serde_json::Value {
        serde_json::json!({
            "request": {
                "path": "/v1/chat/completions",
                "body": "{\"model\": {{ input.model | tojson }}, \"messages\": {{ input.messages | tojson }}, \"user\": {{ steps.classify.uri | tojson }}}"
            },
            "answer": {"request_id": "/id", "result": "/choices/0/message", "error_type": "/error/type",
                       "error_classes": {"insufficient_quota": "not_authorised"},
                       "statuses": {"throttled": [429]}},
            "throttling": {"reset_headers": ["x-ratelimit-reset-requests"]}
        })
    }

    #[test]
    fn a_dialect_is_optional_and_checked_at_load() {
        assert!(Catalog::parse(GOOD).expect("valid").provider("img").expect("img").dialect.is_none());
        let mut dialect = chat_dialect();
        dialect["answer"]["statuses"] = serde_json::json!({});
        let catalog = Catalog::parse(&with_dialect(dialect, serde_json::json!({}))).expect("valid");
        let llm = catalog.provider("llm").expect("llm");
        let spec = llm.dialect.as_ref().expect("a dialect");
        assert_eq!(spec.request.method, "POST");
        assert_eq!(spec.max_inline_result_bytes, 1024 * 1024);
        assert_eq!(spec.error_classes().get("insufficient_quota"), Some(&ErrorClass::NotAuthorised));
        let overrides = llm.overrides();
        assert_eq!(overrides.get(&429), Some(&ErrorClass::Throttled));
        assert_eq!(overrides.get(&422), Some(&ErrorClass::Rejected));
        assert_eq!(overrides.get(&402), Some(&ErrorClass::NotAuthorised));
        assert_eq!(catalog.steps_before_calls_to("llm"), vec![BTreeSet::from(["classify"])]);
    }

    #[test]
    fn a_dialect_that_does_not_check_out_is_refused_naming_provider_field_and_reason() {
        let edit = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut dialect = chat_dialect();
            f(&mut dialect);
            dialect
        };
        let none = serde_json::json!({});
        let cases = [
            (
                edit(&|d| d["request"]["path"] = "/v1/{{ input.model ".into()),
                none.clone(),
                "dialect.request.path: the template does not parse",
            ),
            (
                edit(&|d| d["request"]["headers"] = serde_json::json!({"X-Draft": "{{ steps.draft.content }}"})),
                none.clone(),
                "dialect.request.headers.X-Draft: the template reads `steps.draft`",
            ),
            (edit(&|d| d["request"]["body"] = "{{ steps.nope | tojson }}".into()), none.clone(), "reads `steps.nope`"),
            (
                edit(&|d| d["answer"]["result"] = "choices/0".into()),
                none.clone(),
                "dialect.answer.result: `choices/0` is not a JSON pointer",
            ),
            (
                edit(&|d| d["answer"]["request_id"] = "/a~2b".into()),
                none.clone(),
                "dialect.answer.request_id: `/a~2b` is not a JSON pointer",
            ),
            (
                chat_dialect(),
                serde_json::json!({"idempotency_keys": true}),
                "dialect.idempotency_header: the provider claims `idempotency_keys`",
            ),
            (
                edit(&|d| d["answer"]["error_classes"]["server_error"] = "fine".into()),
                none.clone(),
                "dialect.answer.error_classes.server_error",
            ),
            (edit(&|d| d["request"]["form"] = serde_json::json!({"a": "b"})), none.clone(), "not both"),
            (
                edit(&|d| d["answer"]["statuses"] = serde_json::json!({"throttled": [429, 400]})),
                none.clone(),
                "throttled: 400 is also listed under `rejected`",
            ),
            (edit(&|d| d["poll"] = serde_json::json!({})), none.clone(), "dialect.poll: needs `url`"),
            (
                edit(&|d| d["request"]["headers"] = serde_json::json!({"authorization": "Bearer {{ input.k }}"})),
                none.clone(),
                "the credential comes from auth_header_env",
            ),
            // A dialect's throttled 503 is an override like any other: only a declared-safe 5xx may have it.
            (
                edit(&|d| d["answer"]["statuses"]["throttled"] = serde_json::json!([429, 503])),
                none.clone(),
                "maps 503 to `throttled`",
            ),
        ];
        for (dialect, capabilities, expected) in cases {
            let text = with_dialect(dialect, capabilities);
            let err = Catalog::parse(&text).expect_err(expected).to_string();
            assert!(err.contains("provider `llm`") && err.contains(expected), "{err} should mention {expected}");
        }
    }

    #[test]
    fn json_pointers_follow_rfc_6901() {
        use crate::dialect::is_json_pointer;
        for good in ["", "/", "/choices/0/message", "/a~0b/c~1d", "/error/type"] {
            assert!(is_json_pointer(good), "{good}");
        }
        for bad in ["choices", "/a~", "/a~2", "#/a"] {
            assert!(!is_json_pointer(bad), "{bad}");
        }
    }
}
