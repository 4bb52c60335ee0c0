//! The order requests are served in: the scheduling policy, priority aging, and the fair
//! share between tenants.
//!
//! - **FCFS**: arrival order (a preempted request goes back to the front).
//! - **Priority**: lower `priority` first, then arrival (vLLM's `priority` policy). A waiting
//!   request gains one level per `priority_aging_steps` steps since it arrived, so a request
//!   of priority `p` waits at most `(p - q + 1) × priority_aging_steps` steps for requests of
//!   priority `q` that keep arriving, then goes before them: nothing waits forever.
//! - **Fair share** (either policy): when several tenants have requests waiting, the next
//!   seat goes to the tenant holding the fewest running seats per unit of weight; within a
//!   tenant, the policy's order holds. Tenants rank above priorities on purpose: a client
//!   sets its own priority, so it must not buy another tenant's share with it.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use crate::ids::AdapterId;
use crate::request::{Request, Tenant};
use crate::sampling_params::ParamError;

/// How waiting requests are ordered, and which running one is preempted first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SchedulingPolicy {
    /// First come, first served; the newest running request is preempted first.
    #[default]
    Fcfs,
    /// Lowest `priority` value first (ties by arrival, with aging); the running request with
    /// the highest value, newest among equals, is preempted first.
    Priority,
}

impl SchedulingPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            SchedulingPolicy::Fcfs => "fcfs",
            SchedulingPolicy::Priority => "priority",
        }
    }
}

impl fmt::Display for SchedulingPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SchedulingPolicy {
    type Err = ParamError;
    fn from_str(s: &str) -> Result<Self, ParamError> {
        match s {
            "fcfs" => Ok(SchedulingPolicy::Fcfs),
            "priority" => Ok(SchedulingPolicy::Priority),
            other => Err(ParamError::new(
                "scheduling_policy",
                format!("must be fcfs or priority, got {other:?}"),
            )),
        }
    }
}

/// A request's place under the priority policy: smaller goes first.
///
/// Aging makes a request one level better per `aging_steps` steps waited. Every request ages
/// alike, so comparing `priority - age / aging_steps` between two requests is comparing
/// `priority × aging_steps + arrival_step`: a level is worth `aging_steps` steps of arrival,
/// and the order of two requests never changes with time. Counting age in whole levels would
/// not do: two requests' order would flip each time one of them crossed a level boundary,
/// and two that cannot share the KV pool would preempt each other for ever (the property
/// test found such a pair).
pub(super) fn priority_key(request: &Request, aging_steps: u64) -> (i128, u64) {
    let virtual_arrival =
        i128::from(request.priority) * i128::from(aging_steps) + i128::from(request.arrival_step);
    (virtual_arrival, request.arrival_seq)
}

/// Running seats per tenant, for picking whose waiting request is admitted next.
#[derive(Debug, Default)]
pub(super) struct Seats(HashMap<u64, usize>);

impl Seats {
    pub(super) fn of<'a>(running: impl Iterator<Item = &'a Request>) -> Self {
        let mut seats = Self::default();
        for r in running {
            seats.take(r.tenant);
        }
        seats
    }

    pub(super) fn take(&mut self, tenant: Tenant) {
        *self.0.entry(tenant.id).or_default() += 1;
    }

    /// Whether `a` holds fewer seats per unit of weight than `b` (strictly).
    pub(super) fn fewer(&self, a: Tenant, b: Tenant) -> bool {
        let held = |t: Tenant| self.0.get(&t.id).copied().unwrap_or(0) as u128;
        held(a) * u128::from(b.weight.get()) < held(b) * u128::from(a.weight.get())
    }
}

/// The distinct LoRA adapters of the running requests, against `max_loras`.
#[derive(Debug)]
pub(super) struct RunningAdapters {
    held: Vec<AdapterId>,
    max: Option<usize>,
}

impl RunningAdapters {
    pub(super) fn of<'a>(running: impl Iterator<Item = &'a Request>, max: Option<usize>) -> Self {
        let mut adapters = Self {
            held: Vec::new(),
            max,
        };
        for r in running {
            adapters.take(r.adapter);
        }
        adapters
    }

    /// Whether a request on `adapter` may start now: the base model always may, an adapter
    /// already running may, another one only while fewer than `max_loras` run.
    pub(super) fn admits(&self, adapter: Option<AdapterId>) -> bool {
        match (adapter, self.max) {
            (None, _) | (_, None) => true,
            (Some(a), Some(max)) => self.held.contains(&a) || self.held.len() < max,
        }
    }

    pub(super) fn take(&mut self, adapter: Option<AdapterId>) {
        if let Some(a) = adapter {
            if !self.held.contains(&a) {
                self.held.push(a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RequestId;
    use std::num::NonZeroU32;

    #[test]
    fn policies_parse_and_a_bad_one_names_its_field() {
        assert_eq!("fcfs".parse(), Ok(SchedulingPolicy::Fcfs));
        assert_eq!("priority".parse(), Ok(SchedulingPolicy::Priority));
        let err = "lifo".parse::<SchedulingPolicy>().unwrap_err();
        assert_eq!(err.param, "scheduling_policy");
    }

    #[test]
    fn a_priority_level_is_worth_aging_steps_of_arrival() {
        let at = |priority: i32, step: u64, seq: u64| {
            let mut r = Request::new(RequestId(seq), vec![1], 1).with_priority(priority);
            r.arrival_step = step;
            r.arrival_seq = seq;
            priority_key(&r, 100)
        };
        // Priority 3 at step 10 against priority 2 arriving 100 steps later: a tie, and the
        // earlier arrival goes first.
        assert!(at(3, 10, 1) < at(2, 110, 2));
        // One step sooner, the better level wins.
        assert!(at(2, 109, 2) < at(3, 10, 1));
        // Extreme priorities and arrival steps do not overflow.
        assert!(at(i32::MIN, u64::MAX, 2) < at(i32::MAX, u64::MAX, 1));
    }

    #[test]
    fn seats_compare_per_unit_of_weight() {
        let t = |id, w| Tenant {
            id,
            weight: NonZeroU32::new(w).unwrap(),
        };
        let (heavy, light) = (t(1, 3), t(2, 1));
        let mut seats = Seats::default();
        for _ in 0..2 {
            seats.take(heavy);
        }
        seats.take(light);
        // 2/3 < 1/1: the weight-3 tenant is further below its share.
        assert!(seats.fewer(heavy, light));
        seats.take(heavy);
        // 3/3 vs 1/1: equal, neither is strictly fewer.
        assert!(!seats.fewer(heavy, light) && !seats.fewer(light, heavy));
    }
}
