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
    fn from_members(backends: &[BackendConfig], ids: impl Iterator<Item = BackendId>) -> Pool {
        let mut by_priority: BTreeMap<u32, Vec<(BackendId, u32)>> = BTreeMap::new();
        for id in ids {
            let b = &backends[id];
            by_priority
                .entry(b.priority)
                .or_default()
                .push((id, b.weight));
        }
        Pool {
            tiers: by_priority
                .into_iter()
                .map(|(priority, members)| Tier { priority, members })
                .collect(),
        }
    }

    /// Every member, highest tier first, config order inside a tier.
    pub fn members(&self) -> impl Iterator<Item = BackendId> + '_ {
        self.tiers
            .iter()
            .flat_map(|t| t.members.iter().map(|(id, _)| *id))
    }

    pub fn len(&self) -> usize {
        self.tiers.iter().map(|t| t.members.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.tiers.is_empty()
    }

    /// Picks a backend: the first tier (lowest priority number) that has a usable member
    /// wins, and inside it a member is drawn with probability proportional to its weight.
    /// Allocation-free: two passes over the tier.
    pub fn select(
        &self,
        usable: impl Fn(BackendId) -> bool,
        rng: &mut fastrand::Rng,
    ) -> Option<BackendId> {
        for tier in &self.tiers {
            let total: u64 = tier
                .members
                .iter()
                .filter(|(id, _)| usable(*id))
                .map(|(_, w)| u64::from(*w))
                .sum();
            if total == 0 {
                continue;
            }
            let mut draw = rng.u64(0..total);
            for (id, w) in &tier.members {
                if !usable(*id) {
                    continue;
                }
                let w = u64::from(*w);
                if draw < w {
                    return Some(*id);
                }
                draw -= w;
            }
        }
        None
    }

    /// The first member in config order of the highest tier that passes `usable`: the
    /// seeds' "send it to the first backend anyway" target.
    pub fn first(&self, usable: impl Fn(BackendId) -> bool) -> Option<BackendId> {
        self.members().find(|id| usable(*id))
    }
}

/// Pools per model name, plus the pool for models no backend names explicitly.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RoutingTable {
    /// Models named in some backend's `deployments`.
    pub by_model: BTreeMap<String, Pool>,
    /// Backends without a `deployments` map: they serve any model under its own name.
    pub any_model: Pool,
}

impl RoutingTable {
    pub fn build(backends: &[BackendConfig]) -> RoutingTable {
        let mut models: Vec<&str> = backends
            .iter()
            .filter_map(|b| b.deployments.as_ref())
            .flat_map(|m| m.keys().map(String::as_str))
            .collect();
        models.sort_unstable();
        models.dedup();
        let by_model = models
            .into_iter()
            .map(|model| {
                let ids =
                    (0..backends.len()).filter(|&id| backends[id].deployment_for(model).is_some());
                (model.to_string(), Pool::from_members(backends, ids))
            })
            .collect();
        let any_model = Pool::from_members(
            backends,
            (0..backends.len()).filter(|&id| backends[id].deployments.is_none()),
        );
        RoutingTable {
            by_model,
            any_model,
        }
    }

    /// The pool serving `model`, or `None` when no backend serves it.
    pub fn pool(&self, model: &str) -> Option<&Pool> {
        let pool = self.by_model.get(model).unwrap_or(&self.any_model);
        (!pool.is_empty()).then_some(pool)
    }

    /// Model names clients can list (`GET /v1/models`).
    pub fn model_names(&self) -> impl Iterator<Item = &str> {
        self.by_model.keys().map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BackendKind, Secret};
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
            deployments: deployments.map(|d| {
                d.iter()
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .collect()
            }),
        }
    }

    #[test]
    fn pools_group_by_model_and_priority() {
        let bs = vec![
            backend("ptu", 1, 1, Some(&[("gpt-4o", "gpt4o-ptu")])),
            backend("paygo-a", 2, 1, None),
            backend("paygo-b", 2, 3, None),
            backend("mini-only", 1, 1, Some(&[("gpt-4o-mini", "mini")])),
        ];
        let t = RoutingTable::build(&bs);
        let p = t.pool("gpt-4o").unwrap();
        assert_eq!(p.tiers.len(), 2);
        assert_eq!(p.tiers[0].members, vec![(0, 1)]);
        assert_eq!(p.tiers[1].members, vec![(1, 1), (2, 3)]);
        let p = t.pool("other").unwrap();
        assert_eq!(p.members().collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(
            t.pool("gpt-4o-mini").unwrap().members().collect::<Vec<_>>(),
            vec![3, 1, 2]
        );
        assert_eq!(
            t.model_names().collect::<Vec<_>>(),
            vec!["gpt-4o", "gpt-4o-mini"]
        );
    }

    #[test]
    fn unknown_model_has_no_pool_when_every_backend_has_a_map() {
        let bs = vec![backend("ptu", 1, 1, Some(&[("gpt-4o", "d")]))];
        let t = RoutingTable::build(&bs);
        assert!(t.pool("gpt-4o").is_some());
        assert!(t.pool("gpt-5").is_none());
    }

    #[test]
    fn select_prefers_first_tier_then_spills() {
        let bs = vec![
            backend("p1", 1, 1, None),
            backend("p2a", 2, 1, None),
            backend("p2b", 2, 1, None),
        ];
        let t = RoutingTable::build(&bs);
        let pool = t.pool("m").unwrap();
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..100 {
            assert_eq!(pool.select(|_| true, &mut rng), Some(0));
        }
        for _ in 0..100 {
            let s = pool.select(|id| id != 0, &mut rng).unwrap();
            assert!(s == 1 || s == 2);
        }
        assert_eq!(pool.select(|_| false, &mut rng), None);
        assert_eq!(pool.first(|id| id != 0), Some(1));
    }

    #[test]
    fn weights_split_traffic() {
        let bs = vec![backend("a", 1, 1, None), backend("b", 1, 3, None)];
        let t = RoutingTable::build(&bs);
        let pool = t.pool("m").unwrap();
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
            let t = RoutingTable::build(&bs);
            let pool = t.pool("m").unwrap();
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
            let t = RoutingTable::build(&bs);
            let pool = t.pool("m").unwrap();
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
    }
}
