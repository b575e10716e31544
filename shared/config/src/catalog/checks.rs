//! The rules a catalogue must meet before any service uses it: each refusal names
//! the provider or the kind and step, the field and why.

use std::collections::BTreeSet;

use fenceline_domain::calls::GATEWAY_STATUSES;
use fenceline_domain::spend::Amount;
use fenceline_domain::vocabulary::ErrorClass;

use super::{Catalog, StepSpec};
use crate::{Error, require_nested};

/// Checks a parsed catalogue: every step names a known provider or a signal, step
/// names are unique within their kind, status overrides are known classes, a 5xx
/// is declared safe only if a gateway cannot answer it, an override turns no
/// undeclared 5xx into "nothing done", timeouts nest (one call is shorter than the
/// attempt that makes it), and standing decisions and dialects can work as written.
pub(super) fn check(catalog: &Catalog) -> Result<(), Error> {
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
            if (500..=599).contains(status) && class != ErrorClass::Ambiguous && !provider.safe_5xx.contains(status) {
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
            return Err(Error(format!("provider `{name}`: concurrency, rate_per_second and burst must be positive")));
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
            check_standing_decision(catalog, kind, step)?;
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
    Ok(())
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
