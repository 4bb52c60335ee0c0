//! `POST /v1/chat/completions`: a conversation rendered with the model's chat template,
//! optionally continued from a server-kept session, streamed as `chat.completion.chunk`s
//! (the first delta of each choice carries the role) or returned whole; reasoning models
//! get `reasoning_content` split from `content`.

use std::sync::Arc;
use std::time::Instant;

use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::{extract::State, Extension};
use novainfer_engine::{ChatMessage, Prompt, StopReason};

use super::completions::sse_response;
use super::run::{prepare, stream_after_start, Event, Launch, Pending, Running};
use super::{JsonBody, LoggedByHandler};
use crate::accounting::{chat_logprobs, stop_reason_json};
use crate::error::ApiError;
use crate::keys::Tenant;
use crate::params::{request_timeout, sampling_params, EndpointParams};
use crate::protocol::inputs;
use crate::protocol::request::{parse_generation, ChatRequest};
use crate::protocol::response::{
    unix_now, ChatChoice, ChatCompletion, ChatMessageOut, Usage, SYSTEM_FINGERPRINT,
};
use crate::reasoning::{prompt_opens_thinking, ReasoningSplitter, Split};
use crate::sessions::MAX_SESSION_ID_LEN;
use crate::sse;
use crate::state::{AppState, RequestId};

/// Where to store the finished turn.
struct SessionTurn {
    tenant: Tenant,
    id: String,
    conversation: Vec<ChatMessage>,
}

fn session_id(body: Option<String>, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let header = headers.get("x-session-id").map(|v| {
        v.to_str().map(str::to_owned).map_err(|_| {
            ApiError::invalid_param("session_id", "X-Session-Id must be visible ASCII")
        })
    });
    let id = match (body, header) {
        (Some(id), _) => Some(id),
        (None, Some(h)) => Some(h?),
        (None, None) => None,
    };
    match id {
        Some(id) if id.is_empty() || id.len() > MAX_SESSION_ID_LEN => Err(ApiError::invalid_param(
            "session_id",
            format!(
                "session_id must have 1 to {MAX_SESSION_ID_LEN} characters, got {}",
                id.len()
            ),
        )),
        id => Ok(id),
    }
}

pub async fn chat_completions(
    State(app): State<Arc<AppState>>,
    Extension(request_id): Extension<RequestId>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let req: ChatRequest = parse_generation(&body)?;
    crate::ignored::log_once("chat", &req.ignored);
    let model = app.models.get(req.shared.model.as_deref())?;
    let add_generation_prompt = req.own.add_generation_prompt.unwrap_or(true);
    let continue_final = req.own.continue_final_message.unwrap_or(false);
    if continue_final && add_generation_prompt {
        // As in vLLM: the two ask for opposite prompt endings.
        return Err(ApiError::invalid_param(
            "continue_final_message",
            "continue_final_message needs add_generation_prompt: false",
        ));
    }
    let template_kwargs = req
        .own
        .chat_template_kwargs
        .clone()
        .map(serde_json::Value::Object);
    let messages = inputs::messages(&req.own.messages)?;
    let session = session_id(req.own.session_id.clone(), &headers)?;
    let logprobs = match (req.own.logprobs.unwrap_or(false), req.own.top_logprobs) {
        (true, top) => Some(top.unwrap_or(0)),
        (false, Some(_)) => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ))
        }
        (false, None) => None,
    };
    let params = sampling_params(
        &req.shared,
        EndpointParams {
            max_tokens: req.own.max_completion_tokens.or(req.shared.max_tokens),
            default_max_tokens: None,
            logprobs,
            extra_stop_token_ids: Vec::new(),
        },
    )?;
    let conversation = match &session {
        Some(id) => app
            .sessions
            .conversation(tenant, &model.name, id, messages, arrival),
        None => messages,
    };
    if conversation.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "`messages` must not be empty",
        ));
    }
    let response_id = format!("chatcmpl-{}", request_id.0);
    let stream = req.shared.stream.unwrap_or(false);
    let include_usage = req.shared.include_usage();
    let mut pending = prepare(
        &app,
        &request_id,
        arrival,
        Launch {
            model: model.clone(),
            params,
            timeout: request_timeout(&req.shared)?,
            user: req.shared.user.clone(),
            tenant,
            priority: req.shared.priority.unwrap_or(0),
            endpoint: "chat",
            response_id: response_id.clone(),
        },
    )?;
    let frontend = model.frontend.clone();
    let rendered = conversation.clone();
    let prompt_text = pending
        .tokenize(move || {
            let text = frontend.render_chat(
                &rendered,
                add_generation_prompt,
                continue_final,
                template_kwargs,
            )?;
            // The template already placed every special token: add none (as transformers does).
            let ids = frontend.tokenizer().encode(&text, false)?;
            let ids = frontend.prompt_token_ids(&Prompt::TokenIds(ids))?;
            Ok((vec![ids], text))
        })
        .await?;
    let shape = Shape {
        id: response_id,
        model: model.name.clone(),
        created: unix_now(),
        reasoning: model.reasoning,
        thinking_opened: prompt_opens_thinking(&prompt_text),
    };
    let turn = session.map(|id| SessionTurn {
        tenant,
        id,
        conversation,
    });
    let mut response = if stream {
        streaming(app, pending, shape, include_usage, turn)
    } else {
        whole(app, pending.start().await?, shape, turn).await?
    };
    response.extensions_mut().insert(LoggedByHandler);
    Ok(response)
}

struct Shape {
    id: String,
    model: String,
    created: u64,
    reasoning: bool,
    thinking_opened: bool,
}

impl Shape {
    fn object(
        &self,
        object: &'static str,
        choices: Vec<ChatChoice>,
        usage: Option<Usage>,
    ) -> ChatCompletion {
        ChatCompletion {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: SYSTEM_FINGERPRINT,
            choices,
            usage,
        }
    }

    fn chunk(
        &self,
        index: usize,
        delta: ChatMessageOut,
        logprobs: Option<crate::protocol::response::ChatLogprobs>,
        finish: Option<&'static str>,
        stop_reason: Option<&StopReason>,
    ) -> ChatCompletion {
        let choice = ChatChoice {
            index,
            message: None,
            delta: Some(delta),
            logprobs,
            finish_reason: finish,
            stop_reason: stop_reason_json(stop_reason),
        };
        self.object("chat.completion.chunk", vec![choice], None)
    }

    fn split(&self, text: &str) -> Split {
        if self.reasoning {
            ReasoningSplitter::split_all(self.thinking_opened, text)
        } else {
            Split {
                reasoning: String::new(),
                content: text.to_owned(),
            }
        }
    }
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

/// Stores the turn when the first choice finished normally.
fn remember(app: &AppState, running: &Running, shape: &Shape, turn: Option<SessionTurn>) {
    let Some(turn) = turn else { return };
    let Some(first) = running.run.choices.first() else {
        return;
    };
    if matches!(first.finish_reason, Some("stop" | "length")) {
        let reply = shape.split(&first.text).content;
        app.sessions.store(
            turn.tenant,
            &running.model.name,
            &turn.id,
            turn.conversation,
            reply,
            Instant::now(),
        );
    }
}

async fn whole(
    app: Arc<AppState>,
    mut running: Running,
    shape: Shape,
    turn: Option<SessionTurn>,
) -> Result<Response, ApiError> {
    running.collect().await?;
    remember(&app, &running, &shape, turn);
    let tokenizer = running.model.frontend.tokenizer().clone();
    let choices = running
        .run
        .choices
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let split = shape.split(&c.text);
            ChatChoice {
                index,
                message: Some(ChatMessageOut {
                    role: Some("assistant"),
                    content: Some(split.content),
                    reasoning_content: if shape.reasoning {
                        non_empty(split.reasoning)
                    } else {
                        None
                    },
                }),
                delta: None,
                logprobs: (!c.logprobs.is_empty()).then(|| chat_logprobs(&tokenizer, &c.logprobs)),
                finish_reason: Some(c.finish_reason.unwrap_or("abort")),
                stop_reason: stop_reason_json(c.stop_reason.as_ref()),
            }
        })
        .collect();
    let usage = running.run.usage();
    Ok(axum::Json(shape.object("chat.completion", choices, Some(usage))).into_response())
}

fn streaming(
    app: Arc<AppState>,
    pending: Pending,
    shape: Shape,
    include_usage: bool,
    turn: Option<SessionTurn>,
) -> Response {
    let period = app.keep_alive;
    let keep_alive = Some(period);
    let body = stream_after_start(pending, period, move |mut running: Running| {
        async_stream::stream! {
            let tokenizer = running.model.frontend.tokenizer().clone();
            let num_choices = running.run.choices.len();
            let mut splitters = vec![ReasoningSplitter::new(shape.thinking_opened); num_choices];
            for index in 0..num_choices {
                let role = ChatMessageOut { role: Some("assistant"), content: Some(String::new()), reasoning_content: None };
                yield sse::data(&shape.chunk(index, role, None, None, None));
            }
            loop {
                match running.next_event(keep_alive).await {
                    Event::Delta(prompt, delta) => {
                        let index = running.record(prompt, &delta);
                        let mut split = if shape.reasoning {
                            splitters[index].push(&delta.text)
                        } else {
                            Split { reasoning: String::new(), content: delta.text.clone() }
                        };
                        if delta.finish_reason.is_some() && shape.reasoning {
                            let tail = splitters[index].finish();
                            split.reasoning.push_str(&tail.reasoning);
                            split.content.push_str(&tail.content);
                        }
                        let logprobs = (!delta.logprobs.is_empty()).then(|| chat_logprobs(&tokenizer, &delta.logprobs));
                        let has_text = !split.content.is_empty() || !split.reasoning.is_empty();
                        if has_text || logprobs.is_some() {
                            let out = ChatMessageOut { role: None, content: non_empty(split.content), reasoning_content: non_empty(split.reasoning) };
                            yield sse::data(&shape.chunk(index, out, logprobs, None, None));
                        }
                        if let Some(reason) = delta.finish_reason {
                            yield sse::data(&shape.chunk(index, ChatMessageOut::default(), None, Some(reason.as_str()), delta.stop_reason.as_ref()));
                        }
                    }
                    Event::KeepAlive => yield sse::keep_alive(),
                    Event::Failed(e) => {
                        yield sse::data(&ApiError::from(e).body());
                        break;
                    }
                    Event::TimedOut => {
                        yield sse::data(&running.timeout_error().body());
                        break;
                    }
                    Event::Ended => {
                        // Choices that never got their final delta (cancelled while queued) end here.
                        for (index, _) in running.run.choices.iter().enumerate().filter(|(_, c)| c.finish_reason.is_none()) {
                            yield sse::data(&shape.chunk(index, ChatMessageOut::default(), None, Some("abort"), None));
                        }
                        remember(&app, &running, &shape, turn);
                        if include_usage {
                            yield sse::data(&shape.object("chat.completion.chunk", Vec::new(), Some(running.run.usage())));
                        }
                        break;
                    }
                }
            }
            yield sse::done();
        }
    });
    sse_response(body)
}
