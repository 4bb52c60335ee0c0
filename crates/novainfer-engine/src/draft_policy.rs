//! How many tokens to draft for each decoding request: as many as are expected to make the
//! step produce more tokens per second than a plain step would, by measured costs.
//!
//! A draft token pays when the chance it is accepted outweighs what it costs: one more row in
//! the target's step, plus (for a draft model) one more row and perhaps one more pass of the
//! draft model. Those costs differ by device, model pair and batch: on a GPU extra rows are
//! almost free, on a CPU 16 rows of the 0.5B model cost ~5× one row, and a 0.5B draft model
//! costs ~40% of a 1.5B target's step there. So the costs are measured as the engine runs
//! (linear in passes and rows, fitted by weighted least squares) and each step drafts the
//! lengths that maximise expected tokens per expected second. Acceptance is tracked per
//! request (the chance each next draft token is accepted, as in a geometric model), pulled
//! towards the engine-wide rate while a request has little history.

use std::collections::HashMap;

use novainfer_core::RequestId;

use crate::speculative::DraftPolicyKind;

/// Time of work that costs `per_pass` for each pass plus `per_row` for each row, fitted to
/// measurements by exponentially weighted least squares.
#[derive(Debug, Clone)]
pub struct PassCost {
    /// Weighted sums over measurements of (passes u, rows v, seconds y).
    uu: f64,
    uv: f64,
    vv: f64,
    uy: f64,
    vy: f64,
    /// What a row costs relative to a pass while the data cannot tell (all measurements at the
    /// same rows per pass): `per_row ≈ row_share · per_pass`.
    row_share: f64,
}

/// Each new measurement counts this much more than the one before it (memory ~50 measurements),
/// so the fit follows a changing machine load or batch mix.
const COST_DECAY: f64 = 0.98;
/// Weight of the `row_share` prior against the data, relative to the data's own weight.
const PRIOR_WEIGHT: f64 = 0.01;

impl PassCost {
    pub fn new(row_share: f64) -> Self {
        Self {
            uu: 0.0,
            uv: 0.0,
            vv: 0.0,
            uy: 0.0,
            vy: 0.0,
            row_share,
        }
    }

    /// One measurement: `passes` passes over `rows` rows in all took `seconds`.
    pub fn observe(&mut self, passes: usize, rows: usize, seconds: f64) {
        if passes == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let (u, v) = (passes as f64, rows as f64);
        for s in [
            &mut self.uu,
            &mut self.uv,
            &mut self.vv,
            &mut self.uy,
            &mut self.vy,
        ] {
            *s *= COST_DECAY;
        }
        self.uu += u * u;
        self.uv += u * v;
        self.vv += v * v;
        self.uy += u * seconds;
        self.vy += v * seconds;
    }

    /// `(per_pass, per_row)` seconds, or `None` before any measurement.
    ///
    /// Minimises the squared error plus `λ (per_row − row_share · per_pass)²`: with data at
    /// several row counts the data decides; with data at one ratio of rows to passes (a batch
    /// that never drafted) the prior splits the measured time between the two. Both stay ≥ 0.
    pub fn coefficients(&self) -> Option<(f64, f64)> {
        if self.uu <= 0.0 {
            return None;
        }
        let rho = self.row_share;
        let lambda = PRIOR_WEIGHT * self.uu;
        let (m00, m01, m11) = (
            self.uu + lambda * rho * rho,
            self.uv - lambda * rho,
            self.vv + lambda,
        );
        let det = m00 * m11 - m01 * m01;
        let (mut a, mut b) = if det > f64::EPSILON * m00 * m11 {
            (
                (self.uy * m11 - self.vy * m01) / det,
                (self.vy * m00 - self.uy * m01) / det,
            )
        } else {
            (self.uy / self.uu, 0.0)
        };
        if b < 0.0 {
            (a, b) = (self.uy / self.uu, 0.0);
        }
        if a < 0.0 {
            (a, b) = (
                0.0,
                if self.vv > 0.0 {
                    self.vy / self.vv
                } else {
                    0.0
                },
            );
        }
        Some((a.max(0.0), b.max(0.0)))
    }
}

/// A request's acceptance so far: decayed counts of accepted draft tokens and of tokens that
/// were put to the test (accepted ones plus the first rejected one).
#[derive(Debug, Clone, Copy, Default)]
struct Acceptance {
    accepted: f64,
    tried: f64,
    /// Decode steps since this request last drafted.
    idle_steps: u32,
}

/// Per request, a verification counts this much more than the one before: acceptance comes in
/// phases (copying a file, then writing something new), and drafts must follow them quickly.
const REQUEST_DECAY: f64 = 0.5;
/// Engine-wide acceptance: a slower average over every request's verifications.
const GLOBAL_DECAY: f64 = 0.98;
/// How many tokens' worth of the engine-wide rate a request's own history starts from.
const PRIOR_TOKENS: f64 = 1.0;
/// A request that stopped drafting drafts one token now and then, so the policy notices when
/// acceptance comes back (a code edit that copies again after a changed line). Probes may
/// cost this share of the time plain steps take: with prompt lookup, whose probe is one more
/// row, that is every ~10 steps on a CPU; with a draft model, whose probe also runs it and
/// catches it up on what it missed, far more rarely.
const PROBE_BUDGET: f64 = 0.03;
/// Probe intervals, in a request's decode steps: before costs are measured, and the bounds.
const PROBE_AFTER_STEPS: u32 = 64;
const PROBE_STEPS_MIN: u32 = 4;
const PROBE_STEPS_MAX: u32 = 512;

/// Chooses draft lengths from measured costs and acceptance.
#[derive(Debug, Clone)]
pub struct DraftPolicy {
    max_tokens: usize,
    kind: DraftPolicyKind,
    /// The target's decode step: one pass, a row per decode and per draft token.
    target: PassCost,
    /// The draft model's proposals (none for prompt lookup, which costs next to nothing):
    /// passes and rows fed.
    draft: Option<PassCost>,
    requests: HashMap<RequestId, Acceptance>,
    global_accepted: f64,
    global_tried: f64,
}

/// One request's view for [`DraftPolicy::plan`].
#[derive(Debug, Clone, Copy)]
struct Candidate {
    alpha: f64,
    probe: bool,
}

impl DraftPolicy {
    /// `row_share`: what a row is assumed to cost relative to a pass until measurements at
    /// several row counts say otherwise; `draft_model`: whether drafting runs a model.
    pub fn new(
        max_tokens: usize,
        kind: DraftPolicyKind,
        row_share: f64,
        draft_model: bool,
    ) -> Self {
        Self {
            max_tokens,
            kind,
            target: PassCost::new(row_share),
            draft: draft_model.then(|| PassCost::new(row_share)),
            requests: HashMap::new(),
            // Optimistic until measured: a new engine drafts, and learns.
            global_accepted: 0.8,
            global_tried: 1.0,
        }
    }

    /// A pure decode step of the target over `rows` rows took `seconds`.
    pub fn observe_step(&mut self, rows: usize, seconds: f64) {
        self.target.observe(1, rows, seconds);
    }

    /// The draft model ran `passes` passes over `rows` rows in all, in `seconds`.
    pub fn observe_draft(&mut self, passes: usize, rows: usize, seconds: f64) {
        if let Some(draft) = self.draft.as_mut() {
            draft.observe(passes, rows, seconds);
        }
    }

    /// The verification of `id`'s draft of `drafted` tokens accepted `accepted` of them.
    pub fn record(&mut self, id: RequestId, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        // The first rejected token was tried too; a fully accepted draft tried only its own.
        let tried = (accepted + usize::from(accepted < drafted)) as f64;
        let a = self.requests.entry(id).or_default();
        a.accepted = REQUEST_DECAY * a.accepted + accepted as f64;
        a.tried = REQUEST_DECAY * a.tried + tried;
        self.global_accepted = GLOBAL_DECAY * self.global_accepted + accepted as f64;
        self.global_tried = GLOBAL_DECAY * self.global_tried + tried;
    }

    /// The chance `id`'s next draft token is accepted.
    fn alpha(&self, id: RequestId) -> f64 {
        let global = self.global_accepted / self.global_tried.max(f64::MIN_POSITIVE);
        let a = self.requests.get(&id).copied().unwrap_or_default();
        ((a.accepted + PRIOR_TOKENS * global) / (a.tried + PRIOR_TOKENS)).clamp(0.0, 0.999)
    }

    /// Draft lengths for the decoding requests `ids` (each request's at most the configured
    /// number, `room` tokens in all): the lengths with the most expected tokens per expected
    /// second, none when no draft is expected to beat a plain step.
    pub fn plan(&mut self, ids: &[RequestId], room: usize) -> Vec<usize> {
        let probe_after = self.probe_interval(ids.len());
        let candidates: Vec<Candidate> = ids
            .iter()
            .map(|id| Candidate {
                alpha: self.alpha(*id),
                probe: self
                    .requests
                    .get(id)
                    .is_some_and(|a| a.idle_steps >= probe_after),
            })
            .collect();
        let lengths = self.best_lengths(&candidates, room);
        tracing::debug!(
            target: "novainfer::draft_policy",
            step = ?self.target.coefficients(),
            draft = ?self.draft.as_ref().and_then(PassCost::coefficients),
            alpha = ?candidates.iter().map(|c| c.alpha).collect::<Vec<_>>(),
            ?lengths,
            "draft lengths"
        );
        for (id, &k) in ids.iter().zip(&lengths) {
            let a = self.requests.entry(*id).or_default();
            a.idle_steps = if k > 0 { 0 } else { a.idle_steps + 1 };
        }
        lengths
    }

    /// Steps between a non-drafting request's probes in a batch of `n` decodes: as few as keep
    /// what probes cost within [`PROBE_BUDGET`] of the plain steps between them. A probe costs
    /// a verify row, and with a draft model a pass of it, its rows, and catching it up on the
    /// tokens it missed meanwhile (one row per step waited).
    fn probe_interval(&self, n: usize) -> u32 {
        let Some((step_pass, step_row)) = self.target.coefficients() else {
            return PROBE_AFTER_STEPS;
        };
        let (draft_pass, draft_row) = self.draft_costs();
        let plain = step_pass + step_row * n.max(1) as f64;
        let once = step_row + draft_pass + 2.0 * draft_row;
        let room_per_step = PROBE_BUDGET * plain - draft_row;
        if room_per_step <= 0.0 {
            return PROBE_STEPS_MAX;
        }
        ((once / room_per_step).ceil() as u32).clamp(PROBE_STEPS_MIN, PROBE_STEPS_MAX)
    }

    /// The draft model's `(per_pass, per_row)` seconds (nothing for prompt lookup, or before
    /// the draft model was measured).
    fn draft_costs(&self) -> (f64, f64) {
        self.draft
            .as_ref()
            .and_then(PassCost::coefficients)
            .unwrap_or((0.0, 0.0))
    }

    fn best_lengths(&self, candidates: &[Candidate], room: usize) -> Vec<usize> {
        let n = candidates.len();
        let room = room.min(n * self.max_tokens);
        // Before the target was measured: draft, to measure.
        let measured = self.target.coefficients();
        let (Some((step_pass, step_row)), DraftPolicyKind::Adaptive) = (measured, self.kind) else {
            return share(n, room, self.max_tokens);
        };
        let (draft_pass, draft_row) = self.draft_costs();
        let plain = step_pass + step_row * n as f64;
        let mut best = vec![0usize; n];
        let mut best_rate = n as f64 / plain.max(f64::MIN_POSITIVE);
        // For each number of draft passes, add tokens in order of their acceptance chance
        // while each adds more tokens per second than the step has so far.
        for passes in 1..=self.max_tokens.min(room) {
            let mut k = vec![0usize; n];
            let mut tokens = n as f64;
            let mut seconds = plain + draft_pass * passes as f64;
            let mut left = room;
            loop {
                let pick = (0..n)
                    .filter(|&i| k[i] < passes && left > 0)
                    .map(|i| (i, candidates[i].alpha.powi(k[i] as i32 + 1)))
                    .max_by(|x, y| x.1.total_cmp(&y.1));
                let Some((i, gain)) = pick else { break };
                // A request's first draft token also feeds the draft model its new token.
                let rows = if k[i] == 0 { 2.0 } else { 1.0 };
                let cost = step_row + draft_row * rows;
                if gain * seconds <= tokens * cost {
                    break;
                }
                k[i] += 1;
                left -= 1;
                tokens += gain;
                seconds += cost;
            }
            let used = k.iter().copied().max().unwrap_or(0);
            // Fewer passes than planned: the smaller `passes` already covered this.
            if used < passes {
                continue;
            }
            let rate = tokens / seconds.max(f64::MIN_POSITIVE);
            if rate > best_rate {
                best_rate = rate;
                best = k;
            }
        }
        // A probe drafts even when the plan says no, to learn whether acceptance came back.
        let mut left = room - best.iter().sum::<usize>();
        for (k, c) in best.iter_mut().zip(candidates) {
            if c.probe && *k == 0 && left > 0 {
                *k = 1;
                left -= 1;
            }
        }
        best
    }

    /// Keeps the state of requests for which `alive` holds.
    pub fn retain(&mut self, mut alive: impl FnMut(RequestId) -> bool) {
        self.requests.retain(|id, _| alive(*id));
    }

    /// The per-request acceptance this policy has recorded (for tests).
    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.requests.len()
    }
}

/// `room` tokens over `n` requests, one a round, at most `max` each.
fn share(n: usize, room: usize, max: usize) -> Vec<usize> {
    let mut k = vec![0; n];
    for i in 0..room.min(n * max) {
        k[i % n] += 1;
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fitted(cost: &PassCost) -> (f64, f64) {
        cost.coefficients().expect("measured")
    }

    #[test]
    fn the_cost_fit_recovers_a_pass_and_a_row_cost() {
        let mut c = PassCost::new(0.1);
        assert!(c.coefficients().is_none());
        for rows in [1, 4, 2, 8, 3, 1, 5] {
            c.observe(1, rows, 0.010 + 0.002 * rows as f64);
        }
        let (a, b) = fitted(&c);
        assert!(
            (a - 0.010).abs() < 2e-4 && (b - 0.002).abs() < 1e-4,
            "{a} {b}"
        );
    }

    #[test]
    fn with_one_row_count_the_prior_splits_the_time() {
        let mut c = PassCost::new(0.25);
        for _ in 0..20 {
            c.observe(1, 1, 0.0125);
        }
        let (a, b) = fitted(&c);
        assert!(
            (a + b - 0.0125).abs() < 1e-4,
            "the fit keeps the measured time"
        );
        assert!(
            (b / a - 0.25).abs() < 0.01,
            "and splits it by the prior: {a} {b}"
        );
    }

    #[test]
    fn the_cost_fit_never_goes_negative() {
        let mut c = PassCost::new(0.1);
        // Noise that would give a negative row cost: more rows measured faster.
        c.observe(1, 1, 0.020);
        c.observe(1, 8, 0.010);
        let (a, b) = fitted(&c);
        assert!(a >= 0.0 && b >= 0.0);
    }

    fn policy_with(step: (f64, f64), draft: Option<(f64, f64)>, max_tokens: usize) -> DraftPolicy {
        let mut p = DraftPolicy::new(max_tokens, DraftPolicyKind::Adaptive, 0.1, draft.is_some());
        for rows in 1..=8 {
            p.observe_step(rows, step.0 + step.1 * rows as f64);
            if let Some((pass, row)) = draft {
                p.observe_draft(rows, 2 * rows, pass * rows as f64 + row * (2 * rows) as f64);
            }
        }
        p
    }

    fn accept(p: &mut DraftPolicy, id: RequestId, drafted: usize, accepted: usize, times: usize) {
        for _ in 0..times {
            p.record(id, drafted, accepted);
        }
    }

    #[test]
    fn an_unmeasured_engine_drafts_to_measure() {
        let mut p = DraftPolicy::new(4, DraftPolicyKind::Adaptive, 0.1, false);
        assert_eq!(p.plan(&[RequestId(1), RequestId(2)], 5), vec![3, 2]);
    }

    #[test]
    fn the_always_policy_drafts_whatever_the_cost() {
        let mut p = DraftPolicy::new(4, DraftPolicyKind::Always, 0.1, false);
        for rows in 1..=8 {
            p.observe_step(rows, 0.010 * rows as f64);
        }
        accept(&mut p, RequestId(1), 4, 0, 8);
        assert_eq!(p.plan(&[RequestId(1), RequestId(2)], 6), vec![3, 3]);
    }

    #[test]
    fn cheap_rows_and_good_acceptance_draft_the_most() {
        // A GPU-like step: rows almost free.
        let mut p = policy_with((0.010, 0.00001), None, 4);
        accept(&mut p, RequestId(1), 4, 4, 8);
        assert_eq!(p.plan(&[RequestId(1)], 16), vec![4]);
    }

    #[test]
    fn poor_acceptance_or_dear_rows_draft_nothing() {
        // A CPU-like step where a row costs half a pass.
        let mut p = policy_with((0.010, 0.005), None, 4);
        accept(&mut p, RequestId(1), 4, 0, 8);
        assert_eq!(p.plan(&[RequestId(1)], 8), vec![0]);
        // Good acceptance still pays there, for a few tokens.
        accept(&mut p, RequestId(2), 4, 4, 8);
        let k = p.plan(&[RequestId(2)], 8)[0];
        assert!((1..=4).contains(&k), "{k}");
    }

    #[test]
    fn a_dear_draft_model_drafts_only_for_high_acceptance() {
        // The draft model's pass costs half of the target's step: at ~2/3 acceptance it loses,
        // at ~all it wins.
        let mut p = policy_with((0.010, 0.001), Some((0.006, 0.0004)), 4);
        accept(&mut p, RequestId(1), 4, 2, 8);
        assert_eq!(p.plan(&[RequestId(1)], 8), vec![0]);
        accept(&mut p, RequestId(2), 4, 4, 8);
        assert!(p.plan(&[RequestId(2)], 8)[0] >= 2);
    }

    #[test]
    fn better_requests_get_the_room_first() {
        let mut p = policy_with((0.010, 0.0002), None, 4);
        accept(&mut p, RequestId(1), 4, 0, 8);
        accept(&mut p, RequestId(2), 4, 4, 8);
        let k = p.plan(&[RequestId(1), RequestId(2)], 3);
        assert_eq!(k[1], 3, "{k:?}");
        assert!(k[0] <= k[1]);
    }

    #[test]
    fn an_idle_request_probes_with_one_token_and_the_state_follows_requests() {
        // A row costs half a pass: a lookup probe (one row, 0.005 s) fits 3% of plain steps
        // (0.015 s each) every 12 steps.
        let mut p = policy_with((0.010, 0.005), None, 4);
        assert_eq!(p.probe_interval(1), 12);
        accept(&mut p, RequestId(1), 4, 0, 8);
        for _ in 0..12 {
            assert_eq!(p.plan(&[RequestId(1)], 8), vec![0]);
        }
        assert_eq!(p.plan(&[RequestId(1)], 8), vec![1]);
        assert_eq!(p.plan(&[RequestId(1)], 8), vec![0]);
        assert_eq!(p.tracked(), 1);
        p.retain(|_| false);
        assert_eq!(p.tracked(), 0);
    }

    #[test]
    fn a_draft_model_probes_rarely() {
        // Its probe runs a pass (0.006 s) and catches up a row per step waited (0.0004 s of
        // the 0.00033 s a step may spend on probes): never worth it, so the longest wait.
        let p = policy_with((0.010, 0.001), Some((0.006, 0.0004)), 4);
        assert_eq!(p.probe_interval(1), PROBE_STEPS_MAX);
        // A draft pass of a tenth of the target's: a probe every few steps.
        let cheap = policy_with((0.010, 0.001), Some((0.001, 0.00001)), 4);
        let steps = cheap.probe_interval(1);
        assert!((PROBE_STEPS_MIN..=16).contains(&steps), "{steps}");
    }

    #[test]
    fn acceptance_follows_the_latest_verifications() {
        let mut p = DraftPolicy::new(4, DraftPolicyKind::Adaptive, 0.1, false);
        accept(&mut p, RequestId(1), 4, 4, 8);
        let high = p.alpha(RequestId(1));
        accept(&mut p, RequestId(1), 4, 0, 3);
        let lower = p.alpha(RequestId(1));
        accept(&mut p, RequestId(1), 4, 0, 3);
        let low = p.alpha(RequestId(1));
        // A rejected first token is one failed try; a draft accepted whole is four successes.
        assert!(
            high > 0.9 && lower < 0.6 && low < 0.4,
            "{high} {lower} {low}"
        );
    }
}
