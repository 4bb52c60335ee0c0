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
//!
//! A draft model must also have read a request's tokens before it can draft for it: a new
//! request's whole prompt, or what it missed while not drafting (its catch-up). That costs
//! about the draft model's prefill, once, and pays only if the request has enough tokens left
//! to gain it back: so a request's catch-up is charged as a tax on each token it produces over
//! its remaining `max_tokens` (up to a horizon), at a per-token cost measured like the others
//! (before any measurement: what a draft row costs, and at least the assumed row share of the
//! draft's assumed pass: a prudent bound on a prefill token).
//! Before the target's step has been measured at all, only requests without catch-up draft.

use std::collections::HashMap;

use novainfer_core::{Request, RequestId};

use crate::spec_config::DraftPolicyKind;

/// Tokens a request that drafts every step feeds the draft model before its first draft token:
/// its newest token and, after a draft accepted whole, the last draft token (proposed, never
/// fed). What a request feeds beyond this is catch-up: a prompt, or tokens missed while it did
/// not draft.
pub const STEADY_FEED: usize = 2;

/// What one proposal cost the draft model: forward passes, the rows fed over all of them, and
/// of the tokens fed, those that were catch-up (counted apart from `rows`): a drafting
/// request's feed beyond [`STEADY_FEED`], and all a request fed while not drafting yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftWork {
    pub passes: usize,
    pub rows: usize,
    pub catch_up: usize,
}

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

/// What the draft model's catch-up costs per token: the seconds its steps with catch-up took
/// beyond what their passes and rows were expected to take, over the catch-up tokens they fed,
/// exponentially weighted like [`PassCost`].
#[derive(Debug, Clone, Default)]
struct CatchUpCost {
    seconds: f64,
    tokens: f64,
}

/// How many tokens' worth of the prior (a draft row's cost) the catch-up fit starts from: one
/// prompt caught up outweighs it, a few tokens missed while not drafting do not.
const CATCH_UP_PRIOR_TOKENS: f64 = 32.0;

impl CatchUpCost {
    /// Catching up `tokens` tokens took `seconds` more than the step's passes and rows.
    fn observe(&mut self, tokens: usize, seconds: f64) {
        if tokens == 0 || !seconds.is_finite() {
            return;
        }
        self.seconds = COST_DECAY * self.seconds + seconds.max(0.0);
        self.tokens = COST_DECAY * self.tokens + tokens as f64;
    }

    /// Seconds per catch-up token, starting from `prior`.
    fn per_token(&self, prior: f64) -> f64 {
        (self.seconds + CATCH_UP_PRIOR_TOKENS * prior) / (self.tokens + CATCH_UP_PRIOR_TOKENS)
    }
}

/// The draft model's costs.
#[derive(Debug, Clone)]
struct DraftCosts {
    /// Its passes and rows, fitted on proposals without catch-up.
    work: PassCost,
    catch_up: CatchUpCost,
    /// What it costs relative to the target until measured (the weights each token reads).
    share: f64,
}

/// The costs a plan weighs, in seconds.
#[derive(Debug, Clone, Copy)]
struct Costs {
    step_pass: f64,
    step_row: f64,
    draft_pass: f64,
    draft_row: f64,
    /// Per catch-up token.
    catch_up: f64,
}

impl Costs {
    /// A plain step over `n` decodes.
    fn plain(&self, n: usize) -> f64 {
        self.step_pass + self.step_row * n.max(1) as f64
    }
}

/// Most of a request's remaining tokens its catch-up is spread over: a request that leaves
/// `max_tokens` to the context limit seldom uses it all, and a catch-up spread too thin is a
/// loss when the request ends early.
const CATCH_UP_HORIZON: usize = 1024;

/// One decoding request as [`DraftPolicy::plan`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoding {
    pub id: RequestId,
    /// Tokens the draft model must read before it can draft for the request, beyond what a
    /// drafting step feeds anyway ([`STEADY_FEED`]): a new request's prompt, or what it missed
    /// while not drafting. 0 for prompt lookup.
    pub catch_up: usize,
    /// Tokens the request may still produce.
    pub remaining: usize,
}

impl Decoding {
    /// `request`, with `catch_up` tokens for the draft model to read first.
    pub fn new(request: &Request, catch_up: usize) -> Self {
        Self {
            id: request.id,
            catch_up,
            remaining: request
                .max_tokens
                .saturating_sub(request.output_token_ids.len()),
        }
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
/// acceptance comes back (a code edit that copies again after a changed line). A request's
/// probes may cost this share of the time the plain steps it waited took: with prompt lookup,
/// whose probe is one more row, that is every ~10 steps on a CPU; with a draft model, whose
/// probe also runs it and catches it up (on a prompt it never read, or the tokens it missed),
/// far more rarely, and never while the catch-up grows faster than the budget.
const PROBE_BUDGET: f64 = 0.03;
/// Probe intervals, in a request's decode steps: the shortest, and the longest a request
/// without catch-up waits whatever its probe costs.
const PROBE_STEPS_MIN: u32 = 4;
const PROBE_STEPS_MAX: u32 = 512;

/// Chooses draft lengths from measured costs and acceptance.
#[derive(Debug, Clone)]
pub struct DraftPolicy {
    max_tokens: usize,
    kind: DraftPolicyKind,
    /// The target's decode step: one pass, a row per decode and per draft token.
    target: PassCost,
    /// The draft model's proposals (none for prompt lookup, which costs next to nothing).
    draft: Option<DraftCosts>,
    requests: HashMap<RequestId, Acceptance>,
    global_accepted: f64,
    global_tried: f64,
}

/// One request's view for [`DraftPolicy::plan`].
#[derive(Debug, Clone, Copy)]
struct Candidate {
    alpha: f64,
    /// Whether the draft model has tokens of this request to catch up on.
    catching_up: bool,
    /// Seconds each token the request produces pays towards its catch-up if it drafts now.
    tax: f64,
    probe: bool,
}

impl DraftPolicy {
    /// `row_share`: what a row is assumed to cost relative to a pass until measurements at
    /// several row counts say otherwise; `draft_share`: with a draft model, what its passes and
    /// rows are assumed to cost relative to the target's until measured.
    pub fn new(
        max_tokens: usize,
        kind: DraftPolicyKind,
        row_share: f64,
        draft_share: Option<f64>,
    ) -> Self {
        Self {
            max_tokens,
            kind,
            target: PassCost::new(row_share),
            draft: draft_share.map(|share| DraftCosts {
                work: PassCost::new(row_share),
                catch_up: CatchUpCost::default(),
                share,
            }),
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

    /// The draft model did `work` in `seconds`. A proposal with catch-up measures what a
    /// catch-up token costs (what the passes and rows leave of the time); one without measures
    /// the passes and rows.
    pub fn observe_draft(&mut self, work: DraftWork, seconds: f64) {
        let expected = self.costs().map_or(0.0, |c| {
            c.draft_pass * work.passes as f64 + c.draft_row * work.rows as f64
        });
        let Some(draft) = self.draft.as_mut() else {
            return;
        };
        if work.catch_up == 0 {
            draft.work.observe(work.passes, work.rows, seconds);
        } else {
            draft.catch_up.observe(work.catch_up, seconds - expected);
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

    /// Draft lengths for the decoding requests (each request's at most the configured number,
    /// `room` tokens in all): the lengths with the most expected tokens per expected second,
    /// none when no draft is expected to beat a plain step.
    pub fn plan(&mut self, requests: &[Decoding], room: usize) -> Vec<usize> {
        let costs = self.costs();
        let candidates: Vec<Candidate> = requests
            .iter()
            .map(|r| Candidate {
                alpha: self.alpha(r.id),
                catching_up: r.catch_up > 0,
                tax: costs.map_or(0.0, |c| {
                    c.catch_up * r.catch_up as f64 / r.remaining.clamp(1, CATCH_UP_HORIZON) as f64
                }),
                probe: costs.is_some_and(|c| self.probe_due(&c, requests.len(), r)),
            })
            .collect();
        let lengths = self.best_lengths(&candidates, room, costs);
        tracing::debug!(
            target: "novainfer::draft_policy",
            step = ?self.target.coefficients(),
            draft = ?costs.map(|c| (c.draft_pass, c.draft_row)),
            catch_up_per_token = ?costs.map(|c| c.catch_up),
            alpha = ?candidates.iter().map(|c| c.alpha).collect::<Vec<_>>(),
            tax = ?candidates.iter().map(|c| c.tax).collect::<Vec<_>>(),
            ?lengths,
            "draft lengths"
        );
        for (r, &k) in requests.iter().zip(&lengths) {
            let a = self.requests.entry(r.id).or_default();
            a.idle_steps = if k > 0 { 0 } else { a.idle_steps + 1 };
        }
        lengths
    }

    /// Whether `request`, in a batch of `n` decodes, is due a probe: when the probe's cost (a
    /// verify row, and with a draft model a pass of it, its rows and the request's catch-up)
    /// fits [`PROBE_BUDGET`] of the plain steps it waited since it last drafted. A request
    /// without catch-up probes at least every [`PROBE_STEPS_MAX`] steps, so stale costs cannot
    /// keep it from drafting for good.
    fn probe_due(&self, c: &Costs, n: usize, request: &Decoding) -> bool {
        let Some(idle) = self.requests.get(&request.id).map(|a| a.idle_steps) else {
            return false;
        };
        let once = c.step_row
            + c.draft_pass
            + STEADY_FEED as f64 * c.draft_row
            + c.catch_up * request.catch_up as f64;
        let budget = PROBE_BUDGET * c.plain(n) * f64::from(idle);
        idle >= PROBE_STEPS_MIN
            && (budget >= once || (idle >= PROBE_STEPS_MAX && request.catch_up == 0))
    }

    /// What the plan weighs, or `None` before the target's step was measured. The draft
    /// model's passes and rows are assumed to cost its share of the target's until measured,
    /// and a catch-up token what a draft row costs (at least the assumed row share of its
    /// assumed pass).
    fn costs(&self) -> Option<Costs> {
        let (step_pass, step_row) = self.target.coefficients()?;
        let Some(draft) = &self.draft else {
            return Some(Costs {
                step_pass,
                step_row,
                draft_pass: 0.0,
                draft_row: 0.0,
                catch_up: 0.0,
            });
        };
        let (draft_pass, draft_row) = draft
            .work
            .coefficients()
            .unwrap_or((draft.share * step_pass, draft.share * step_row));
        // The fitted rows may cost nothing (steps measured at one row count, or noise that
        // made more rows look faster); a catch-up must not look free for that, so its prior
        // is at least the assumed share of a row of the draft's assumed pass.
        let prior = draft_row.max(draft.share * self.target.row_share * step_pass);
        Some(Costs {
            step_pass,
            step_row,
            draft_pass,
            draft_row,
            catch_up: draft.catch_up.per_token(prior),
        })
    }

    fn best_lengths(
        &self,
        candidates: &[Candidate],
        room: usize,
        costs: Option<Costs>,
    ) -> Vec<usize> {
        let n = candidates.len();
        let room = room.min(n * self.max_tokens);
        let c = match (self.kind, costs) {
            (DraftPolicyKind::Always, _) => return share(&vec![true; n], room, self.max_tokens),
            (DraftPolicyKind::Adaptive, Some(c)) => c,
            // Before the target was measured: draft, to measure, but not where the draft
            // model would first have to read a prompt at a cost nothing has measured yet.
            (DraftPolicyKind::Adaptive, None) => {
                let eligible: Vec<bool> = candidates.iter().map(|c| !c.catching_up).collect();
                return share(&eligible, room, self.max_tokens);
            }
        };
        let plain = c.plain(n);
        let mut best = vec![0usize; n];
        let mut best_rate = n as f64 / plain.max(f64::MIN_POSITIVE);
        // For each number of draft passes, add tokens in order of tokens per second added
        // while each adds more tokens per second than the step has so far.
        for passes in 1..=self.max_tokens.min(room) {
            let mut k = vec![0usize; n];
            let mut tokens = n as f64;
            let mut seconds = plain + c.draft_pass * passes as f64;
            let mut left = room;
            loop {
                let pick = (0..n)
                    .filter(|&i| k[i] < passes && left > 0)
                    .map(|i| {
                        let cand = &candidates[i];
                        let gain = cand.alpha.powi(k[i] as i32 + 1);
                        // A request's first draft token also feeds the draft model its new
                        // tokens, and from then on each token it produces pays its catch-up
                        // tax, the one it produces anyway included.
                        let cost = if k[i] == 0 {
                            c.step_row + c.draft_row * STEADY_FEED as f64 + cand.tax * (1.0 + gain)
                        } else {
                            c.step_row + c.draft_row + cand.tax * gain
                        };
                        (i, gain, cost)
                    })
                    .max_by(|x, y| {
                        (x.1 / x.2.max(f64::MIN_POSITIVE))
                            .total_cmp(&(y.1 / y.2.max(f64::MIN_POSITIVE)))
                    });
                let Some((i, gain, cost)) = pick else { break };
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

/// `room` tokens over the `eligible` requests, one a round, at most `max` each.
fn share(eligible: &[bool], room: usize, max: usize) -> Vec<usize> {
    let mut k = vec![0; eligible.len()];
    let chosen: Vec<usize> = (0..eligible.len()).filter(|&i| eligible[i]).collect();
    for j in 0..room.min(chosen.len() * max) {
        k[chosen[j % chosen.len()]] += 1;
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
        let share = draft.map(|_| 0.3);
        let mut p = DraftPolicy::new(max_tokens, DraftPolicyKind::Adaptive, 0.1, share);
        for rows in 1..=8 {
            p.observe_step(rows, step.0 + step.1 * rows as f64);
            if let Some((pass, row)) = draft {
                let work = DraftWork {
                    passes: rows,
                    rows: 2 * rows,
                    catch_up: 0,
                };
                p.observe_draft(work, pass * rows as f64 + row * (2 * rows) as f64);
            }
        }
        p
    }

    fn accept(p: &mut DraftPolicy, id: RequestId, drafted: usize, accepted: usize, times: usize) {
        for _ in 0..times {
            p.record(id, drafted, accepted);
        }
    }

    /// Requests with nothing to catch up on and plenty of tokens left.
    fn caught_up(ids: &[u64]) -> Vec<Decoding> {
        ids.iter()
            .map(|&id| Decoding {
                id: RequestId(id),
                catch_up: 0,
                remaining: 1000,
            })
            .collect()
    }

    fn with_catch_up(id: u64, catch_up: usize, remaining: usize) -> Decoding {
        Decoding {
            id: RequestId(id),
            catch_up,
            remaining,
        }
    }

    #[test]
    fn an_unmeasured_engine_drafts_to_measure() {
        let mut p = DraftPolicy::new(4, DraftPolicyKind::Adaptive, 0.1, None);
        assert_eq!(p.plan(&caught_up(&[1, 2]), 5), vec![3, 2]);
    }

    #[test]
    fn an_unmeasured_engine_never_starts_with_a_catch_up() {
        // Before any step was measured, a draft model drafts only for the request it has
        // read already: the other's prompt would cost what nothing has measured yet.
        let mut p = DraftPolicy::new(4, DraftPolicyKind::Adaptive, 0.1, Some(0.3));
        let requests = [with_catch_up(1, 700, 127), with_catch_up(2, 0, 127)];
        assert_eq!(p.plan(&requests, 6), vec![0, 4]);
        assert_eq!(p.plan(&requests[..1], 6), vec![0]);
    }

    #[test]
    fn the_always_policy_drafts_whatever_the_cost() {
        let mut p = DraftPolicy::new(4, DraftPolicyKind::Always, 0.1, Some(0.3));
        for rows in 1..=8 {
            p.observe_step(rows, 0.010 * rows as f64);
        }
        accept(&mut p, RequestId(1), 4, 0, 8);
        let requests = [with_catch_up(1, 0, 100), with_catch_up(2, 5000, 10)];
        assert_eq!(p.plan(&requests, 6), vec![3, 3]);
    }

    #[test]
    fn cheap_rows_and_good_acceptance_draft_the_most() {
        // A GPU-like step: rows almost free.
        let mut p = policy_with((0.010, 0.00001), None, 4);
        accept(&mut p, RequestId(1), 4, 4, 8);
        assert_eq!(p.plan(&caught_up(&[1]), 16), vec![4]);
    }

    #[test]
    fn poor_acceptance_or_dear_rows_draft_nothing() {
        // A CPU-like step where a row costs half a pass.
        let mut p = policy_with((0.010, 0.005), None, 4);
        accept(&mut p, RequestId(1), 4, 0, 8);
        assert_eq!(p.plan(&caught_up(&[1]), 8), vec![0]);
        // Good acceptance still pays there, for a few tokens.
        accept(&mut p, RequestId(2), 4, 4, 8);
        let k = p.plan(&caught_up(&[2]), 8)[0];
        assert!((1..=4).contains(&k), "{k}");
    }

    #[test]
    fn a_dear_draft_model_drafts_only_for_high_acceptance() {
        // The draft model's pass costs half of the target's step: at ~2/3 acceptance it loses,
        // at ~all it wins.
        let mut p = policy_with((0.010, 0.001), Some((0.006, 0.0004)), 4);
        accept(&mut p, RequestId(1), 4, 2, 8);
        assert_eq!(p.plan(&caught_up(&[1]), 8), vec![0]);
        accept(&mut p, RequestId(2), 4, 4, 8);
        assert!(p.plan(&caught_up(&[2]), 8)[0] >= 2);
    }

    #[test]
    fn better_requests_get_the_room_first() {
        let mut p = policy_with((0.010, 0.0002), None, 4);
        accept(&mut p, RequestId(1), 4, 0, 8);
        accept(&mut p, RequestId(2), 4, 4, 8);
        let k = p.plan(&caught_up(&[1, 2]), 3);
        assert_eq!(k[1], 3, "{k:?}");
        assert!(k[0] <= k[1]);
    }

    /// A cheap draft model (a tenth of the target's pass) whose drafts are all accepted:
    /// drafting pays well, as long as the catch-up does.
    fn a_cheap_draft_model_that_is_always_right() -> DraftPolicy {
        let mut p = policy_with((0.010, 0.001), Some((0.001, 0.0001)), 4);
        for id in 1..=4 {
            accept(&mut p, RequestId(id), 4, 4, 8);
        }
        p
    }

    /// The draft model took 5 ms per catch-up token, on top of its passes and rows.
    fn observe_dear_catch_ups(p: &mut DraftPolicy, times: usize) {
        for _ in 0..times {
            let work = DraftWork {
                passes: 4,
                rows: 5,
                catch_up: 1000,
            };
            p.observe_draft(work, 4.0 * 0.001 + 5.0 * 0.0001 + 1000.0 * 0.005);
        }
    }

    #[test]
    fn catch_up_costs_are_measured_apart_from_passes_and_rows() {
        let mut p = a_cheap_draft_model_that_is_always_right();
        let before = p.costs().expect("measured");
        // Before a catch-up was measured: a catch-up token is assumed to cost a draft row, or
        // the assumed row share (0.1) of the draft's assumed pass (0.3 × 10 ms) if more.
        assert!((before.catch_up - 0.0003).abs() < 1e-6, "{before:?}");
        observe_dear_catch_ups(&mut p, 2);
        let after = p.costs().expect("measured");
        // The passes and rows keep their fit; the catch-up gets what they leave of the time
        // (the prior's 32 tokens at 0.3 ms weigh little against the 2,000 measured).
        assert!(
            (after.draft_pass - before.draft_pass).abs() < 1e-9
                && (after.draft_row - before.draft_row).abs() < 1e-9
        );
        assert!((after.catch_up - 0.005).abs() < 0.0002, "{after:?}");
    }

    #[test]
    fn a_catch_up_never_looks_free() {
        // Steps that looked cheaper with more rows (load falling while the batch grew): the
        // fitted row cost is 0, and with it the draft's assumed row.
        let mut p = DraftPolicy::new(4, DraftPolicyKind::Adaptive, 0.3, Some(0.3));
        for rows in [1, 1, 4, 4] {
            p.observe_step(rows, 0.30 - 0.02 * rows as f64);
        }
        let c = p.costs().expect("measured");
        assert_eq!(c.step_row, 0.0);
        // A catch-up token is still assumed to cost 0.3 of a row of 0.3 of the target's pass.
        assert!((c.catch_up - 0.09 * c.step_pass).abs() < 1e-9, "{c:?}");
        // So four 700-token prompts are not caught up on the optimistic acceptance prior.
        let requests: Vec<Decoding> = (1..=4).map(|id| with_catch_up(id, 700, 127)).collect();
        assert_eq!(p.plan(&requests, 4), vec![0; 4]);
    }

    #[test]
    fn a_catch_up_is_drafted_for_only_when_the_remaining_tokens_repay_it() {
        let mut p = a_cheap_draft_model_that_is_always_right();
        // Nothing to catch up on: all four tokens.
        assert_eq!(p.plan(&[with_catch_up(1, 0, 127)], 8), vec![4]);
        // A 700-token prompt to read at the prior's 0.3 ms a token (210 ms) repays itself over
        // 127 tokens.
        assert_eq!(p.plan(&[with_catch_up(2, 700, 127)], 8), vec![4]);
        // At a measured 5 ms a token (3.5 s) it does not: plain decoding makes the 127 tokens
        // in 1.4 s.
        observe_dear_catch_ups(&mut p, 2);
        assert_eq!(p.plan(&[with_catch_up(2, 700, 127)], 8), vec![0]);
        // Over 1,000 tokens left (about 11 s of plain decoding) it does.
        assert_eq!(p.plan(&[with_catch_up(2, 700, 1000)], 8), vec![4]);
        // A few tokens missed while not drafting cost next to nothing.
        assert_eq!(p.plan(&[with_catch_up(2, 3, 127)], 8), vec![4]);
    }

    #[test]
    fn a_catch_up_is_spread_over_the_horizon_at_most() {
        let mut p = a_cheap_draft_model_that_is_always_right();
        observe_dear_catch_ups(&mut p, 2);
        // 4,000 tokens to read (20 s) would repay over 100,000 tokens left, not over the 1,024
        // a request is trusted to produce.
        assert_eq!(p.plan(&[with_catch_up(1, 4000, 100_000)], 8), vec![0]);
        assert_eq!(p.plan(&[with_catch_up(1, 4000, 5 * 1024)], 8), vec![0]);
    }

    #[test]
    fn in_a_batch_the_caught_up_request_drafts_and_the_other_waits() {
        let mut p = a_cheap_draft_model_that_is_always_right();
        observe_dear_catch_ups(&mut p, 2);
        let k = p.plan(&[with_catch_up(1, 700, 127), with_catch_up(2, 0, 127)], 8);
        assert_eq!(k, vec![0, 4]);
    }

    #[test]
    fn an_idle_request_probes_with_one_token_and_the_state_follows_requests() {
        // A row costs half a pass: a lookup probe (one row, 0.005 s) fits 3% of plain steps
        // (0.015 s each) every 12 steps.
        let mut p = policy_with((0.010, 0.005), None, 4);
        accept(&mut p, RequestId(1), 4, 0, 8);
        for _ in 0..12 {
            assert_eq!(p.plan(&caught_up(&[1]), 8), vec![0]);
        }
        assert_eq!(p.plan(&caught_up(&[1]), 8), vec![1]);
        assert_eq!(p.plan(&caught_up(&[1]), 8), vec![0]);
        assert_eq!(p.tracked(), 1);
        p.retain(|_| false);
        assert_eq!(p.tracked(), 0);
    }

    /// Plans for a request that never drafts until it probes; the steps it waited.
    fn steps_to_probe(p: &mut DraftPolicy, request: Decoding, limit: usize) -> Option<usize> {
        (1..=limit).find(|_| p.plan(&[request], 8) == vec![1])
    }

    #[test]
    fn a_draft_model_probes_when_its_catch_up_fits_the_budget() {
        // A draft pass of 6 ms against an 11 ms step: drafting at poor acceptance loses.
        let mut p = policy_with((0.010, 0.001), Some((0.006, 0.0004)), 4);
        observe_dear_catch_ups(&mut p, 2);
        accept(&mut p, RequestId(1), 4, 0, 8);
        accept(&mut p, RequestId(2), 4, 0, 8);
        // A probe with two tokens to catch up on costs a verify row (1 ms), a draft pass
        // (6 ms), two rows (0.8 ms) and 2 × ~5 ms: ~18 ms, 3% of 11 ms steps: every ~53.
        let steps = steps_to_probe(&mut p, with_catch_up(1, 2, 127), 100).expect("probes");
        assert!((45..=60).contains(&steps), "{steps}");
        // A prompt never read (700 tokens, ~3.4 s) is not worth a probe, not even after the
        // longest wait.
        assert_eq!(
            steps_to_probe(
                &mut p,
                with_catch_up(2, 700, 127),
                2 * PROBE_STEPS_MAX as usize
            ),
            None
        );
    }

    #[test]
    fn acceptance_follows_the_latest_verifications() {
        let mut p = DraftPolicy::new(4, DraftPolicyKind::Adaptive, 0.1, None);
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
