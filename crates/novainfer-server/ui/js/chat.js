//! One chat turn: build the request from a conversation, stream the reply into a message object,
//! and measure it.
//!
//! Invariants: the message object is the only thing mutated, and it always ends in exactly one of
//! three states: finished (`finishReason` set), stopped (`stopped: true`, partial text kept) or
//! failed (`error` set, partial text kept); `pending` is true only while the stream is open.
//! Reasoning text is shown to the user but never sent back to the model (DeepSeek-R1's guidance).

import { streamChat } from './api.js';

/** The request body for generating the reply at `conv.messages[replyIndex]`. */
export function buildRequest(conv, replyIndex, availableModels) {
  const settings = conv.settings;
  const messages = [];
  if (settings.systemPrompt && settings.systemPrompt.trim()) {
    messages.push({ role: 'system', content: settings.systemPrompt });
  }
  for (const msg of conv.messages.slice(0, replyIndex)) {
    // A failed reply with no text carries nothing the model should see.
    if (msg.role === 'assistant' && !msg.content) continue;
    messages.push({ role: msg.role, content: msg.content });
  }
  const body = { model: settings.model || availableModels[0] || '', messages, session_id: conv.sessionId };
  if (settings.temperature !== null && settings.temperature !== undefined) body.temperature = settings.temperature;
  if (settings.topP !== null && settings.topP !== undefined) body.top_p = settings.topP;
  if (settings.maxTokens !== null && settings.maxTokens !== undefined) body.max_tokens = settings.maxTokens;
  return body;
}

/**
 * Streams the reply for `body` into `msg`. `onRequestId(id)` fires once the server names the
 * request (so Stop can cancel it by id); `onUpdate()` fires after each piece of text.
 */
export async function generate({ msg, body, signal, onRequestId = () => {}, onUpdate = () => {} }) {
  msg.content = '';
  msg.reasoning = '';
  msg.model = body.model;
  delete msg.error;
  delete msg.stopped;
  delete msg.finishReason;
  delete msg.telemetry;
  msg.pending = true;

  const clock = { start: performance.now(), first: null, last: null, end: null, pieces: 0 };
  let usage = null;
  let requestId = null;
  try {
    for await (const chunk of streamChat(body, signal)) {
      if (!requestId && typeof chunk.id === 'string') {
        requestId = chunk.id;
        onRequestId(requestId);
      }
      if (chunk.usage) usage = chunk.usage;
      const choice = Array.isArray(chunk.choices) ? chunk.choices[0] : null;
      if (!choice) continue;
      const delta = choice.delta || {};
      let grew = false;
      if (typeof delta.reasoning_content === 'string' && delta.reasoning_content) {
        msg.reasoning += delta.reasoning_content;
        grew = true;
      }
      if (typeof delta.content === 'string' && delta.content) {
        msg.content += delta.content;
        grew = true;
      }
      if (grew) {
        const now = performance.now();
        clock.first ??= now;
        clock.last = now;
        clock.pieces += 1;
        onUpdate();
      }
      if (choice.finish_reason) msg.finishReason = choice.finish_reason;
    }
  } catch (err) {
    if (err?.name === 'AbortError') {
      msg.stopped = true;
    } else {
      msg.error = {
        message: err?.message || String(err), status: err?.status || 0, kind: err?.kind || 'unknown',
        retryAfter: err?.retryAfter ?? null, type: err?.type ?? null,
      };
    }
  } finally {
    clock.end = performance.now();
    delete msg.pending;
    msg.telemetry = telemetry(clock, usage, msg.finishReason);
    msg.requestId = requestId;
  }
  return msg;
}

/**
 * What the user sees under a reply. Token counts come from the usage chunk when the server sent
 * one; otherwise (stopped, failed) from the number of streamed pieces, flagged `approx`.
 */
export function telemetry(clock, usage, finishReason) {
  const completionTokens = usage?.completion_tokens ?? clock.pieces;
  const ttftMs = clock.first === null ? null : clock.first - clock.start;
  let tokensPerSec = null;
  const decodeMs = clock.last !== null ? clock.last - clock.first : 0;
  if (completionTokens >= 2 && decodeMs >= 1) {
    // Decode speed: the first token's time belongs to TTFT (prefill), not to the rate.
    tokensPerSec = ((completionTokens - 1) * 1000) / decodeMs;
  } else if (completionTokens >= 1 && clock.end > clock.start) {
    tokensPerSec = (completionTokens * 1000) / (clock.end - clock.start);
  }
  return {
    ttftMs,
    tokensPerSec,
    completionTokens,
    promptTokens: usage?.prompt_tokens ?? null,
    cachedTokens: usage?.prompt_tokens_details?.cached_tokens ?? null,
    totalMs: clock.end - clock.start,
    approx: !usage,
    finishReason: finishReason ?? null,
  };
}
