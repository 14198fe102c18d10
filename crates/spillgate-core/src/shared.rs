//! What gateway instances share through an external store, as plain text values, and
//! the checks applied when reading them back.
//!
//! Several gateway instances behind one load balancer each learn about the backends on
//! their own (a 429, the remaining capacity in a response's headers). Without sharing,
//! every instance pays for the same lesson: a backend that throttled instance A still
//! gets requests from instance B until B sees its own 429. The gateway writes what it
//! learns to a store (Redis) and reads what the others wrote; this module holds the
//! formats of those values and events, free of I/O.
//!
//! The store is not trusted: another program, an older version or an operator with
//! `redis-cli` may have written anything there. Every decoder here checks its input and
//! bounds it: a cooldown deadline further ahead than the longest cooldown the config can
//! produce is refused (the store deletes it), counts beyond any real quota and observations from the future are
//! refused, and text that does not parse is an error, never a panic. Times are unix
//! milliseconds (wall clock), the only clock instances share.

use std::fmt;

use crate::capacity::{Capacity, Counter};
use crate::outcome::{CoolReason, Cooldown};

/// Largest token or request count accepted from the store: far above any real quota
/// (Azure's largest deployments have tens of millions of tokens per minute).
pub const MAX_COUNT: u64 = 1_000_000_000_000;

/// Largest refill horizon of a capacity counter (the rate-limit header parser's own bound).
const MAX_REFILL_MS: u64 = 10_000_000_000;

/// How far in the future an observation may be dated (clock skew between instances).
pub const MAX_SKEW_MS: u64 = 5_000;

/// Capacity observations older than this are of no use to anyone.
pub const MAX_CAPACITY_AGE_MS: u64 = 3_600_000;

/// Largest retry-budget count accepted for one instance's window.
const MAX_BUDGET_COUNT: u64 = 1_000_000_000;

/// Why a stored value was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub String);

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn invalid(what: impl Into<String>) -> Invalid {
    Invalid(what.into())
}

/// A decimal count (no sign, no spaces).
fn number(s: &str, what: &str) -> Result<u64, Invalid> {
    if s.is_empty() || s.len() > 20 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid(format!("{what} is not a number: {:?}", short(s))));
    }
    s.parse::<u64>()
        .map_err(|_| invalid(format!("{what} is out of range: {:?}", short(s))))
}

/// A value quoted in an error message, cut short.
fn short(s: &str) -> &str {
    match s.char_indices().nth(40) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// The reasons another instance may share. A cooldown for lack of an Entra ID token is
/// about that instance's own credential, not the backend, and stays with it.
fn shared_reason(s: &str) -> Option<CoolReason> {
    CoolReason::parse(s).filter(|r| is_shared(*r))
}

/// Whether a cooldown of this reason is shared with other instances.
pub fn is_shared(reason: CoolReason) -> bool {
    reason != CoolReason::Auth
}

/// `{until_ms}:{reason}`, e.g. `1763700000000:429`. The deadline comes first so a store
/// script can compare deadlines without knowing the rest.
pub fn encode_cooldown(c: Cooldown) -> String {
    format!("{}:{}", c.until_ms, c.reason.as_str())
}

/// Reads a cooldown. `Ok(None)` when it is already over. A deadline more than
/// `max_ahead_ms` (the longest cooldown the reader's config can produce) plus
/// [`MAX_SKEW_MS`] after `now_ms` is refused: no instance with the same config writes
/// one, so the value is wrong, and honouring it (even cut to the longest cooldown) would
/// keep the backend out for as long as the value stays in the store.
pub fn decode_cooldown(
    s: &str,
    now_ms: u64,
    max_ahead_ms: u64,
) -> Result<Option<Cooldown>, Invalid> {
    let (until, reason) = s
        .split_once(':')
        .ok_or_else(|| invalid(format!("cooldown is not `deadline:reason`: {:?}", short(s))))?;
    let until_ms = number(until, "cooldown deadline")?;
    let reason = shared_reason(reason)
        .ok_or_else(|| invalid(format!("cooldown reason is unknown: {:?}", short(reason))))?;
    if until_ms <= now_ms {
        return Ok(None);
    }
    let ahead = until_ms - now_ms;
    if ahead > max_ahead_ms.saturating_add(MAX_SKEW_MS) {
        return Err(invalid(format!(
            "cooldown deadline is {ahead} ms ahead, beyond the longest configured cooldown ({max_ahead_ms} ms)"
        )));
    }
    Ok(Some(Cooldown { until_ms, reason }))
}

/// What one instance observed about a deployment's capacity: its counters and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedCapacity {
    pub observed_ms: u64,
    pub tokens: Option<Counter>,
    pub requests: Option<Counter>,
}

impl SharedCapacity {
    /// The observation in a tracked capacity, if it has one.
    pub fn of(c: &Capacity) -> Option<SharedCapacity> {
        Some(SharedCapacity {
            observed_ms: c.observed_ms?,
            tokens: c.tokens,
            requests: c.requests,
        })
    }
}

fn encode_counter(c: Option<Counter>) -> String {
    match c {
        None => "-".to_string(),
        Some(c) => format!(
            "{},{},{},{}",
            c.remaining, c.limit, c.observed_ms, c.full_at_ms
        ),
    }
}

fn decode_counter(s: &str, now_ms: u64, what: &str) -> Result<Option<Counter>, Invalid> {
    if s == "-" {
        return Ok(None);
    }
    let parts: Vec<&str> = s.split(',').collect();
    let [remaining, limit, observed, full_at] = parts[..] else {
        return Err(invalid(format!(
            "{what} counter has not 4 fields: {:?}",
            short(s)
        )));
    };
    let c = Counter {
        remaining: number(remaining, what)?,
        limit: number(limit, what)?,
        observed_ms: number(observed, what)?,
        full_at_ms: number(full_at, what)?,
    };
    if c.limit > MAX_COUNT || c.remaining > c.limit {
        return Err(invalid(format!(
            "{what} counter is out of bounds (remaining {}, limit {})",
            c.remaining, c.limit
        )));
    }
    if c.observed_ms > now_ms.saturating_add(MAX_SKEW_MS)
        || c.full_at_ms < c.observed_ms
        || c.full_at_ms - c.observed_ms > MAX_REFILL_MS
    {
        return Err(invalid(format!("{what} counter has impossible times")));
    }
    Ok(Some(c))
}

/// `{observed_ms};{tokens};{requests}`, each counter `remaining,limit,observed,full_at` or
/// `-`. The observation time comes first so a store script can keep the newest.
pub fn encode_capacity(c: &SharedCapacity) -> String {
    format!(
        "{};{};{}",
        c.observed_ms,
        encode_counter(c.tokens),
        encode_counter(c.requests)
    )
}

/// Reads an observation. `Ok(None)` when it is too old to matter; an observation dated in
/// the future (beyond clock skew) or with impossible counts is refused.
pub fn decode_capacity(s: &str, now_ms: u64) -> Result<Option<SharedCapacity>, Invalid> {
    let parts: Vec<&str> = s.split(';').collect();
    let [observed, tokens, requests] = parts[..] else {
        return Err(invalid(format!(
            "capacity is not `observed;tokens;requests`: {:?}",
            short(s)
        )));
    };
    let observed_ms = number(observed, "capacity observation time")?;
    if observed_ms > now_ms.saturating_add(MAX_SKEW_MS) {
        return Err(invalid("capacity observation is dated in the future"));
    }
    let tokens = decode_counter(tokens, now_ms, "tokens")?;
    let requests = decode_counter(requests, now_ms, "requests")?;
    if now_ms.saturating_sub(observed_ms) > MAX_CAPACITY_AGE_MS {
        return Ok(None);
    }
    Ok(Some(SharedCapacity {
        observed_ms,
        tokens,
        requests,
    }))
}

/// One instance's share of a route's retry budget: what it counted in its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BudgetShare {
    pub requests: u64,
    pub retries: u64,
}

/// `{requests}:{retries}:{at_ms}`.
pub fn encode_budget(b: BudgetShare, at_ms: u64) -> String {
    format!("{}:{}:{at_ms}", b.requests, b.retries)
}

/// Reads another instance's share. `Ok(None)` when it was written more than `stale_ms`
/// ago (that instance stopped or lost the store).
pub fn decode_budget(s: &str, now_ms: u64, stale_ms: u64) -> Result<Option<BudgetShare>, Invalid> {
    let parts: Vec<&str> = s.split(':').collect();
    let [requests, retries, at] = parts[..] else {
        return Err(invalid(format!(
            "budget share is not `requests:retries:at`: {:?}",
            short(s)
        )));
    };
    let b = BudgetShare {
        requests: number(requests, "budget requests")?,
        retries: number(retries, "budget retries")?,
    };
    let at = number(at, "budget time")?;
    if b.requests > MAX_BUDGET_COUNT || b.retries > MAX_BUDGET_COUNT {
        return Err(invalid("budget share is out of bounds"));
    }
    if at > now_ms.saturating_add(MAX_SKEW_MS) {
        return Err(invalid("budget share is dated in the future"));
    }
    if now_ms.saturating_sub(at) > stale_ms {
        return Ok(None);
    }
    Ok(Some(b))
}

/// The sum of other instances' shares, each bounded, so a store full of entries cannot
/// overflow or freeze the budget.
pub fn sum_budget(shares: impl Iterator<Item = BudgetShare>) -> BudgetShare {
    shares.fold(BudgetShare::default(), |acc, s| BudgetShare {
        requests: acc
            .requests
            .saturating_add(s.requests)
            .min(MAX_BUDGET_COUNT),
        retries: acc.retries.saturating_add(s.retries).min(MAX_BUDGET_COUNT),
    })
}

/// Which state an event is about: a backend (the resource as a whole) or one deployment.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    pub backend: String,
    pub deployment: Option<String>,
}

impl Target {
    /// The part of store keys that names the target: `backend` or `backend/deployment`.
    /// Backend names never hold `/`, deployment names never do either (both are checked
    /// when the config loads and when a request names a model).
    pub fn path(&self) -> String {
        match &self.deployment {
            None => self.backend.clone(),
            Some(d) => format!("{}/{d}", self.backend),
        }
    }
}

/// What one instance tells the others (published on the store's channel).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A cooldown started or was extended (the stored value, encoded).
    Cooled(Target, String),
    /// A capacity observation (encoded).
    Capacity(Target, String),
    /// A recovering backend answered its probe well: it is back for everyone.
    Recovered(Target),
}

/// A name as it may appear in an event: what the config and request checks allow.
fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 256 && s.bytes().all(|b| crate::config::NAME_BYTES[usize::from(b)])
}

/// `{kind} {origin} {backend} {deployment or *} [{value}]`: space-separated, since no
/// name or value contains a space.
pub fn encode_event(origin: &str, event: &Event) -> String {
    let (kind, t, value) = match event {
        Event::Cooled(t, v) => ("c", t, Some(v)),
        Event::Capacity(t, v) => ("k", t, Some(v)),
        Event::Recovered(t) => ("r", t, None),
    };
    let dep = t.deployment.as_deref().unwrap_or("*");
    match value {
        Some(v) => format!("{kind} {origin} {} {dep} {v}", t.backend),
        None => format!("{kind} {origin} {} {dep}", t.backend),
    }
}

/// Reads an event: its origin (the instance that sent it) and what it says. Values are
/// not decoded here; the receiver does that with its own clock and bounds.
pub fn decode_event(s: &str) -> Result<(&str, Event), Invalid> {
    if s.len() > 4096 {
        return Err(invalid("event is too long"));
    }
    let parts: Vec<&str> = s.split(' ').collect();
    let (kind, origin, backend, dep, value) = match parts[..] {
        [k, o, b, d] => (k, o, b, d, None),
        [k, o, b, d, v] => (k, o, b, d, Some(v)),
        _ => return Err(invalid(format!("event has no known shape: {:?}", short(s)))),
    };
    if origin.is_empty() || origin.len() > 64 || !valid_name(backend) {
        return Err(invalid(format!(
            "event names no valid origin and backend: {:?}",
            short(s)
        )));
    }
    let deployment = match dep {
        "*" => None,
        d if valid_name(d) => Some(d.to_string()),
        _ => {
            return Err(invalid(format!(
                "event names no valid deployment: {:?}",
                short(s)
            )))
        }
    };
    let target = Target {
        backend: backend.to_string(),
        deployment,
    };
    let event = match (kind, value) {
        ("c", Some(v)) => Event::Cooled(target, v.to_string()),
        ("k", Some(v)) => Event::Capacity(target, v.to_string()),
        ("r", None) => Event::Recovered(target),
        _ => return Err(invalid(format!("event kind is unknown: {:?}", short(kind)))),
    };
    Ok((origin, event))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: u64 = 1_763_700_000_000;
    const YEAR_MS: u64 = 365 * 24 * 3_600_000;

    #[test]
    fn cooldowns_round_trip_and_expire() {
        let c = Cooldown {
            until_ms: NOW + 20_000,
            reason: CoolReason::Throttled,
        };
        let s = encode_cooldown(c);
        assert_eq!(s, format!("{}:429", NOW + 20_000));
        assert_eq!(decode_cooldown(&s, NOW, 600_000), Ok(Some(c)));
        assert_eq!(decode_cooldown(&s, NOW + 20_000, 600_000), Ok(None));
        for r in [
            CoolReason::ServerError,
            CoolReason::ConnectError,
            CoolReason::Tripped,
            CoolReason::Health,
        ] {
            let c = Cooldown {
                until_ms: NOW + 1,
                reason: r,
            };
            assert_eq!(decode_cooldown(&encode_cooldown(c), NOW, 10), Ok(Some(c)));
        }
    }

    #[test]
    fn far_future_cooldowns_and_garbage_are_refused() {
        let ten_years = format!("{}:429", NOW + 10 * YEAR_MS);
        let e = decode_cooldown(&ten_years, NOW, 600_000).unwrap_err();
        assert!(
            e.0.contains("beyond the longest configured cooldown"),
            "{e}"
        );
        // Up to the clock skew between instances past the longest cooldown is taken.
        let edge = NOW + 600_000 + MAX_SKEW_MS;
        assert_eq!(
            decode_cooldown(&format!("{edge}:429"), NOW, 600_000).map(|c| c.map(|c| c.until_ms)),
            Ok(Some(edge))
        );
        assert!(decode_cooldown(&format!("{}:429", edge + 1), NOW, 600_000).is_err());
        for bad in [
            "",
            "soon",
            "abc:429",
            "123",
            "-5:429",
            "+5:429",
            " 5:429",
            "1.5:429",
            "99999999999999999999999:429",
            "123:teapot",
            "123:auth",
            "123:429:extra",
        ] {
            assert!(
                decode_cooldown(bad, NOW, 600_000).is_err(),
                "{bad:?} accepted"
            );
        }
    }

    fn capacity() -> SharedCapacity {
        SharedCapacity {
            observed_ms: NOW,
            tokens: Some(Counter {
                remaining: 1_000,
                limit: 60_000,
                observed_ms: NOW,
                full_at_ms: NOW + 60_000,
            }),
            requests: None,
        }
    }

    #[test]
    fn capacity_round_trips_and_is_bounded() {
        let c = capacity();
        let s = encode_capacity(&c);
        assert_eq!(decode_capacity(&s, NOW + 10), Ok(Some(c)));
        // Too old to matter.
        assert_eq!(decode_capacity(&s, NOW + MAX_CAPACITY_AGE_MS + 1), Ok(None));
        // From the future.
        assert!(decode_capacity(&s, NOW - MAX_SKEW_MS - 1).is_err());
        for bad in [
            "",
            "x;-;-",
            &format!("{NOW};1,2;-"),
            &format!("{NOW};5,2,{NOW},{NOW};-"),
            &format!("{NOW};1,{},{NOW},{NOW};-", MAX_COUNT + 1),
            &format!("{NOW};1,2,{NOW},{};-", NOW - 1),
            &format!("{NOW};1,2,{NOW},{};-", NOW + MAX_REFILL_MS + 1),
            &format!("{NOW};-;-;-"),
        ] {
            assert!(decode_capacity(bad, NOW).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn budget_shares_are_bounded_and_expire() {
        let b = BudgetShare {
            requests: 100,
            retries: 7,
        };
        let s = encode_budget(b, NOW);
        assert_eq!(decode_budget(&s, NOW + 1_000, 3_000), Ok(Some(b)));
        assert_eq!(decode_budget(&s, NOW + 3_001, 3_000), Ok(None));
        assert!(decode_budget(&s, NOW - MAX_SKEW_MS - 1, 3_000).is_err());
        assert!(decode_budget(&format!("{}:1:{NOW}", MAX_BUDGET_COUNT + 1), NOW, 10).is_err());
        assert!(decode_budget("1:2", NOW, 10).is_err());
        let many = std::iter::repeat_n(
            BudgetShare {
                requests: MAX_BUDGET_COUNT,
                retries: MAX_BUDGET_COUNT,
            },
            5,
        );
        assert_eq!(sum_budget(many).requests, MAX_BUDGET_COUNT);
    }

    #[test]
    fn events_round_trip() {
        let t = Target {
            backend: "ptu-eastus".into(),
            deployment: Some("gpt-4o:ft-1".into()),
        };
        assert_eq!(t.path(), "ptu-eastus/gpt-4o:ft-1");
        let resource = Target {
            backend: "ptu-eastus".into(),
            deployment: None,
        };
        for e in [
            Event::Cooled(t.clone(), format!("{NOW}:429")),
            Event::Capacity(t.clone(), encode_capacity(&capacity())),
            Event::Recovered(resource.clone()),
            Event::Cooled(resource, format!("{NOW}:tripped")),
        ] {
            let s = encode_event("abc123", &e);
            assert_eq!(decode_event(&s), Ok(("abc123", e)));
        }
        for bad in [
            "",
            "c",
            "c o b",
            "x o b * 1",
            "c o b *",
            "r o b * extra",
            "c o b/x * 1:429",
            "c o b d|x 1:429",
            "c  b * 1:429",
        ] {
            assert!(decode_event(bad).is_err(), "{bad:?} accepted");
        }
    }

    proptest! {
        /// No input makes a decoder panic, and what they accept is within bounds.
        #[test]
        fn decoders_never_panic(s in "\\PC{0,80}", now in 0u64..u64::MAX / 2) {
            if let Ok(Some(c)) = decode_cooldown(&s, now, 600_000) {
                prop_assert!(c.until_ms > now && c.until_ms <= now + 600_000 + MAX_SKEW_MS);
            }
            if let Ok(Some(c)) = decode_capacity(&s, now) {
                prop_assert!(c.observed_ms <= now + MAX_SKEW_MS);
            }
            let _ = decode_budget(&s, now, 3_000);
            let _ = decode_event(&s);
        }

        #[test]
        fn numeric_cooldowns_are_bounded(until in any::<u64>(), now in 0u64..u64::MAX / 2) {
            let s = format!("{until}:5xx");
            match decode_cooldown(&s, now, 60_000) {
                Ok(None) => prop_assert!(until <= now),
                Ok(Some(c)) => prop_assert!(c.until_ms == until && until > now && until <= now + 60_000 + MAX_SKEW_MS),
                Err(_) => prop_assert!(until > now + 60_000 + MAX_SKEW_MS),
            }
        }
    }
}
