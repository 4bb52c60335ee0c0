//! One chat turn: build the request from a conversation, stream the reply into a message object,
//! and measure it.
//!
//! Invariants: the message object is the only thing mutated, and it always ends in exactly one of
//! three states: finished (`finishReason` set), stopped (`stopped: true`, partial text kept) or
//! failed (`error` set, partial text kept); `pending` is true only while the stream is open.
//! Reasoning text is shown to the user but never sent back to the model (DeepSeek-R1's guidance).

import { streamChat } from './api.js';

// Below this many milliseconds between the first and the last piece, a decode rate is noise.
const MIN_DECODE_WINDOW_MS = 50;

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
 * Whether the server's session for `conv` can take `body` as is. The server merges a request into
 * its stored conversation: a request that starts with the stored turns replaces them, any other
 * request is appended to them. After an edit, a regenerate or a system-prompt change the history
 * the UI sends no longer starts with what the server stored, and appending would show the model
 * the old turns as well; so the conversation moves to a fresh session id instead. The KV of the
 * shared prefix is still reused: the prefix cache is keyed by tokens, not by session.
 * `conv.sessionHistory` fingerprints what the server stored: {model, count, hash} or null (a
 * hash rather than a copy, so the conversation is not stored twice in localStorage).
 */
export function sessionFits(conv, body) {
  const stored = conv.sessionHistory;
  if (!stored) return true;
  if (stored.model !== body.model || stored.count > body.messages.length) return false;
  return stored.hash === fingerprint(body.messages.slice(0, stored.count));
}

/** Records what the server stores after a turn (only a finished reply is stored there). */
export function rememberTurn(conv, body, msg) {
  if (msg.error || msg.stopped || !['stop', 'length'].includes(msg.finishReason)) return;
  const messages = [...body.messages, { role: 'assistant', content: msg.content }];
  conv.sessionHistory = { model: body.model, count: messages.length, hash: fingerprint(messages) };
}

/** A 64-bit fingerprint (two FNV-1a-style 32-bit lanes, as hex) of the messages' roles and texts. */
export function fingerprint(messages) {
  const text = JSON.stringify(messages.map((m) => [m.role, m.content]));
  let a = 0x811c9dc5;
  let b = 0x9e3779b9;
  for (let k = 0; k < text.length; k += 1) {
    const c = text.charCodeAt(k);
    a = Math.imul(a ^ c, 0x01000193);
    b = Math.imul(b ^ c, 0x5bd1e995);
  }
  return (a >>> 0).toString(16).padStart(8, '0') + (b >>> 0).toString(16).padStart(8, '0');
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
  let rateOver = null;
  const decodeMs = clock.last !== null ? clock.last - clock.first : 0;
  if (completionTokens >= 2 && decodeMs >= MIN_DECODE_WINDOW_MS) {
    // Decode speed: the first token's time belongs to TTFT (prefill), not to the rate.
    tokensPerSec = ((completionTokens - 1) * 1000) / decodeMs;
    rateOver = 'decode';
  } else if (completionTokens >= 1 && clock.end > clock.start) {
    // The reply arrived in a burst (a fast model, or buffered by the network): the time between
    // its first and last piece says nothing, so rate the whole request instead.
    tokensPerSec = (completionTokens * 1000) / (clock.end - clock.start);
    rateOver = 'request';
  }
  return {
    ttftMs,
    tokensPerSec,
    rateOver,
    completionTokens,
    promptTokens: usage?.prompt_tokens ?? null,
    cachedTokens: usage?.prompt_tokens_details?.cached_tokens ?? null,
    totalMs: clock.end - clock.start,
    approx: !usage,
    finishReason: finishReason ?? null,
  };
}
