//! Admission of generation requests, fair between tenants: at most `max_concurrent` requests
//! hold a permit (are in the engine); at most `max_queued` more wait, and at most
//! `max_queued_per_tenant` of one tenant; past either, 429 at once with the limit named.
//!
//! A freed permit goes to the tenant holding the fewest permits per unit of weight (ties: the
//! one whose request waited longest), and within a tenant to its best-ranked request (lowest
//! `priority`, then arrival). So a tenant that queues a burst gets its share, not the whole
//! server: another tenant's next request gets the next free permit. The engine's scheduler
//! applies the same rule to the seats it runs ([`novainfer_core::scheduler::policy`]).
//!
//! A waiter that leaves (timeout, cancel, client gone) drops its place; a permit handed to a
//! waiter that left at the same moment comes back through its drop.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use novainfer_core::Tenant;
use tokio::sync::oneshot;

use crate::error::ApiError;

pub struct FairAdmission {
    state: Arc<Mutex<State>>,
    max_concurrent: usize,
    max_queued: usize,
    max_queued_per_tenant: Option<usize>,
}

#[derive(Default)]
struct State {
    free: usize,
    /// Permits held, per tenant id.
    held: HashMap<u64, usize>,
    queues: HashMap<u64, TenantQueue>,
    num_queued: usize,
    next_seq: u64,
}

struct TenantQueue {
    tenant: Tenant,
    /// By (priority, arrival).
    waiters: BTreeMap<(i32, u64), oneshot::Sender<Permit>>,
}

/// The right to be in the engine; dropping it passes the permit on.
pub struct Permit {
    /// `None`: disarmed (never handed out), nothing to release.
    state: Option<Arc<Mutex<State>>>,
    tenant: u64,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(state) = self.state.take() {
            let mut s = lock(&state);
            if let Some(n) = s.held.get_mut(&self.tenant) {
                *n -= 1;
                if *n == 0 {
                    s.held.remove(&self.tenant);
                }
            }
            s.free += 1;
            dispatch(&state, &mut s);
        }
    }
}

/// A permit now, or a place in the queue.
pub enum Ticket {
    Ready(Permit),
    Queued(Place),
}

/// A place in a tenant's queue; dropping it before it is served leaves the queue.
pub struct Place {
    state: Arc<Mutex<State>>,
    tenant: u64,
    key: (i32, u64),
    rx: oneshot::Receiver<Permit>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut s = lock(&self.state);
        let removed = s
            .queues
            .get_mut(&self.tenant)
            .and_then(|q| q.waiters.remove(&self.key))
            .is_some();
        if removed {
            s.num_queued -= 1;
            if s.queues
                .get(&self.tenant)
                .is_some_and(|q| q.waiters.is_empty())
            {
                s.queues.remove(&self.tenant);
            }
        }
    }
}

impl Ticket {
    /// Waits (in the queue, if queued) for a permit.
    pub async fn wait(self) -> Result<Permit, ApiError> {
        match self {
            Ticket::Ready(permit) => Ok(permit),
            Ticket::Queued(mut place) => (&mut place.rx)
                .await
                .map_err(|_| ApiError::unavailable("the server is shutting down")),
        }
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // The state stays consistent between statements; a panic elsewhere must not wedge it.
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hands free permits to waiters, fairest tenant first.
fn dispatch(state: &Arc<Mutex<State>>, s: &mut State) {
    while s.free > 0 {
        let Some(tenant) = fairest_waiting(s) else {
            return;
        };
        let queue = s.queues.get_mut(&tenant).expect("picked among the queues");
        let (_, tx) = queue.waiters.pop_first().expect("picked a non-empty queue");
        if queue.waiters.is_empty() {
            s.queues.remove(&tenant);
        }
        s.num_queued -= 1;
        s.free -= 1;
        *s.held.entry(tenant).or_default() += 1;
        let permit = Permit {
            state: Some(state.clone()),
            tenant,
        };
        if let Err(mut unsent) = tx.send(permit) {
            // The waiter is gone; take the permit back here (its drop would lock again).
            unsent.state = None;
            s.free += 1;
            if let Some(n) = s.held.get_mut(&tenant) {
                *n -= 1;
            }
        }
    }
}

/// The waiting tenant with the fewest permits per unit of weight; ties by oldest waiter.
fn fairest_waiting(s: &State) -> Option<u64> {
    let held = |id: u64| s.held.get(&id).copied().unwrap_or(0) as u128;
    s.queues
        .iter()
        .filter_map(|(&id, q)| {
            let oldest = q.waiters.keys().map(|k| k.1).min()?;
            Some((id, u128::from(q.tenant.weight.get()), oldest))
        })
        .min_by(|a, b| {
            // held(a)/w(a) vs held(b)/w(b), cross-multiplied.
            (held(a.0) * b.1)
                .cmp(&(held(b.0) * a.1))
                .then(a.2.cmp(&b.2))
        })
        .map(|(id, _, _)| id)
}

impl FairAdmission {
    pub fn new(
        max_concurrent: usize,
        max_queued: usize,
        max_queued_per_tenant: Option<usize>,
    ) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                free: max_concurrent,
                ..State::default()
            })),
            max_concurrent,
            max_queued,
            max_queued_per_tenant,
        }
    }

    /// A permit or a queue place at once; 429 when the queue, or the tenant's part of it, is
    /// full. Deciding this before answering lets a stream wait for its permit while already
    /// sending keep-alives.
    pub fn reserve(&self, tenant: Tenant, priority: i32) -> Result<Ticket, ApiError> {
        let mut s = lock(&self.state);
        if s.free > 0 && s.num_queued == 0 {
            s.free -= 1;
            *s.held.entry(tenant.id).or_default() += 1;
            return Ok(Ticket::Ready(Permit {
                state: Some(self.state.clone()),
                tenant: tenant.id,
            }));
        }
        if s.num_queued >= self.max_queued {
            return Err(ApiError::too_many_requests(
                format!(
                    "the server is at capacity for requests (--max-concurrent-requests {}, \
                     --max-queued-requests {}); retry later",
                    self.max_concurrent, self.max_queued
                ),
                "server_overloaded",
                1,
            ));
        }
        let mine = s.queues.get(&tenant.id).map_or(0, |q| q.waiters.len());
        if let Some(cap) = self.max_queued_per_tenant.filter(|&cap| mine >= cap) {
            return Err(ApiError::too_many_requests(
                format!(
                    "this tenant already has {mine} requests queued \
                     (--max-queued-requests-per-tenant {cap}); retry later"
                ),
                "tenant_queue_full",
                1,
            ));
        }
        let key = (priority, s.next_seq);
        s.next_seq += 1;
        let (tx, rx) = oneshot::channel();
        s.queues
            .entry(tenant.id)
            .or_insert_with(|| TenantQueue {
                tenant,
                waiters: BTreeMap::new(),
            })
            .waiters
            .insert(key, tx);
        s.num_queued += 1;
        Ok(Ticket::Queued(Place {
            state: self.state.clone(),
            tenant: tenant.id,
            key,
            rx,
        }))
    }

    pub fn num_running(&self) -> usize {
        self.max_concurrent - lock(&self.state).free
    }

    pub fn num_queued(&self) -> usize {
        lock(&self.state).num_queued
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU32;

    fn tenant(id: u64, weight: u32) -> Tenant {
        Tenant {
            id,
            weight: NonZeroU32::new(weight).expect("nonzero"),
        }
    }

    fn ready(t: Result<Ticket, ApiError>) -> Permit {
        match t {
            Ok(Ticket::Ready(p)) => p,
            _ => panic!("expected a permit"),
        }
    }

    fn queued(t: Result<Ticket, ApiError>) -> Place {
        match t {
            Ok(Ticket::Queued(p)) => p,
            _ => panic!("expected a place in the queue"),
        }
    }

    fn served(place: &mut Place) -> Option<Permit> {
        place.rx.try_recv().ok()
    }

    #[test]
    fn a_freed_permit_goes_to_the_tenant_furthest_below_its_share() {
        let a = FairAdmission::new(2, 100, None);
        let (flood, other) = (tenant(1, 1), tenant(2, 1));
        let p1 = ready(a.reserve(flood, 0));
        let _p2 = ready(a.reserve(flood, 0));
        let mut flood_waiting: Vec<Place> = (0..5).map(|_| queued(a.reserve(flood, 0))).collect();
        let mut mine = queued(a.reserve(other, 0));
        drop(p1);
        // Five of the flood queued first, but the other tenant holds nothing: it goes next.
        let _mine = served(&mut mine).expect("the other tenant is served");
        assert!(flood_waiting.iter_mut().all(|p| served(p).is_none()));
        assert_eq!(a.num_queued(), 5);
    }

    #[test]
    fn weights_split_permits_in_proportion() {
        let a = FairAdmission::new(1, 100, None);
        let (heavy, light) = (tenant(1, 3), tenant(2, 1));
        let first = ready(a.reserve(light, 0));
        let mut places: Vec<(u64, Place)> = Vec::new();
        for _ in 0..8 {
            places.push((2, queued(a.reserve(light, 0))));
            places.push((1, queued(a.reserve(heavy, 0))));
        }
        // Hold 4 permits at once by widening the pool: grant one at a time and keep them.
        drop(first);
        let mut held = Vec::new();
        let mut grants = Vec::new();
        for _ in 0..4 {
            let (who, permit) = places
                .iter_mut()
                .find_map(|(who, p)| served(p).map(|permit| (*who, permit)))
                .expect("one waiter was served");
            grants.push(who);
            held.push(permit);
            // Another permit frees up (as if the pool were wider), keeping the held ones.
            lock(&a.state).free += 1;
            let state = a.state.clone();
            dispatch(&state, &mut lock(&state));
        }
        // Holding 0:0, then heavy is at 1/3 < light's 1, and so on: 3 of 4 to the heavy one.
        assert_eq!(grants.iter().filter(|&&w| w == 1).count(), 3, "{grants:?}");
    }

    #[test]
    fn within_a_tenant_lower_priority_values_go_first() {
        let a = FairAdmission::new(1, 100, None);
        let t = tenant(1, 1);
        let p = ready(a.reserve(t, 0));
        let mut late = queued(a.reserve(t, 5));
        let mut urgent = queued(a.reserve(t, -1));
        drop(p);
        let _urgent = served(&mut urgent).expect("the urgent one is served");
        assert!(served(&mut late).is_none());
    }

    #[test]
    fn the_tenant_cap_and_the_global_cap_are_429s_naming_their_flag() {
        let a = FairAdmission::new(1, 3, Some(2));
        let (t1, t2) = (tenant(1, 1), tenant(2, 1));
        let _p = ready(a.reserve(t1, 0));
        let _q1 = queued(a.reserve(t1, 0));
        let _q2 = queued(a.reserve(t1, 0));
        let e = a.reserve(t1, 0).err().expect("tenant cap");
        assert_eq!(
            (e.status.as_u16(), e.code),
            (429, Some("tenant_queue_full"))
        );
        assert!(
            e.message.contains("--max-queued-requests-per-tenant 2"),
            "{}",
            e.message
        );
        let _q3 = queued(a.reserve(t2, 0));
        let e = a.reserve(t2, 0).err().expect("global cap");
        assert!(
            e.message.contains("--max-queued-requests 3"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_waiter_that_leaves_gives_its_place_and_any_permit_back() {
        let a = FairAdmission::new(1, 100, None);
        let t = tenant(1, 1);
        let p = ready(a.reserve(t, 0));
        let gone = queued(a.reserve(t, 0));
        let mut next = queued(a.reserve(t, 0));
        drop(gone);
        assert_eq!(a.num_queued(), 1);
        drop(p);
        let permit = served(&mut next).expect("served after the one that left");
        assert_eq!(a.num_running(), 1);
        drop(permit);
        assert_eq!((a.num_running(), a.num_queued()), (0, 0));
        // Served, then dropped before it looked: the permit comes back.
        let p = ready(a.reserve(t, 0));
        let place = queued(a.reserve(t, 0));
        drop(p);
        drop(place);
        assert_eq!(a.num_running(), 0);
    }
}
