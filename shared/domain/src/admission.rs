//! The dispatch round's admission: whether one due task may be granted now, given
//! what the round knows of its providers' slots and buckets, its tenant's slots and
//! its tenant's spend, and the round's books once it is.
//!
//! A round is a step function over [`Round`]: the scheduler shows it each head in
//! turn order as a [`Candidate`]; [`Round::admit`] answers [`Verdict::Needs`] while a
//! fact it must weigh is not yet known (the scheduler reads it, under the
//! provider's lock where it is a provider's, and tells the round with
//! [`Round::learn`]), then grants or holds the task back. A grant the lifecycle
//! accepted is booked with [`Round::book`]. Nothing here reads a clock or a
//! database: the round's instant is passed in.

use std::collections::{BTreeSet, HashMap};

use crate::lifecycle::Micros;
use crate::limits::take_tokens;
use crate::spend::{Amount, Budget, may_start_a_paid_call};

/// A due task as admission sees it.
#[derive(Debug, Clone)]
pub struct Candidate<'a> {
    pub tenant: &'a str,
    pub kind: &'a str,
    /// The reason the task shows while it waits, if any: a hold only writes a new one.
    pub reason: Option<&'a str>,
    /// Every provider the attempt calls before its next pause, in the kind's order.
    pub calls: Vec<Call<'a>>,
    /// How many of the kind's attempts one tenant may run at once; 0 is no limit.
    pub tenant_concurrency: u32,
    /// The tenant's daily budget, when it has one.
    pub budget: Option<&'a Budget>,
}

/// The calls an attempt makes to one provider, and that provider's rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Call<'a> {
    pub provider: &'a str,
    /// How many calls the attempt makes there: a token each. 0 holds only a slot.
    pub calls: u32,
    pub rate_per_second: f64,
    pub burst: f64,
}

/// A provider's room while a round holds its lock: read once, kept in memory, the
/// bucket written back when the round commits. Slots other transactions release
/// meanwhile only lower the true count, so the count kept here never grants too many.
#[derive(Debug, Clone, PartialEq)]
pub struct Room {
    /// Slots held there now.
    pub slots: i64,
    /// Slots the provider may hold now: its concurrency, or less while its adaptive
    /// limit is reduced.
    pub allowed: i64,
    /// "imagegen limit 2 of 8, reduced after timeouts" while it is reduced.
    pub reduced: Option<String>,
    /// Tokens, and when they were counted.
    pub tokens: f64,
    pub counted_at: Micros,
}

/// A fact the round must know before it can decide.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Fact {
    /// What the tenant has spent today.
    Spent { tenant: String },
    /// The provider's room, read under its lock for the rest of the round.
    Provider { name: String },
    /// How many attempts of the kind the tenant runs now.
    TenantSlots { tenant: String, kind: String },
}

/// What the scheduler read for a [`Fact`].
#[derive(Debug, Clone, PartialEq)]
pub enum Learnt {
    Spent(Amount),
    /// `None`: another instance's round holds the provider.
    Provider(Option<Room>),
    TenantSlots(i64),
}

/// Why a task is not granted this round.
#[derive(Debug, Clone, PartialEq)]
pub enum HeldBack {
    /// A provider the attempt calls has no free slot, or another instance's round
    /// holds it: the provider's tasks wait for the next round.
    ProviderFull(String),
    /// A provider's bucket is empty until this instant: its tasks wait until then.
    RateLimited(String, Micros),
    /// The tenant's slots for the kind are all taken.
    TenantFull,
    /// The tenant's daily budget is spent.
    BudgetSpent,
}

/// Admission's answer for one candidate.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Read this and ask again.
    Needs(Fact),
    /// Grant it; book it with [`Round::book`] once the lifecycle accepted the grant.
    Grant(Takes),
    /// Not this round. `reason`, when `Some`, is a new reason for the task to show.
    Hold { why: HeldBack, reason: Option<String> },
}

/// The tokens a grant leaves at each provider it calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Takes(Vec<(String, f64)>);

/// What one round knows and has done so far.
#[derive(Debug, Clone, Default)]
pub struct Round {
    now: Micros,
    /// Each provider looked at: its room, or `None` where another round holds it.
    providers: HashMap<String, Option<Room>>,
    /// Providers whose bucket this round took from: written back at commit.
    taken: BTreeSet<String>,
    tenant_slots: HashMap<(String, String), i64>,
    spent: HashMap<String, Amount>,
    /// Tenants granted, in name order: their turn moves to the end at commit.
    tenants: BTreeSet<String>,
    granted: usize,
}

impl Round {
    /// A round deciding at `now`.
    pub fn at(now: Micros) -> Self {
        Round { now, ..Round::default() }
    }

    /// The round's instant.
    pub fn now(&self) -> Micros {
        self.now
    }

    /// Whether `candidate` may be granted now. All or none: a slot and a token per
    /// call at every provider it calls, a tenant slot where its kind limits tenants,
    /// and budget left; nothing is taken until each of them has room.
    pub fn admit(&self, candidate: &Candidate<'_>) -> Verdict {
        if let Some(budget) = candidate.budget {
            let Some(spent) = self.spent.get(candidate.tenant) else {
                return Verdict::Needs(Fact::Spent { tenant: candidate.tenant.to_owned() });
            };
            if let Err(reason) = may_start_a_paid_call(candidate.tenant, Some(budget), *spent) {
                return Verdict::Hold { why: HeldBack::BudgetSpent, reason: new_reason(candidate, reason) };
            }
        }
        let mut takes = Vec::with_capacity(candidate.calls.len());
        for call in &candidate.calls {
            let Some(room) = self.providers.get(call.provider) else {
                return Verdict::Needs(Fact::Provider { name: call.provider.to_owned() });
            };
            let Some(room) = room else {
                return Verdict::Hold { why: HeldBack::ProviderFull(call.provider.to_owned()), reason: None };
            };
            if room.slots >= room.allowed {
                // Passed over because the provider is in trouble: its reason says so.
                let reason = room.reduced.as_ref().map(|reduced| format!("waiting for a slot: {reduced}"));
                return Verdict::Hold {
                    why: HeldBack::ProviderFull(call.provider.to_owned()),
                    reason: reason.and_then(|reason| new_reason(candidate, reason)),
                };
            }
            // One token per call the attempt makes to the provider, not one per attempt.
            let (left, wait) =
                take_tokens(room.tokens, room.counted_at, call.rate_per_second, call.burst, self.now, call.calls);
            if let Some(wait) = wait {
                return Verdict::Hold {
                    why: HeldBack::RateLimited(call.provider.to_owned(), self.now + wait),
                    reason: None,
                };
            }
            takes.push((call.provider.to_owned(), left));
        }
        if candidate.tenant_concurrency > 0 {
            let key = (candidate.tenant.to_owned(), candidate.kind.to_owned());
            let Some(held) = self.tenant_slots.get(&key) else {
                return Verdict::Needs(Fact::TenantSlots { tenant: key.0, kind: key.1 });
            };
            if *held >= i64::from(candidate.tenant_concurrency) {
                return Verdict::Hold { why: HeldBack::TenantFull, reason: None };
            }
        }
        Verdict::Grant(Takes(takes))
    }

    /// Keeps what the scheduler read for `fact`.
    pub fn learn(&mut self, fact: Fact, learnt: Learnt) {
        match (fact, learnt) {
            (Fact::Spent { tenant }, Learnt::Spent(spent)) => {
                self.spent.insert(tenant, spent);
            }
            (Fact::Provider { name }, Learnt::Provider(room)) => {
                self.providers.insert(name, room);
            }
            (Fact::TenantSlots { tenant, kind }, Learnt::TenantSlots(count)) => {
                self.tenant_slots.insert((tenant, kind), count);
            }
            (fact, learnt) => debug_assert!(false, "{learnt:?} does not answer {fact:?}"),
        }
    }

    /// Books a grant the lifecycle accepted: its slots, its tokens and its tenant's turn.
    pub fn book(&mut self, candidate: &Candidate<'_>, takes: Takes) {
        for (provider, left) in takes.0 {
            if let Some(Some(room)) = self.providers.get_mut(&provider) {
                room.slots += 1;
                room.tokens = left;
                room.counted_at = self.now;
            }
            self.taken.insert(provider);
        }
        if candidate.tenant_concurrency > 0 {
            *self.tenant_slots.entry((candidate.tenant.to_owned(), candidate.kind.to_owned())).or_default() += 1;
        }
        self.tenants.insert(candidate.tenant.to_owned());
        self.granted += 1;
    }

    /// How many grants were booked.
    pub fn granted(&self) -> usize {
        self.granted
    }

    /// The providers another round holds or that have no free slot: their tasks wait.
    pub fn full_providers(&self) -> impl Iterator<Item = &str> {
        self.providers
            .iter()
            .filter(|(_, room)| room.as_ref().is_none_or(|room| room.slots >= room.allowed))
            .map(|(name, _)| name.as_str())
    }

    /// The tenants granted, in name order, so that two instances' rounds that move
    /// their turns never wait on each other in a cycle.
    pub fn tenants_granted(&self) -> impl Iterator<Item = &str> {
        self.tenants.iter().map(String::as_str)
    }

    /// The buckets this round took from, to write back: (provider, tokens, counted at).
    pub fn buckets_taken(&self) -> impl Iterator<Item = (&str, f64, Micros)> {
        self.taken.iter().filter_map(|name| match self.providers.get(name) {
            Some(Some(room)) => Some((name.as_str(), room.tokens, room.counted_at)),
            _ => None,
        })
    }
}

/// `reason` when the task does not show it already: only a new reason is written
/// (a write wakes the dispatchers again).
fn new_reason(candidate: &Candidate<'_>, reason: String) -> Option<String> {
    (candidate.reason != Some(reason.as_str())).then_some(reason)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const SECOND: Micros = 1_000_000;

    fn room(slots: i64, allowed: i64, tokens: f64) -> Room {
        Room { slots, allowed, reduced: None, tokens, counted_at: 0 }
    }

    fn call(provider: &str) -> Call<'_> {
        Call { provider, calls: 1, rate_per_second: 1.0, burst: 10.0 }
    }

    fn candidate<'a>(tenant: &'a str, calls: Vec<Call<'a>>) -> Candidate<'a> {
        Candidate { tenant, kind: "k", reason: None, calls, tenant_concurrency: 0, budget: None }
    }

    /// Admits `candidate`, answering every fact from `facts`, and books a grant.
    fn decide(round: &mut Round, candidate: &Candidate<'_>, facts: &dyn Fn(&Fact) -> Learnt) -> Verdict {
        loop {
            match round.admit(candidate) {
                Verdict::Needs(fact) => {
                    let learnt = facts(&fact);
                    round.learn(fact, learnt);
                }
                Verdict::Grant(takes) => {
                    round.book(candidate, takes.clone());
                    return Verdict::Grant(takes);
                }
                hold => return hold,
            }
        }
    }

    #[test]
    fn asks_for_each_fact_once_in_the_order_it_weighs_them() {
        let budget = Budget { per_day_minor: Amount::from_minor(100) };
        let mut c = candidate("acme", vec![call("llm"), call("pay")]);
        c.budget = Some(&budget);
        c.tenant_concurrency = 2;
        let mut round = Round::at(10 * SECOND);
        let mut asked = Vec::new();
        loop {
            match round.admit(&c) {
                Verdict::Needs(fact) => {
                    asked.push(fact.clone());
                    let learnt = match fact {
                        Fact::Spent { .. } => Learnt::Spent(Amount::from_minor(5)),
                        Fact::Provider { .. } => Learnt::Provider(Some(room(0, 4, 10.0))),
                        Fact::TenantSlots { .. } => Learnt::TenantSlots(1),
                    };
                    round.learn(fact, learnt);
                }
                Verdict::Grant(takes) => {
                    round.book(&c, takes);
                    break;
                }
                other => panic!("held back: {other:?}"),
            }
        }
        assert_eq!(
            asked,
            vec![
                Fact::Spent { tenant: "acme".into() },
                Fact::Provider { name: "llm".into() },
                Fact::Provider { name: "pay".into() },
                Fact::TenantSlots { tenant: "acme".into(), kind: "k".into() },
            ]
        );
        // The second is held back by the tenant's limit, without asking again.
        assert_eq!(round.admit(&c), Verdict::Hold { why: HeldBack::TenantFull, reason: None });
        assert_eq!(round.tenants_granted().collect::<Vec<_>>(), vec!["acme"]);
        let buckets: Vec<_> = round.buckets_taken().collect();
        assert_eq!(buckets, vec![("llm", 9.0, 10 * SECOND), ("pay", 9.0, 10 * SECOND)]);
    }

    #[test]
    fn a_provider_another_round_holds_is_full_and_takes_nothing_elsewhere() {
        let mut round = Round::at(0);
        round.learn(Fact::Provider { name: "llm".into() }, Learnt::Provider(Some(room(0, 4, 10.0))));
        round.learn(Fact::Provider { name: "pay".into() }, Learnt::Provider(None));
        let c = candidate("acme", vec![call("llm"), call("pay")]);
        assert_eq!(round.admit(&c), Verdict::Hold { why: HeldBack::ProviderFull("pay".into()), reason: None });
        assert_eq!(round.buckets_taken().count(), 0, "all or none");
        assert_eq!(round.full_providers().collect::<Vec<_>>(), vec!["pay"]);
    }

    #[test]
    fn a_reduced_limit_gives_its_reason_once() {
        let mut round = Round::at(0);
        let reduced = Room { reduced: Some("llm limit 1 of 8, reduced after timeouts".into()), ..room(1, 1, 10.0) };
        round.learn(Fact::Provider { name: "llm".into() }, Learnt::Provider(Some(reduced)));
        let mut c = candidate("acme", vec![call("llm")]);
        let reason = "waiting for a slot: llm limit 1 of 8, reduced after timeouts";
        assert_eq!(
            round.admit(&c),
            Verdict::Hold { why: HeldBack::ProviderFull("llm".into()), reason: Some(reason.into()) }
        );
        c.reason = Some(reason);
        assert_eq!(round.admit(&c), Verdict::Hold { why: HeldBack::ProviderFull("llm".into()), reason: None });
    }

    #[test]
    fn an_empty_bucket_says_when_it_has_a_token_again() {
        let mut round = Round::at(0);
        round.learn(Fact::Provider { name: "llm".into() }, Learnt::Provider(Some(room(0, 4, 0.5))));
        let c = candidate("acme", vec![Call { rate_per_second: 2.0, ..call("llm") }]);
        assert_eq!(
            round.admit(&c),
            Verdict::Hold { why: HeldBack::RateLimited("llm".into(), SECOND / 4), reason: None }
        );
    }

    #[test]
    fn a_spent_budget_holds_with_its_reason_and_other_tenants_go_on() {
        let budget = Budget { per_day_minor: Amount::from_minor(100) };
        let mut round = Round::at(0);
        let facts = |fact: &Fact| match fact {
            Fact::Spent { tenant } if tenant == "acme" => Learnt::Spent(Amount::from_minor(100)),
            Fact::Spent { .. } => Learnt::Spent(Amount::from_minor(0)),
            Fact::Provider { .. } => Learnt::Provider(Some(room(0, 4, 10.0))),
            Fact::TenantSlots { .. } => Learnt::TenantSlots(0),
        };
        let mut acme = candidate("acme", vec![call("llm")]);
        acme.budget = Some(&budget);
        let Verdict::Hold { why: HeldBack::BudgetSpent, reason: Some(reason) } = decide(&mut round, &acme, &facts)
        else {
            panic!("acme's budget is spent")
        };
        assert!(reason.starts_with(crate::spend::BUDGET_SPENT_OPENING), "{reason}");
        let mut globex = candidate("globex", vec![call("llm")]);
        globex.budget = Some(&budget);
        assert!(matches!(decide(&mut round, &globex, &facts), Verdict::Grant(_)));
    }

    /// A provider's limits for the property tests.
    #[derive(Debug, Clone)]
    struct Limits {
        slots: i64,
        allowed: i64,
        tokens: f64,
        rate: f64,
        burst: f64,
        ours: bool,
    }

    fn limits() -> impl Strategy<Value = Limits> {
        (0i64..6, 0i64..6, 0.0f64..8.0, 0.1f64..20.0, 1.0f64..8.0, prop::bool::weighted(0.9)).prop_map(
            |(slots, allowed, tokens, rate, burst, ours)| Limits {
                slots,
                allowed,
                tokens: tokens.min(burst),
                rate,
                burst,
                ours,
            },
        )
    }

    /// A head: its tenant, the providers it calls (indices) with calls each, and its
    /// kind's tenant limit.
    type Head = (usize, Vec<(usize, u32)>, u32);

    fn heads() -> impl Strategy<Value = Vec<Head>> {
        prop::collection::vec((0usize..4, prop::collection::vec((0usize..3, 0u32..3), 1..3), 0u32..3), 0..40)
    }

    const TENANTS: [&str; 4] = ["acme", "globex", "initech", "umbrella"];
    const PROVIDERS: [&str; 3] = ["llm", "pay", "sms"];

    proptest! {
        /// Whatever the heads and limits, a round never grants past a provider's
        /// allowed slots, a bucket's tokens, a tenant's slots or a spent budget; a
        /// head is granted exactly when all it needs has room; and a head held back
        /// takes nothing (all or none).
        #[test]
        fn a_round_never_grants_past_a_limit_and_grants_whatever_fits(
            providers in prop::collection::vec(limits(), 3),
            heads in heads(),
            spent in prop::collection::vec(0i64..3, 4),
            elapsed in 0i64..3 * SECOND,
            held_by_tenant in prop::collection::vec(0i64..3, 4),
        ) {
            let budget = Budget { per_day_minor: Amount::from_minor(1) };
            let now = elapsed;
            let mut round = Round::at(now);
            let facts = |fact: &Fact| match fact {
                Fact::Spent { tenant } => {
                    let t = TENANTS.iter().position(|n| n == tenant).expect("a known tenant");
                    Learnt::Spent(Amount::from_minor(spent[t]))
                }
                Fact::Provider { name } => {
                    let p = &providers[PROVIDERS.iter().position(|n| n == name).expect("a known provider")];
                    Learnt::Provider(p.ours.then(|| room(p.slots, p.allowed, p.tokens)))
                }
                Fact::TenantSlots { tenant, .. } => {
                    Learnt::TenantSlots(held_by_tenant[TENANTS.iter().position(|n| n == tenant).expect("a known tenant")])
                }
            };
            // The model: what each limit has left, kept independently of the round.
            let mut slots_left: Vec<i64> = providers.iter().map(|p| p.allowed - p.slots).collect();
            let mut tokens: Vec<f64> = providers
                .iter()
                .map(|p| (p.tokens + elapsed as f64 / 1e6 * p.rate).min(p.burst))
                .collect();
            let mut tenant_left: Vec<i64> = held_by_tenant.clone();
            for (tenant, calls, limit) in &heads {
                let mut merged: Vec<(usize, u32)> = Vec::new();
                for (p, n) in calls {
                    match merged.iter_mut().find(|(q, _)| q == p) {
                        Some((_, m)) => *m += n,
                        None => merged.push((*p, *n)),
                    }
                }
                let c = Candidate {
                    tenant: TENANTS[*tenant],
                    kind: "k",
                    reason: None,
                    calls: merged
                        .iter()
                        .map(|(p, n)| Call {
                            provider: PROVIDERS[*p],
                            calls: *n,
                            rate_per_second: providers[*p].rate,
                            burst: providers[*p].burst,
                        })
                        .collect(),
                    tenant_concurrency: *limit,
                    budget: (*tenant % 2 == 0).then_some(&budget),
                };
                let fits = (*tenant % 2 != 0 || spent[*tenant] < 1)
                    && merged.iter().all(|(p, n)| {
                        let want = f64::from((*n).max(1)).min(providers[*p].burst.max(1.0));
                        providers[*p].ours && slots_left[*p] > 0 && tokens[*p] >= want
                    })
                    && (*limit == 0 || tenant_left[*tenant] < i64::from(*limit));
                let verdict = decide(&mut round, &c, &facts);
                prop_assert_eq!(matches!(verdict, Verdict::Grant(_)), fits, "{:?} for {:?}", verdict, c);
                if fits {
                    for (p, n) in &merged {
                        slots_left[*p] -= 1;
                        tokens[*p] -= f64::from((*n).max(1)).min(providers[*p].burst.max(1.0));
                        prop_assert!(slots_left[*p] >= 0 && tokens[*p] >= -1e-9);
                    }
                    if *limit > 0 {
                        tenant_left[*tenant] += 1;
                    }
                }
            }
            for (name, left, _) in round.buckets_taken() {
                let p = PROVIDERS.iter().position(|n| *n == name).expect("a known provider");
                prop_assert!((left - tokens[p]).abs() < 1e-6, "{} keeps {} tokens, the model {}", name, left, tokens[p]);
            }
        }

        /// No tenant is starved by another within a round: whether a head is granted
        /// depends only on the limits and the grants before it, never on which heads
        /// of other tenants were held back before it.
        #[test]
        fn heads_held_back_before_a_head_do_not_change_its_verdict(
            providers in prop::collection::vec(limits(), 3),
            heads in heads(),
        ) {
            let facts = |fact: &Fact| match fact {
                Fact::Spent { .. } => Learnt::Spent(Amount::from_minor(0)),
                Fact::Provider { name } => {
                    let p = &providers[PROVIDERS.iter().position(|n| n == name).expect("a known provider")];
                    Learnt::Provider(p.ours.then(|| room(p.slots, p.allowed, p.tokens)))
                }
                Fact::TenantSlots { .. } => Learnt::TenantSlots(0),
            };
            let to_candidate = |(tenant, calls, limit): &Head| {
                let mut merged: Vec<Call<'static>> = Vec::new();
                for (p, n) in calls {
                    match merged.iter_mut().find(|c| c.provider == PROVIDERS[*p]) {
                        Some(c) => c.calls += n,
                        None => merged.push(Call {
                            provider: PROVIDERS[*p],
                            calls: *n,
                            rate_per_second: providers[*p].rate,
                            burst: providers[*p].burst,
                        }),
                    }
                }
                Candidate { tenant: TENANTS[*tenant], kind: "k", reason: None, calls: merged, tenant_concurrency: *limit, budget: None }
            };
            // Every head in order, and then only the heads the first pass granted: the
            // granted ones are granted again, the same way.
            let mut round = Round::at(0);
            let granted: Vec<&Head> = heads
                .iter()
                .filter(|h| matches!(decide(&mut round, &to_candidate(h), &facts), Verdict::Grant(_)))
                .collect();
            let mut again = Round::at(0);
            for head in &granted {
                let verdict = decide(&mut again, &to_candidate(head), &facts);
                prop_assert!(matches!(verdict, Verdict::Grant(_)), "{:?}", verdict);
            }
            prop_assert_eq!(round.buckets_taken().collect::<Vec<_>>(), again.buckets_taken().collect::<Vec<_>>());
        }
    }
}
