//! What an upstream answer means for routing, and how long a backend cools down.
//!
//! Backends say when to come back in several ways (`retry-after-ms`, `x-ms-retry-after-ms`,
//! `Retry-After` as seconds or as an HTTP date) and sometimes say nonsense. Each header is
//! parsed by a small pure function that returns `None` for anything it cannot trust, so
//! the caller falls back to the configured default; the result is clamped to the
//! configured maximum so one bad header cannot park a backend for a day.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::config::CooldownPolicy;

/// How one upstream attempt ended, as far as routing cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// 1xx/2xx/3xx: goes back to the client.
    Success,
    /// 4xx other than 429: the client's problem. Returned as is unless the route's
    /// retry condition covers it (e.g. `>=300`); never cools a backend.
    ClientError,
    /// 429: the backend is over its limits.
    Throttled,
    /// 5xx: the backend is failing.
    ServerError,
    /// No answer: connection refused or reset, TLS failure, or a timeout before the
    /// response headers.
    ConnectError,
}

impl Outcome {
    pub fn from_status(status: u16) -> Outcome {
        match status {
            429 => Outcome::Throttled,
            400..=499 => Outcome::ClientError,
            500..=599 => Outcome::ServerError,
            _ => Outcome::Success,
        }
    }

    /// Whether the backend failed to serve (429, 5xx, no answer), as opposed to an answer
    /// to pass on: such an outcome does not end a recovery probe, and its response is not
    /// the one returned. Retrying is the retry policy's call and cooling `cooldown.on`'s.
    pub fn fails_over(self) -> bool {
        matches!(
            self,
            Outcome::Throttled | Outcome::ServerError | Outcome::ConnectError
        )
    }
}

/// Why a backend is cooling down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CoolReason {
    Throttled,
    ServerError,
    ConnectError,
    /// The circuit breaker tripped: too many failures in its window.
    Tripped,
    /// An active health check failed.
    Health,
    /// No Entra ID token could be obtained for the backend, or the backend rejected a
    /// freshly obtained one.
    Auth,
}

impl CoolReason {
    pub fn from_outcome(o: Outcome) -> Option<CoolReason> {
        match o {
            Outcome::Throttled => Some(CoolReason::Throttled),
            Outcome::ServerError => Some(CoolReason::ServerError),
            Outcome::ConnectError => Some(CoolReason::ConnectError),
            Outcome::Success | Outcome::ClientError => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CoolReason::Throttled => "429",
            CoolReason::ServerError => "5xx",
            CoolReason::ConnectError => "connect",
            CoolReason::Tripped => "tripped",
            CoolReason::Health => "health",
            CoolReason::Auth => "auth",
        }
    }

    /// The inverse of [`CoolReason::as_str`].
    pub fn parse(s: &str) -> Option<CoolReason> {
        Some(match s {
            "429" => CoolReason::Throttled,
            "5xx" => CoolReason::ServerError,
            "connect" => CoolReason::ConnectError,
            "tripped" => CoolReason::Tripped,
            "health" => CoolReason::Health,
            "auth" => CoolReason::Auth,
            _ => return None,
        })
    }

    pub fn to_u8(self) -> u8 {
        match self {
            CoolReason::Throttled => 1,
            CoolReason::ServerError => 2,
            CoolReason::ConnectError => 3,
            CoolReason::Tripped => 4,
            CoolReason::Health => 5,
            CoolReason::Auth => 6,
        }
    }

    pub fn from_u8(v: u8) -> Option<CoolReason> {
        match v {
            1 => Some(CoolReason::Throttled),
            2 => Some(CoolReason::ServerError),
            3 => Some(CoolReason::ConnectError),
            4 => Some(CoolReason::Tripped),
            5 => Some(CoolReason::Health),
            6 => Some(CoolReason::Auth),
            _ => None,
        }
    }
}

/// A cooldown: the backend is unavailable until `until_ms` (unix milliseconds). When a
/// backend is cooled twice, the later deadline wins (see the gateway's state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cooldown {
    pub until_ms: u64,
    pub reason: CoolReason,
}

/// `Retry-After` delta-seconds (decimals tolerated). `None` for negative, non-finite or
/// non-numeric text.
pub fn parse_delta_seconds(value: &str) -> Option<Duration> {
    let v = value.trim();
    if v.is_empty() || v.starts_with('-') || v.starts_with('+') {
        return None;
    }
    let secs: f64 = v.parse().ok()?;
    if !secs.is_finite() || !(0.0..=1e9).contains(&secs) {
        return None;
    }
    Some(Duration::from_secs_f64(secs))
}

/// `retry-after-ms` / `x-ms-retry-after-ms`: milliseconds (decimals tolerated).
pub fn parse_millis(value: &str) -> Option<Duration> {
    parse_delta_seconds(value).map(|d| d / 1000)
}

/// `Retry-After` as an HTTP date (RFC 9110 IMF-fixdate and the obsolete forms). `None`
/// when it does not parse or is not in the future relative to `now_unix_ms`.
pub fn parse_http_date(value: &str, now_unix_ms: u64) -> Option<Duration> {
    let at = httpdate::parse_http_date(value.trim()).ok()?;
    let at_ms = u64::try_from(at.duration_since(UNIX_EPOCH).ok()?.as_millis()).ok()?;
    (at_ms > now_unix_ms).then(|| Duration::from_millis(at_ms - now_unix_ms))
}

/// `Retry-After`: delta-seconds or an HTTP date.
pub fn parse_retry_after(value: &str, now_unix_ms: u64) -> Option<Duration> {
    parse_delta_seconds(value).or_else(|| parse_http_date(value, now_unix_ms))
}

/// The backend's own hint of when to come back, from response headers in order of
/// precision: `retry-after-ms`, `x-ms-retry-after-ms`, then `Retry-After`. A header that
/// does not parse is skipped, not fatal. `header` returns a header's value by lower-case
/// name.
pub fn retry_hint<'a>(
    header: impl Fn(&str) -> Option<&'a str>,
    now_unix_ms: u64,
) -> Option<Duration> {
    header("retry-after-ms")
        .and_then(parse_millis)
        .or_else(|| header("x-ms-retry-after-ms").and_then(parse_millis))
        .or_else(|| header("retry-after").and_then(|v| parse_retry_after(v, now_unix_ms)))
}

/// How long to cool a backend for `reason`: the hint when there is one, else the
/// configured default; clamped to the configured maximum.
pub fn cooldown_duration(
    reason: CoolReason,
    hint: Option<Duration>,
    policy: &CooldownPolicy,
) -> Duration {
    let default = match reason {
        CoolReason::Throttled => policy.default_429,
        CoolReason::ServerError => policy.default_5xx,
        CoolReason::ConnectError | CoolReason::Tripped | CoolReason::Health => {
            policy.default_connect
        }
        CoolReason::Auth => policy.default_auth,
    };
    hint.unwrap_or(default).min(policy.max)
}

/// Wall-clock now in unix milliseconds (for callers outside tests).
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(millis).unwrap_or(0)
}

/// A duration in whole milliseconds, saturating at `u64::MAX`.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: u64 = 1_700_000_000_000; // 2023-11-14T22:13:20Z

    fn hint(pairs: &[(&str, &str)]) -> Option<Duration> {
        retry_hint(
            |n| pairs.iter().find(|(k, _)| *k == n).map(|(_, v)| *v),
            NOW,
        )
    }

    #[test]
    fn status_classes() {
        assert_eq!(Outcome::from_status(200), Outcome::Success);
        assert_eq!(Outcome::from_status(304), Outcome::Success);
        assert_eq!(Outcome::from_status(400), Outcome::ClientError);
        assert_eq!(Outcome::from_status(401), Outcome::ClientError);
        assert_eq!(Outcome::from_status(404), Outcome::ClientError);
        assert_eq!(Outcome::from_status(429), Outcome::Throttled);
        assert_eq!(Outcome::from_status(500), Outcome::ServerError);
        assert_eq!(Outcome::from_status(503), Outcome::ServerError);
        assert!(!Outcome::ClientError.fails_over());
        assert!(Outcome::ConnectError.fails_over());
    }

    #[test]
    fn retry_after_every_form() {
        assert_eq!(
            hint(&[("retry-after", "20")]),
            Some(Duration::from_secs(20))
        );
        assert_eq!(
            hint(&[("retry-after", " 7 ")]),
            Some(Duration::from_secs(7))
        );
        assert_eq!(hint(&[("retry-after", "0")]), Some(Duration::ZERO));
        assert_eq!(
            hint(&[("retry-after", "1.5")]),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(
            hint(&[("retry-after-ms", "1500")]),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(
            hint(&[("x-ms-retry-after-ms", "250")]),
            Some(Duration::from_millis(250))
        );
        // HTTP date 30 s after NOW.
        assert_eq!(
            hint(&[("retry-after", "Tue, 14 Nov 2023 22:13:50 GMT")]),
            Some(Duration::from_secs(30))
        );
        // Obsolete RFC 850 form.
        assert_eq!(
            hint(&[("retry-after", "Tuesday, 14-Nov-23 22:13:50 GMT")]),
            Some(Duration::from_secs(30))
        );
    }

    #[test]
    fn precision_order_ms_first() {
        let both = [
            ("retry-after", "20"),
            ("retry-after-ms", "1500"),
            ("x-ms-retry-after-ms", "9000"),
        ];
        assert_eq!(hint(&both), Some(Duration::from_millis(1500)));
        let ms_x = [("retry-after", "20"), ("x-ms-retry-after-ms", "9000")];
        assert_eq!(hint(&ms_x), Some(Duration::from_millis(9000)));
    }

    #[test]
    fn garbage_negative_and_past_fall_back() {
        for bad in [
            "",
            "soon",
            "-5",
            "+5",
            "NaN",
            "inf",
            "1e400",
            "12abc",
            "Tue, 14 Nov 2023 22:13:00 GMT",
        ] {
            assert_eq!(hint(&[("retry-after", bad)]), None, "{bad:?}");
        }
        // A broken precise header does not hide a good coarse one.
        assert_eq!(
            hint(&[("retry-after-ms", "abc"), ("retry-after", "3")]),
            Some(Duration::from_secs(3))
        );
        let p = CooldownPolicy::default();
        assert_eq!(
            cooldown_duration(CoolReason::Throttled, None, &p),
            Duration::from_secs(10)
        );
        assert_eq!(
            cooldown_duration(CoolReason::ServerError, None, &p),
            Duration::from_secs(10)
        );
    }

    #[test]
    fn clamped_to_max() {
        let p = CooldownPolicy::default();
        assert_eq!(
            cooldown_duration(CoolReason::Throttled, Some(Duration::from_secs(86_400)), &p),
            Duration::from_secs(300)
        );
        assert_eq!(
            cooldown_duration(CoolReason::Throttled, Some(Duration::from_secs(20)), &p),
            Duration::from_secs(20)
        );
    }

    #[test]
    fn reason_round_trips() {
        for r in [
            CoolReason::Throttled,
            CoolReason::ServerError,
            CoolReason::ConnectError,
            CoolReason::Tripped,
            CoolReason::Health,
            CoolReason::Auth,
        ] {
            assert_eq!(CoolReason::from_u8(r.to_u8()), Some(r));
        }
        assert_eq!(CoolReason::from_u8(0), None);
    }

    proptest! {
        #[test]
        fn any_header_text_gives_a_bounded_cooldown(s in ".{0,40}", ms in ".{0,20}") {
            let p = CooldownPolicy::default();
            let h = hint(&[("retry-after", s.as_str()), ("retry-after-ms", ms.as_str())]);
            let d = cooldown_duration(CoolReason::Throttled, h, &p);
            prop_assert!(d <= p.max);
        }

        /// Real values in every form parse to what they say.
        #[test]
        fn numbers_and_dates_parse_exactly(secs in 0u64..100_000, millis in 0u64..10_000_000, ahead in 1u64..86_400) {
            prop_assert_eq!(hint(&[("retry-after", &secs.to_string())]), Some(Duration::from_secs(secs)));
            prop_assert_eq!(hint(&[("retry-after-ms", &millis.to_string())]), Some(Duration::from_millis(millis)));
            prop_assert_eq!(hint(&[("x-ms-retry-after-ms", &millis.to_string())]), Some(Duration::from_millis(millis)));
            let at = UNIX_EPOCH + Duration::from_millis(NOW) + Duration::from_secs(ahead);
            let date = httpdate::fmt_http_date(at);
            prop_assert_eq!(hint(&[("retry-after", &date)]), Some(Duration::from_secs(ahead)));
            let past = UNIX_EPOCH + Duration::from_millis(NOW) - Duration::from_secs(ahead);
            prop_assert_eq!(hint(&[("retry-after", &httpdate::fmt_http_date(past))]), None);
            // Negative values never parse.
            prop_assert_eq!(hint(&[("retry-after", &format!("-{}", secs + 1))]), None);
        }

    }
}
