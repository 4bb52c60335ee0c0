//! What the agent APIs (`/v1/responses`, `/v1/messages`) share with chat completions before
//! the driver takes over: a conversation of chat messages and its tools, rendered with the
//! model's chat template and tokenized under the same admission, limits and output
//! constraints (tool-call grammar or structured output) as a chat request.

use std::sync::Arc;
use std::time::Instant;

use novainfer_engine::{ChatMessage, Frontend, Prompt};
use serde_json::Value;

use super::run::{prepare, Launch, Pending};
use crate::error::ApiError;
use crate::keys::Tenant;
use crate::models::ModelRef;
use crate::params::{request_timeout, sampling_params, EndpointParams};
use crate::protocol::request::SharedFields;
use crate::reasoning::prompt_opens_thinking;
use crate::state::{AppState, RequestId};
use crate::tools::Tools;

/// A conversation to answer, with the sampling fields in chat's names.
pub struct Conversation {
    pub model: ModelRef,
    pub messages: Vec<ChatMessage>,
    pub tools: Option<Tools>,
    pub shared: SharedFields,
    pub tenant: Tenant,
    pub endpoint: &'static str,
    pub response_id: String,
    /// (chat's field name, this API's) for errors the shared checks name a field in.
    pub renames: &'static [(&'static str, &'static str)],
}

/// A conversation admitted and tokenized, ready for the driver.
pub struct Prepared {
    pub pending: Pending,
    /// Split reasoning off the output (`Some(true)`: the prompt opened `<think>`).
    pub reasoning: Option<bool>,
    /// Read the output for tool calls.
    pub tool_calls: bool,
}

/// Reports `e` under this API's field names.
pub fn renamed(renames: &[(&str, &str)], mut e: ApiError) -> ApiError {
    if let Some(param) = &e.param {
        if let Some((_, to)) = renames.iter().find(|(from, _)| from == param) {
            e.param = Some((*to).to_owned());
        }
    }
    e
}

/// The template's variables besides the messages: the tools.
pub fn template_vars(tools: Option<&Tools>) -> Option<Value> {
    tools.map(|t| Value::Object(t.template_vars()))
}

/// The prompt of `messages`: rendered with the template's generation prompt, then its ids
/// (the template placed every special token, so the tokenizer adds none).
pub fn render(
    frontend: &Frontend,
    messages: &[ChatMessage],
    vars: Option<Value>,
) -> Result<(Vec<u32>, String), ApiError> {
    let text = frontend.render_chat(messages, true, false, vars)?;
    let ids = frontend.tokenizer().encode(&text, false)?;
    let ids = frontend.prompt_token_ids(&Prompt::TokenIds(ids))?;
    Ok((ids, text))
}

/// Checks, admits and tokenizes `c` as chat does (see [`super::run`]).
pub async fn prepare_conversation(
    app: &Arc<AppState>,
    request_id: &RequestId,
    arrival: Instant,
    c: Conversation,
) -> Result<Prepared, ApiError> {
    let rename = |e| renamed(c.renames, e);
    let tool_grammar = c.tools.as_ref().and_then(Tools::grammar);
    let constraint_field = match tool_grammar {
        Some(_) => "tools",
        None => crate::structured::constraint_field(c.shared.response_format.as_ref()),
    };
    let params = sampling_params(
        &c.shared,
        EndpointParams {
            max_tokens: c.shared.max_tokens,
            default_max_tokens: None,
            logprobs: None,
            extra_stop_token_ids: Vec::new(),
            constraint: tool_grammar,
        },
    )
    .map_err(rename)?;
    if c.messages.is_empty() {
        return Err(ApiError::invalid(
            "the conversation is empty: send at least one message",
        ));
    }
    let mut pending = prepare(
        app,
        request_id,
        arrival,
        Launch {
            model: c.model.clone(),
            params,
            timeout: request_timeout(&c.shared).map_err(rename)?,
            user: c.shared.user.clone(),
            tenant: c.tenant,
            priority: c.shared.priority.unwrap_or(0),
            endpoint: c.endpoint,
            response_id: c.response_id,
            constraint_field: renamed_field(c.renames, constraint_field),
        },
    )?;
    let frontend = c.model.frontend.clone();
    let vars = template_vars(c.tools.as_ref());
    let messages = c.messages;
    let prompt_text = pending
        .tokenize(move || {
            let (ids, text) = render(&frontend, &messages, vars)?;
            Ok((vec![ids], text))
        })
        .await
        .map_err(rename)?;
    Ok(Prepared {
        pending,
        reasoning: c
            .model
            .reasoning
            .then(|| prompt_opens_thinking(&prompt_text)),
        tool_calls: c.tools.as_ref().is_some_and(Tools::parses_calls),
    })
}

fn renamed_field(renames: &[(&'static str, &'static str)], field: &'static str) -> &'static str {
    renames
        .iter()
        .find(|(from, _)| *from == field)
        .map_or(field, |(_, to)| to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_take_this_apis_field_names() {
        let renames = &[
            ("max_tokens", "max_output_tokens"),
            ("response_format", "text"),
        ];
        let e = renamed(renames, ApiError::invalid_param("max_tokens", "too many"));
        assert_eq!(e.param.as_deref(), Some("max_output_tokens"));
        let e = renamed(renames, ApiError::invalid_param("top_p", "bad"));
        assert_eq!(e.param.as_deref(), Some("top_p"));
        assert_eq!(renamed_field(renames, "response_format"), "text");
        assert_eq!(renamed_field(renames, "tools"), "tools");
    }
}
