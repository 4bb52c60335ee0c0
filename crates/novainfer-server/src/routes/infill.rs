//! `POST /infill`: llama.cpp's code-infill endpoint, so editor plugins written for llama.cpp
//! (llama.vim, llama.vscode) work unchanged against NovaInfer. The prompt is the model's FIM
//! prompt (repo-level with `input_extra`, see `novainfer_engine::fim`); the response is
//! llama.cpp's `/completion` object (`content`, `stop`, `stop_type`, `tokens_*`, `timings`,
//! ...), and a stream is `data: {...}` events with `stop: false`, then the final object
//! with `stop: true` (no `[DONE]`, as llama.cpp's own endpoints send none).
//!
//! Sampling defaults are llama.cpp's (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05),
//! so a plugin gets what it was tuned for. Generation also ends on any FIM token.

use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use novainfer_core::{FinishReason, SamplingParams};
use novainfer_engine::fim::{ExtraChunk, FimTokens};
use novainfer_engine::{Delta, StopReason};
use serde_json::{json, Map, Value};

use super::driver::{Flow, Renderer};
use super::generate::{Api, Context, GenerationRequest, Input, Tokenized, NO_FIM};
use super::run::Running;
use crate::error::ApiError;
use crate::indent::IndentLimit;
use crate::params::EndpointParams;
use crate::protocol::infill::InfillRequest;
use crate::protocol::request::{parse, SharedFields};
use crate::sse;

/// llama.cpp's own output limits, checked.
struct Limits {
    /// `None`: until the context is full.
    n_predict: Option<i64>,
    n_indent: usize,
    t_max_predict: Option<Duration>,
}

impl Limits {
    fn of(req: &InfillRequest) -> Result<Self, ApiError> {
        let n_predict = match req.n_predict {
            None | Some(-1) => None,
            Some(n) if n >= 1 => Some(n),
            Some(n) => {
                return Err(ApiError::invalid_param(
                    "n_predict",
                    format!("n_predict must be -1 (until the context is full) or >= 1, got {n}"),
                ))
            }
        };
        let n_indent = match req.n_indent {
            None => 0,
            Some(n) if n >= 0 => n as usize,
            Some(n) => {
                return Err(ApiError::invalid_param(
                    "n_indent",
                    format!("n_indent must be >= 0, got {n}"),
                ))
            }
        };
        let t_max_predict = match req.t_max_predict_ms {
            None | Some(0) => None,
            Some(ms) if ms > 0 => Some(Duration::from_millis(ms as u64)),
            Some(ms) => {
                return Err(ApiError::invalid_param(
                    "t_max_predict_ms",
                    format!("t_max_predict_ms must be >= 0, got {ms}"),
                ))
            }
        };
        Ok(Self {
            n_predict,
            n_indent,
            t_max_predict,
        })
    }
}

/// llama.cpp's infill as an [`Api`].
pub struct Infill(InfillRequest);

/// What the renderer needs of the request.
pub struct InfillPlan {
    model: String,
    n_indent: usize,
    n_predict: Option<i64>,
    t_max_predict: Option<Duration>,
    fields: Option<Vec<String>>,
    return_tokens: bool,
    stream: bool,
}

impl Api for Infill {
    const ENDPOINT: &'static str = "infill";
    const RENAMES: &'static [(&'static str, &'static str)] = &[
        ("max_tokens", "n_predict"),
        ("repetition_penalty", "repeat_penalty"),
    ];
    type Plan = InfillPlan;
    type Renderer = InfillState;

    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse(body).map(Infill)
    }

    fn model(&self) -> Option<&str> {
        self.0.model.as_deref()
    }

    fn ignored_fields(&self) -> Vec<&'static str> {
        self.0.ignored_fields()
    }

    fn request(self, cx: &Context) -> Result<(GenerationRequest, InfillPlan), ApiError> {
        let Infill(req) = self;
        let fim = FimTokens::of(cx.model.frontend.tokenizer())
            .ok_or_else(|| ApiError::invalid(NO_FIM))?;
        let Limits {
            n_predict,
            n_indent,
            t_max_predict,
        } = Limits::of(&req)?;
        // llama.cpp's defaults, which the editor plugins were tuned for.
        let sampling = SharedFields {
            temperature: Some(req.temperature.unwrap_or(0.8)),
            top_k: Some(req.top_k.unwrap_or(40)),
            top_p: Some(req.top_p.unwrap_or(0.95)),
            min_p: Some(req.min_p.unwrap_or(0.05)),
            repetition_penalty: req.repeat_penalty,
            presence_penalty: req.presence_penalty,
            frequency_penalty: req.frequency_penalty,
            seed: req.seed.filter(|&s| s != -1),
            stop: req.stop.clone(),
            ignore_eos: req.ignore_eos,
            ..SharedFields::default()
        };
        let output = EndpointParams {
            max_tokens: n_predict,
            default_max_tokens: None,
            logprobs: None,
            // A middle ends on any FIM or repo-level token, as llama.cpp ends it.
            extra_stop_token_ids: fim.all(),
            constraint: None,
        };
        let max_model_len = cx.model.frontend.max_model_len();
        let stream = req.stream.unwrap_or(false);
        let input = Input::Infill {
            extra: req
                .input_extra
                .unwrap_or_default()
                .into_iter()
                .map(|c| ExtraChunk {
                    filename: c.filename.unwrap_or_else(|| "tmp".to_owned()),
                    text: c.text,
                })
                .collect(),
            prefix: req.input_prefix.unwrap_or_default(),
            suffix: req.input_suffix.unwrap_or_default(),
            middle: req.prompt.unwrap_or_default(),
            // Room kept for the output when input_extra must be cut to fit.
            reserve: n_predict.map_or(max_model_len / 4, |n| n as usize),
            fim,
        };
        let plan = InfillPlan {
            model: cx.model.name.clone(),
            n_indent,
            n_predict,
            t_max_predict,
            fields: req.response_fields,
            return_tokens: req.return_tokens.unwrap_or(false),
            stream,
        };
        let request = GenerationRequest {
            input,
            sampling,
            output,
            response_id: format!("infill-{}", cx.request_id.0),
            stream,
            prompt_logprobs: false,
        };
        Ok((request, plan))
    }

    fn renderer(
        plan: InfillPlan,
        _cx: &Context,
        params: &SamplingParams,
        prompt: Tokenized,
    ) -> InfillState {
        let settings = json!({
            "n_predict": plan.n_predict.unwrap_or(-1),
            "temperature": params.temperature(),
            "top_k": params.top_k().unwrap_or(0),
            "top_p": params.top_p(),
            "min_p": params.min_p(),
            "seed": params.seed(),
            "stop": params.stop().stop,
            "n_indent": plan.n_indent,
            "model": plan.model,
        });
        InfillState {
            model: plan.model,
            indent: Some(IndentLimit::new(plan.n_indent)),
            t_max_predict: plan.t_max_predict,
            fields: plan.fields,
            return_tokens: plan.return_tokens,
            settings,
            prompt_tokens: prompt.prompt_ids.first().map_or(0, Vec::len),
            truncated: prompt.truncated,
            stream: plan.stream,
            ..InfillState::default()
        }
    }
}

/// What the response reports, folded from the deltas.
#[derive(Default)]
pub struct InfillState {
    model: String,
    indent: Option<IndentLimit>,
    t_max_predict: Option<Duration>,
    fields: Option<Vec<String>>,
    return_tokens: bool,
    settings: Value,
    prompt_tokens: usize,
    cached: usize,
    truncated: bool,
    content: String,
    tokens: Vec<u32>,
    has_new_line: bool,
    started: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    stop_type: &'static str,
    stopping_word: String,
    stream: bool,
}

impl InfillState {
    /// Folds in one delta; returns the text it adds and whether the output ends here.
    fn push(&mut self, delta: &Delta, now: Instant) -> (String, Flow) {
        if !delta.token_ids.is_empty() {
            self.first_token.get_or_insert(now);
            self.last_token = Some(now);
        }
        self.cached = self.cached.max(delta.num_cached_tokens);
        self.tokens.extend(&delta.token_ids);
        let (keep, cut) = match &mut self.indent {
            Some(limit) => limit.push(&delta.text),
            None => (delta.text.as_str(), false),
        };
        let keep = keep.to_owned();
        self.has_new_line |= keep.contains('\n');
        self.content.push_str(&keep);
        if cut {
            self.stop_type = "limit";
            return (keep, Flow::Stop("length"));
        }
        if let Some(reason) = delta.finish_reason {
            self.stop_type = match (reason, &delta.stop_reason) {
                (FinishReason::Stop, Some(StopReason::Text(word))) => {
                    self.stopping_word = word.clone();
                    "word"
                }
                (FinishReason::Stop, _) => "eos",
                (FinishReason::Length, _) => "limit",
                _ => "none",
            };
            return (keep, Flow::Stop(reason.as_str()));
        }
        let overdue = match (self.t_max_predict, self.first_token) {
            (Some(limit), Some(first)) => now.duration_since(first) > limit,
            _ => false,
        };
        if overdue && self.has_new_line {
            self.stop_type = "limit";
            return (keep, Flow::Stop("length"));
        }
        (keep, Flow::Continue)
    }

    fn timings(&self) -> Value {
        let ms = |a: Option<Instant>, b: Option<Instant>| match (a, b) {
            (Some(a), Some(b)) => b.saturating_duration_since(a).as_secs_f64() * 1e3,
            _ => 0.0,
        };
        let prompt_n = self.prompt_tokens.saturating_sub(self.cached);
        let prompt_ms = ms(self.started, self.first_token);
        let predicted_n = self.tokens.len();
        let predicted_ms = ms(self.first_token, self.last_token);
        let per = |n: usize, ms: f64| {
            if n == 0 || ms <= 0.0 {
                (0.0, 0.0)
            } else {
                (ms / n as f64, n as f64 * 1e3 / ms)
            }
        };
        let (prompt_per_token_ms, prompt_per_second) = per(prompt_n, prompt_ms);
        let (predicted_per_token_ms, predicted_per_second) = per(predicted_n, predicted_ms);
        json!({
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_per_token_ms,
            "prompt_per_second": prompt_per_second,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_per_token_ms,
            "predicted_per_second": predicted_per_second,
        })
    }

    /// The final object; in a stream its `content` is empty (the chunks carried the text).
    fn last(&self, streamed: bool) -> Value {
        let tokens = if self.return_tokens || streamed {
            self.tokens.clone()
        } else {
            Vec::new()
        };
        let object = json!({
            "index": 0,
            "content": if streamed { "" } else { self.content.as_str() },
            "tokens": if streamed { Vec::new() } else { tokens },
            "id_slot": 0,
            "stop": true,
            "model": self.model,
            "tokens_predicted": self.tokens.len(),
            "tokens_evaluated": self.prompt_tokens,
            "tokens_cached": self.cached,
            "truncated": self.truncated,
            "has_new_line": self.has_new_line,
            "stop_type": self.stop_type,
            "stopping_word": self.stopping_word,
            "generation_settings": self.settings,
            "timings": self.timings(),
        });
        select_fields(object, self.fields.as_deref())
    }

    fn chunk(&self, content: String, tokens: &[u32]) -> Value {
        let object = json!({
            "index": 0,
            "content": content,
            "tokens": tokens,
            "stop": false,
            "id_slot": 0,
            "tokens_predicted": self.tokens.len(),
            "tokens_evaluated": self.prompt_tokens,
        });
        select_fields(object, self.fields.as_deref())
    }
}

/// llama.cpp's `response_fields`: only the listed fields, a nested one (`timings/prompt_n`)
/// moved to the top under its full path; missing ones are left out.
fn select_fields(object: Value, fields: Option<&[String]>) -> Value {
    let Some(fields) = fields else {
        return object;
    };
    let mut out = Map::new();
    for field in fields {
        let found = field.split('/').try_fold(&object, |v, key| v.get(key));
        if let Some(v) = found {
            out.insert(field.clone(), v.clone());
        }
    }
    Value::Object(out)
}

impl Renderer for InfillState {
    const DONE: bool = false;

    fn opening(&mut self, _running: &Running) -> Vec<Bytes> {
        self.started = Some(Instant::now());
        Vec::new()
    }

    fn delta(&mut self, _running: &Running, _index: usize, delta: &Delta) -> (Vec<Bytes>, Flow) {
        let (text, flow) = self.push(delta, Instant::now());
        let events = if self.stream && (!text.is_empty() || !delta.token_ids.is_empty()) {
            vec![sse::data(&self.chunk(text, &delta.token_ids))]
        } else {
            Vec::new()
        };
        (events, flow)
    }

    fn closing(&mut self, _running: &Running) -> Vec<Bytes> {
        vec![sse::data(&self.last(true))]
    }

    fn whole(self, _running: &Running) -> Response {
        axum::Json(self.last(false)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_fields_pick_and_flatten() {
        let object = json!({"content": "x", "timings": {"prompt_n": 3}, "stop": true});
        let fields = [
            "content".to_owned(),
            "timings/prompt_n".to_owned(),
            "nope/x".to_owned(),
        ];
        assert_eq!(
            select_fields(object.clone(), Some(&fields)),
            json!({"content": "x", "timings/prompt_n": 3})
        );
        assert_eq!(select_fields(object.clone(), None), object);
    }

    #[test]
    fn stop_types_follow_llama_cpp() {
        let delta = |text: &str, finish: Option<FinishReason>, stop: Option<StopReason>| Delta {
            text: text.into(),
            token_ids: vec![1],
            finish_reason: finish,
            stop_reason: stop,
            ..Delta::default()
        };
        let now = Instant::now();
        let mut s = InfillState::default();
        assert!(matches!(
            s.push(&delta("a", None, None), now).1,
            Flow::Continue
        ));
        let (_, next) = s.push(
            &delta(
                "",
                Some(FinishReason::Stop),
                Some(StopReason::Text("\n\n".into())),
            ),
            now,
        );
        assert!(matches!(next, Flow::Stop("stop")));
        assert_eq!((s.stop_type, s.stopping_word.as_str()), ("word", "\n\n"));
        let mut s = InfillState {
            indent: Some(IndentLimit::new(4)),
            ..InfillState::default()
        };
        let (kept, next) = s.push(&delta("x\n  y", None, None), now);
        assert_eq!(kept, "x\n  ");
        assert!(matches!(next, Flow::Stop("length")));
        assert_eq!(s.stop_type, "limit");
        let mut s = InfillState {
            t_max_predict: Some(Duration::ZERO),
            ..InfillState::default()
        };
        s.push(&delta("no newline yet", None, None), now);
        let later = now + Duration::from_millis(5);
        assert!(matches!(
            s.push(&delta(" more", None, None), later).1,
            Flow::Continue
        ));
        assert!(matches!(
            s.push(&delta("\n", None, None), later).1,
            Flow::Stop(_)
        ));
    }
}
