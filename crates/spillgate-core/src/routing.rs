//! Which backends may serve a model, in which order: pools of priority tiers, and the
//! selection rule over them.
//!
//! Pools are built once per config load, so the request path only walks small slices.
//! Selection is a pure function of the pool, a predicate saying which backends are usable
//! for this request right now (not cooling, not already tried), and a seeded RNG: the
//! rules (strict tiers, weighted choice inside a tier) are unit- and property-tested
//! without clocks or sockets.

use std::collections::BTreeMap;

use crate::config::BackendConfig;

/// Index of a backend in `Config::backends`.
pub type BackendId = usize;

/// Backends of one priority level in a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tier {
    pub priority: u32,
    /// `(backend, weight)`, in config order.
    pub members: Vec<(BackendId, u32)>,
}

/// The backends that serve one model, grouped by priority (lowest number first).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Pool {
    pub tiers: Vec<Tier>,
}

impl Pool {
    /// Every member, highest tier first, config order inside a tier.
    pub fn members(&self) -> impl Iterator<Item = BackendId> + '_ {
        self.tiers
            .iter()
            .flat_map(|t| t.members.iter().map(|(id, _)| *id))
    }

    /// Picks a backend: the first tier (lowest priority number) that has a usable member
    /// wins, and inside it a member is drawn with probability proportional to its weight.
    pub fn select(
        &self,
        usable: impl Fn(BackendId) -> bool,
        rng: &mut fastrand::Rng,
    ) -> Option<BackendId> {
        let (members, total) = self.first_usable_tier(|id| usable(id).then_some(()))?;
        draw(&members, total, rng).map(|i| members[i].0)
    }

    /// Like [`Pool::select`], but inside the winning tier draws two members (by weight)
    /// and keeps the one with the higher `score` (e.g. the share of its token limit still
    /// free): the power of two choices, so throttling is avoided before it happens. With
    /// an unknown score for either, the first draw stands. `eligible` returns what the
    /// caller found out about a usable member (`None`: not usable); the winner's comes
    /// back with it. Two draws of the same member (always, when one member of the tier
    /// is usable) score nothing: the gateway's score reads a deployment's capacity
    /// under its lock.
    pub fn select_scored<T>(
        &self,
        eligible: impl Fn(BackendId) -> Option<T>,
        score: impl Fn(&T) -> Option<f64>,
        rng: &mut fastrand::Rng,
    ) -> Option<(BackendId, T)> {
        let (mut members, total) = self.first_usable_tier(eligible)?;
        let a = draw(&members, total, rng)?;
        let b = draw(&members, total, rng)?;
        let pick = if a == b {
            a
        } else {
            match (score(&members[a].2), score(&members[b].2)) {
                (Some(x), Some(y)) if y > x => b,
                _ => a,
            }
        };
        let (id, _, found) = members.swap_remove(pick);
        Some((id, found))
    }

    /// The usable members of the highest tier that has any (with what `eligible` said of
    /// each), and their total weight. `eligible` is asked once per member: live state may
    /// change between calls, and a member seen usable must stay drawable.
    fn first_usable_tier<T>(
        &self,
        eligible: impl Fn(BackendId) -> Option<T>,
    ) -> Option<(Drawables<T>, u64)> {
        self.tiers.iter().find_map(|tier| {
            let members: Drawables<T> = tier
                .members
                .iter()
                .filter_map(|(id, w)| eligible(*id).map(|t| (*id, *w, t)))
                .collect();
            let total: u64 = members.iter().map(|(_, w, _)| u64::from(*w)).sum();
            (total > 0).then_some((members, total))
        })
    }
}

/// A usable member: its id, weight, and what `eligible` said of it.
type Drawable<T> = (BackendId, u32, T);
/// The usable members of a tier: on the stack up to eight (a request draws from them
/// at least once).
type Drawables<T> = smallvec::SmallVec<[Drawable<T>; 8]>;

/// Index of a member drawn with probability proportional to its weight.
fn draw<T>(members: &[Drawable<T>], total: u64, rng: &mut fastrand::Rng) -> Option<usize> {
    let mut d = rng.u64(0..total);
    for (i, (_, w, _)) in members.iter().enumerate() {
        let w = u64::from(*w);
        if d < w {
            return Some(i);
        }
        d -= w;
    }
    None
}

/// How a route names the models it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelPattern {
    Exact(String),
    /// `*` matches any run of characters, `?` any one character.
    Glob(String),
}

impl ModelPattern {
    pub fn parse(s: &str) -> ModelPattern {
        if s.contains(['*', '?']) {
            ModelPattern::Glob(s.to_string())
        } else {
            ModelPattern::Exact(s.to_string())
        }
    }

    pub fn matches(&self, model: &str) -> bool {
        match self {
            ModelPattern::Exact(m) => m == model,
            ModelPattern::Glob(g) => glob_match(g.as_bytes(), model.as_bytes()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            ModelPattern::Exact(s) | ModelPattern::Glob(s) => s,
        }
    }
}

/// Iterative glob matcher with single-star backtracking: linear in practice, no
/// recursion, so a hostile model name cannot blow the stack.
fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && (pattern[p] == b'?' || pattern[p] == text[t]) {
            p += 1;
            t += 1;
        } else if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, t));
            p += 1;
        } else if let Some((sp, st)) = star {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|c| *c == b'*')
}

/// Index of a route in [`RoutingTable::routes`].
pub type RouteId = usize;

/// Models matched by a route, the pool that serves them, and the route's policies.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub name: String,
    pub patterns: Vec<ModelPattern>,
    pub pool: Pool,
    /// Models to try, in order, when this route's pool has no backend left.
    pub fallback: Vec<String>,
    pub retry: crate::config::RetryPolicy,
    pub deadline: Option<std::time::Duration>,
}

/// Which route serves which model.
///
/// Without `[[routes]]` in the config there is one implicit route: every backend, with
/// each backend's own priority and weight, for any model a backend serves. With routes, a
/// model is served by the first route with an exact match, else the first route (in
/// config order) with a matching glob, else by nobody.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RoutingTable {
    pub routes: Vec<Route>,
    exact: BTreeMap<String, RouteId>,
    globs: Vec<(ModelPattern, RouteId)>,
    /// Model names to list in `GET /v1/models`.
    listed: Vec<String>,
}

impl RoutingTable {
    pub fn new(routes: Vec<Route>, backends: &[BackendConfig]) -> RoutingTable {
        let mut exact = BTreeMap::new();
        let mut globs = Vec::new();
        for (id, r) in routes.iter().enumerate() {
            for p in &r.patterns {
                match p {
                    ModelPattern::Exact(m) => {
                        exact.entry(m.clone()).or_insert(id);
                    }
                    ModelPattern::Glob(_) => globs.push((p.clone(), id)),
                }
            }
        }
        let mut listed: Vec<String> = backends
            .iter()
            .filter_map(|b| b.deployments.as_ref())
            .flat_map(|m| m.keys().cloned())
            .chain(exact.keys().cloned())
            .collect();
        listed.sort_unstable();
        listed.dedup();
        RoutingTable {
            routes,
            exact,
            globs,
            listed,
        }
    }

    /// The route for `model`: the first route naming it exactly, if its pool has a
    /// backend that serves it; else the first route (in config order) whose glob matches
    /// and whose pool serves it. A glob route that matches but cannot serve the model
    /// does not hide a later one that can; a later route naming the same exact model is
    /// never consulted.
    pub fn route_for(&self, model: &str, backends: &[BackendConfig]) -> Option<RouteId> {
        let serves = |id: &RouteId| {
            self.routes[*id]
                .pool
                .members()
                .any(|b| backends[b].deployment_for(model).is_some())
        };
        self.exact.get(model).copied().filter(serves).or_else(|| {
            self.globs
                .iter()
                .filter(|(p, _)| p.matches(model))
                .map(|(_, id)| *id)
                .find(serves)
        })
    }

    /// `model` when the config names it, else `other`: a bounded metric label.
    pub fn model_label<'a>(&self, model: &'a str) -> &'a str {
        if self.model_index(model).is_some() {
            model
        } else {
            "other"
        }
    }

    /// Where the config lists `model` among the names [`Self::model_label`] keeps.
    pub fn model_index(&self, model: &str) -> Option<usize> {
        self.listed.binary_search_by(|m| m.as_str().cmp(model)).ok()
    }

    /// Model names clients can list (`GET /v1/models`): names in backends' `deployments`
    /// and exact names in routes.
    pub fn model_names(&self) -> impl Iterator<Item = &str> {
        self.listed.iter().map(String::as_str)
    }
}

/// The pool of the implicit route: every backend with its own priority and weight.
pub fn pool_of_all(backends: &[BackendConfig]) -> Pool {
    let members: Vec<_> = backends
        .iter()
        .enumerate()
        .map(|(id, b)| (id, b.priority, b.weight))
        .collect();
    pool_from(&members)
}

/// A pool from explicit `(backend, priority, weight)` members.
pub fn pool_from(members: &[(BackendId, u32, u32)]) -> Pool {
    let mut by_priority: BTreeMap<u32, Vec<(BackendId, u32)>> = BTreeMap::new();
    for (id, priority, weight) in members {
        by_priority
            .entry(*priority)
            .or_default()
            .push((*id, *weight));
    }
    Pool {
        tiers: by_priority
            .into_iter()
            .map(|(priority, members)| Tier { priority, members })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BackendKind, RetryPolicy, Secret};
    use proptest::prelude::*;
    use std::sync::Arc;

    fn backend(
        name: &str,
        priority: u32,
        weight: u32,
        deployments: Option<&[(&str, &str)]>,
    ) -> BackendConfig {
        BackendConfig {
            name: Arc::from(name),
            kind: BackendKind::Azure,
            url: Arc::from("https://x.openai.azure.com"),
            priority,
            weight,
            api_key: Some(Secret::new("k".into())),
            entra: None,
            deployments: deployments.map(|d| {
                d.iter()
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .collect()
            }),
            breaker: None,
            health_check: None,
            azure_api: crate::config::AzureApi::Classic,
            api_version: crate::config::DEFAULT_AZURE_API_VERSION.to_string(),
        }
    }

    fn route(name: &str, models: &[&str], members: &[(BackendId, u32, u32)]) -> Route {
        Route {
            name: name.to_string(),
            patterns: models.iter().map(|m| ModelPattern::parse(m)).collect(),
            pool: pool_from(members),
            fallback: Vec::new(),
            retry: RetryPolicy::default(),
            deadline: None,
        }
    }

    #[test]
    fn globs() {
        let g = |p: &str, t: &str| ModelPattern::parse(p).matches(t);
        assert!(g("gpt-4o*", "gpt-4o"));
        assert!(g("gpt-4o*", "gpt-4o-mini"));
        assert!(!g("gpt-4o*", "gpt-4"));
        assert!(g("*", "anything"));
        assert!(g("gpt-?o", "gpt-4o"));
        assert!(g("*-mini", "gpt-4o-mini"));
        assert!(g("a*b*c", "aXXbYYc"));
        assert!(!g("a*b*c", "aXXbYY"));
        assert!(g("gpt-35-turbo-16k", "gpt-35-turbo-16k"));
        assert!(!g("gpt-35-turbo-16k", "gpt-35-turbo"));
        // Pathological input stays fast (no exponential backtracking).
        let long = "a".repeat(10_000);
        assert!(!g("*a*a*a*a*a*b", &long));
    }

    #[test]
    fn exact_beats_glob_and_first_glob_wins() {
        let bs = vec![backend("ptu", 1, 1, None), backend("paygo", 2, 1, None)];
        let t = RoutingTable::new(
            vec![
                route("everything", &["*"], &[(1, 1, 1)]),
                route("turbo16k", &["gpt-35-turbo-16k"], &[(0, 1, 1), (1, 2, 1)]),
                route("four", &["gpt-4o*"], &[(0, 1, 1)]),
            ],
            &bs,
        );
        assert_eq!(t.route_for("gpt-35-turbo-16k", &bs), Some(1));
        assert_eq!(
            t.route_for("gpt-4o", &bs),
            Some(0),
            "the first matching glob wins"
        );
        assert_eq!(t.route_for("whatever", &bs), Some(0));
        assert_eq!(
            t.model_names().collect::<Vec<_>>(),
            vec!["gpt-35-turbo-16k"]
        );
    }

    #[test]
    fn a_route_that_cannot_serve_a_model_does_not_hide_a_later_one() {
        let bs = vec![
            backend("four", 1, 1, Some(&[("gpt-4o", "d")])),
            backend("any", 2, 1, None),
        ];
        let t = RoutingTable::new(
            vec![
                route("fours", &["gpt-4o*"], &[(0, 1, 1)]),
                route("rest", &["*"], &[(1, 1, 1)]),
            ],
            &bs,
        );
        assert_eq!(t.route_for("gpt-4o", &bs), Some(0));
        assert_eq!(
            t.route_for("gpt-4o-mini", &bs),
            Some(1),
            "falls through to the catch-all"
        );
    }

    #[test]
    fn a_usable_member_stays_drawable_when_state_flips_between_calls() {
        use std::cell::Cell;
        let bs = vec![backend("a", 1, 1, None), backend("b", 1, 1, None)];
        let pool = pool_of_all(&bs);
        let mut rng = fastrand::Rng::with_seed(9);
        for _ in 0..200 {
            // Member 0 flips every time it is asked about, as a live probe slot can.
            let flip = Cell::new(false);
            let usable = |id: BackendId| {
                if id == 0 {
                    flip.set(!flip.get());
                    flip.get()
                } else {
                    true
                }
            };
            let eligible = |id| usable(id).then_some(());
            assert!(pool.select_scored(eligible, |_| None, &mut rng).is_some());
        }
    }

    #[test]
    fn a_route_only_serves_models_its_backends_have() {
        let bs = vec![
            backend("ptu", 1, 1, Some(&[("gpt-4o", "gpt4o-ptu")])),
            backend("mini", 1, 1, Some(&[("gpt-4o-mini", "mini")])),
        ];
        let t = RoutingTable::new(vec![route("all", &["*"], &[(0, 1, 1), (1, 1, 1)])], &bs);
        assert_eq!(t.route_for("gpt-4o", &bs), Some(0));
        assert_eq!(t.route_for("gpt-5", &bs), None);
        assert_eq!(
            t.model_names().collect::<Vec<_>>(),
            vec!["gpt-4o", "gpt-4o-mini"]
        );
    }

    #[test]
    fn pools_group_members_by_priority() {
        let p = pool_from(&[(0, 2, 1), (1, 1, 5), (2, 2, 3)]);
        assert_eq!(p.tiers.len(), 2);
        assert_eq!(
            p.tiers[0],
            Tier {
                priority: 1,
                members: vec![(1, 5)]
            }
        );
        assert_eq!(
            p.tiers[1],
            Tier {
                priority: 2,
                members: vec![(0, 1), (2, 3)]
            }
        );
        assert_eq!(p.members().collect::<Vec<_>>(), vec![1, 0, 2]);
    }

    #[test]
    fn select_prefers_first_tier_then_spills() {
        let bs = vec![
            backend("p1", 1, 1, None),
            backend("p2a", 2, 1, None),
            backend("p2b", 2, 1, None),
        ];
        let pool = pool_of_all(&bs);
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..100 {
            assert_eq!(pool.select(|_| true, &mut rng), Some(0));
        }
        for _ in 0..100 {
            let s = pool.select(|id| id != 0, &mut rng).unwrap();
            assert!(s == 1 || s == 2);
        }
        assert_eq!(pool.select(|_| false, &mut rng), None);
    }

    #[test]
    fn two_choices_prefer_headroom() {
        let bs = vec![backend("full", 1, 1, None), backend("empty", 1, 1, None)];
        let pool = pool_of_all(&bs);
        let mut rng = fastrand::Rng::with_seed(3);
        let score = |id: &BackendId| Some(if *id == 0 { 0.9 } else { 0.1 });
        let n = 10_000;
        let full = (0..n)
            .filter(|_| pool.select_scored(Some, score, &mut rng) == Some((0, 0)))
            .count();
        // Two draws pick the roomier one unless both land on the other: 1 - 1/4.
        let share = full as f64 / n as f64;
        assert!((share - 0.75).abs() < 0.02, "share {share}");
        // Unknown scores fall back to plain weighted choice.
        let half = (0..n)
            .filter(|_| pool.select_scored(Some, |_| None, &mut rng) == Some((0, 0)))
            .count();
        assert!((half as f64 / n as f64 - 0.5).abs() < 0.02);
    }

    #[test]
    fn a_member_drawn_twice_is_not_scored() {
        let scored = std::cell::Cell::new(0);
        let score = |_: &BackendId| {
            scored.set(scored.get() + 1);
            Some(0.5)
        };
        let mut rng = fastrand::Rng::with_seed(5);
        let one = vec![backend("only", 1, 1, None)];
        let pool = pool_of_all(&one);
        for _ in 0..100 {
            assert_eq!(pool.select_scored(Some, score, &mut rng), Some((0, 0)));
        }
        assert_eq!(scored.get(), 0, "a tier of one");
        // Two members: scored (twice) only when the draws differ.
        let two = vec![backend("a", 1, 1, None), backend("b", 1, 1, None)];
        let pool = pool_of_all(&two);
        let n = 10_000;
        for _ in 0..n {
            pool.select_scored(Some, score, &mut rng);
        }
        let share = scored.get() as f64 / (2 * n) as f64;
        assert!(
            (share - 0.5).abs() < 0.02,
            "scored in {share} of the selections"
        );
    }

    #[test]
    fn weights_split_traffic() {
        let bs = vec![backend("a", 1, 1, None), backend("b", 1, 3, None)];
        let pool = pool_of_all(&bs);
        let mut rng = fastrand::Rng::with_seed(1);
        let n = 40_000;
        let b = (0..n)
            .filter(|_| pool.select(|_| true, &mut rng) == Some(1))
            .count();
        let share = b as f64 / n as f64;
        assert!((share - 0.75).abs() < 0.02, "share {share}");
    }

    fn arb_pool() -> impl Strategy<Value = (Vec<BackendConfig>, Vec<bool>)> {
        prop::collection::vec((1u32..4, 1u32..10, any::<bool>()), 1..10).prop_map(|spec| {
            let bs = spec
                .iter()
                .enumerate()
                .map(|(i, (p, w, _))| backend(&format!("b{i}"), *p, *w, None))
                .collect();
            let ready = spec.iter().map(|(_, _, r)| *r).collect();
            (bs, ready)
        })
    }

    proptest! {
        /// Never a cooling backend while a ready one exists; never a lower tier while a
        /// higher tier has a ready backend.
        #[test]
        fn selection_respects_readiness_and_tiers((bs, ready) in arb_pool(), seed in any::<u64>()) {
            let pool = pool_of_all(&bs);
            let mut rng = fastrand::Rng::with_seed(seed);
            let chosen = pool.select(|id| ready[id], &mut rng);
            match chosen {
                None => prop_assert!(ready.iter().all(|r| !r)),
                Some(id) => {
                    prop_assert!(ready[id]);
                    let best = (0..bs.len()).filter(|&i| ready[i]).map(|i| bs[i].priority).min().unwrap();
                    prop_assert_eq!(bs[id].priority, best);
                }
            }
        }

        /// Over many draws, each ready member of the winning tier gets its weight share.
        #[test]
        fn weight_split_holds(weights in prop::collection::vec(1u32..8, 2..5), seed in any::<u64>()) {
            let bs: Vec<_> = weights.iter().enumerate().map(|(i, w)| backend(&format!("b{i}"), 1, *w, None)).collect();
            let pool = pool_of_all(&bs);
            let mut rng = fastrand::Rng::with_seed(seed);
            let n = 20_000usize;
            let mut counts = vec![0usize; bs.len()];
            for _ in 0..n {
                counts[pool.select(|_| true, &mut rng).unwrap()] += 1;
            }
            let total: u32 = weights.iter().sum();
            for (i, w) in weights.iter().enumerate() {
                let expected = f64::from(*w) / f64::from(total);
                let got = counts[i] as f64 / n as f64;
                prop_assert!((expected - got).abs() < 0.03, "backend {} expected {} got {}", i, expected, got);
            }
        }

        /// The scored choice keeps the same invariants: only usable members, only the
        /// best tier.
        #[test]
        fn scored_selection_respects_readiness_and_tiers((bs, ready) in arb_pool(), seed in any::<u64>(), scores in prop::collection::vec(prop::option::of(0.0f64..1.0), 10)) {
            let pool = pool_of_all(&bs);
            let mut rng = fastrand::Rng::with_seed(seed);
            let chosen = pool
                .select_scored(|id| ready[id].then_some(id), |id| scores[*id], &mut rng)
                .map(|(id, _)| id);
            match chosen {
                None => prop_assert!(ready.iter().all(|r| !r)),
                Some(id) => {
                    prop_assert!(ready[id]);
                    let best = (0..bs.len()).filter(|&i| ready[i]).map(|i| bs[i].priority).min().unwrap();
                    prop_assert_eq!(bs[id].priority, best);
                }
            }
        }

        #[test]
        fn glob_never_panics(p in "[a-z*?-]{0,12}", t in "[a-z-]{0,30}") {
            let _ = ModelPattern::parse(&p).matches(&t);
        }
    }
}
