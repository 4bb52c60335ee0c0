//! One chat turn: build the request from a conversation, stream the reply into a message object,
//! and measure it.
//!
//! Invariants: the message object is the only thing `generate` mutates, and it always ends in
//! exactly one of three states: finished (`finishReason` set), stopped (`stopped: true`, partial
//! text kept) or failed (`error` set, partial text kept); `pending` is true only while the stream
//! is open. Reasoning text is shown to the user but never sent back to the model (DeepSeek-R1's
//! guidance). The messages of a request are exactly the path the user sees (tree.js pathOf).

import { streamChat } from './api.js';

// Below this many milliseconds between the first and the last piece, a decode rate is noise.
const MIN_DECODE_WINDOW_MS = 50;

/** A message as the API takes it: reasoning is never sent back; tool calls and results are. */
export function apiMessage(msg) {
  if (msg.role === 'tool') return { role: 'tool', tool_call_id: msg.toolCallId || '', content: msg.content };
  const out = { role: msg.role, content: msg.content };
  if (msg.role === 'assistant' && Array.isArray(msg.toolCalls) && msg.toolCalls.length) {
    out.tool_calls = msg.toolCalls.map((c) => ({
      id: c.id, type: 'function', function: { name: c.function.name, arguments: c.function.arguments },
    }));
  }
  return out;
}

/** Whether a message carries anything the model should see (a failed empty reply does not). */
function worthSending(msg) {
  if (msg.role !== 'assistant') return true;
  return Boolean(msg.content) || Boolean(msg.toolCalls?.length);
}

/**
 * The request body for a turn. `history` is the path shown up to (not including) the reply being
 * generated; with `continueFrom` (a cut-off reply) the history ends with that reply and the model
 * continues its text (vLLM's continue_final_message). `features` is the server's /server_info
 * feature list (tools are sent only to a server that has them).
 */
export function buildRequest(conv, history, availableModels, { continueFrom = null, features = {} } = {}) {
  const settings = conv.settings;
  const messages = [];
  if (settings.systemPrompt && settings.systemPrompt.trim()) {
    messages.push({ role: 'system', content: settings.systemPrompt });
  }
  for (const msg of history) {
    if (worthSending(msg)) messages.push(apiMessage(msg));
  }
  const body = { model: settings.model || availableModels[0] || '', messages };
  if (continueFrom) {
    messages.push({ role: 'assistant', content: continueFrom.content });
    body.add_generation_prompt = false;
    body.continue_final_message = true;
  }
  Object.assign(body, samplingFields(settings));
  const format = responseFormat(settings);
  if (format) body.response_format = format;
  const tools = features.tool_calls ? parseTools(settings.tools) : null;
  if (tools && tools.length) {
    body.tools = tools;
    // `auto` is the server's default, so it is not sent.
    if (settings.toolChoice === 'required' || settings.toolChoice === 'none') body.tool_choice = settings.toolChoice;
  }
  return body;
}

// [settings key, request field]: numbers sent as they are when set.
export const SAMPLING_FIELDS = [
  ['temperature', 'temperature'], ['topP', 'top_p'], ['topK', 'top_k'], ['minP', 'min_p'],
  ['maxTokens', 'max_tokens'], ['repetitionPenalty', 'repetition_penalty'],
  ['presencePenalty', 'presence_penalty'], ['frequencyPenalty', 'frequency_penalty'], ['seed', 'seed'],
];

/** The sampling fields of a request: only those set, so the server's defaults apply to the rest. */
export function samplingFields(settings) {
  const out = {};
  for (const [key, field] of SAMPLING_FIELDS) {
    const v = settings[key];
    if (v !== null && v !== undefined && Number.isFinite(v)) out[field] = v;
  }
  const stop = (settings.stop || []).filter((s) => typeof s === 'string' && s !== '');
  if (stop.length) out.stop = stop;
  return out;
}

/** OpenAI's response_format for JSON mode: the schema when one is given, else any JSON object. */
export function responseFormat(settings) {
  if (!settings.jsonMode) return null;
  const text = (settings.jsonSchema || '').trim();
  if (!text) return { type: 'json_object' };
  return { type: 'json_schema', json_schema: { name: 'ui_schema', schema: JSON.parse(text), strict: true } };
}

/** The tool definitions (a JSON array of OpenAI tools) of the settings, or null. */
export function parseTools(text) {
  if (!text || !text.trim()) return null;
  const tools = JSON.parse(text);
  return Array.isArray(tools) ? tools : null;
}

/**
 * Whether the server session `record` can take `body` as is. The server merges a request into
 * its stored conversation: a request that starts with the stored turns replaces them, any other
 * request is appended to them. A record fingerprints what the server stored ({id, model, count,
 * hash}; a hash rather than a copy, so the conversation is not stored twice in localStorage).
 */
export function sessionFits(record, body) {
  if (!record || !record.count) return true;
  if (record.model !== body.model || record.count > body.messages.length) return false;
  return record.hash === fingerprint(body.messages.slice(0, record.count));
}

// Sessions kept per conversation (one per branch in use); the least recently used goes first.
const MAX_SESSIONS = 8;

/**
 * The server session for this turn: one whose stored conversation the request extends (the
 * branch this turn continues, so switching back to a branch resumes its session), the longest
 * such; else a fresh one. Either way the prefix cache (keyed by tokens, not sessions) serves the
 * KV of what the branches share.
 */
export function pickSession(conv, body, makeId) {
  conv.sessions ||= [];
  const fitting = conv.sessions.filter((r) => r.count && sessionFits(r, body))
    .sort((a, b) => b.count - a.count);
  let record = fitting[0] || conv.sessions.find((r) => !r.count);
  if (!record) {
    record = { id: makeId(), model: null, count: 0, hash: null };
    conv.sessions.push(record);
  }
  record.usedAt = Date.now();
  conv.sessions.sort((a, b) => (b.usedAt || 0) - (a.usedAt || 0));
  conv.sessions.length = Math.min(conv.sessions.length, MAX_SESSIONS);
  return record;
}

/** Records what the server stores after a turn (only a finished reply is stored there). */
export function rememberTurn(record, body, msg) {
  if (!record || msg.error || msg.stopped || !['stop', 'length'].includes(msg.finishReason)) return;
  const messages = [...body.messages, { role: 'assistant', content: msg.content }];
  Object.assign(record, { model: body.model, count: messages.length, hash: fingerprint(messages) });
}

/** A 64-bit fingerprint (two FNV-1a-style 32-bit lanes, as hex) of the messages' roles and texts. */
export function fingerprint(messages) {
  const text = JSON.stringify(messages.map((m) => [m.role, m.content, m.tool_calls ?? null, m.tool_call_id ?? null]));
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
 * request (so Stop can cancel it by id); `onUpdate()` fires after each piece of text. With
 * `append` (continuing a cut-off reply) the new text is added to what `msg` already holds.
 */
export async function generate({ msg, body, signal, append = false, onRequestId = () => {}, onUpdate = () => {} }) {
  if (!append) {
    msg.content = '';
    msg.reasoning = '';
    delete msg.toolCalls;
  }
  msg.model = body.model;
  delete msg.error;
  delete msg.stopped;
  delete msg.interrupted;
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
      if (Array.isArray(delta.tool_calls) && delta.tool_calls.length) {
        msg.toolCalls = mergeToolCallDeltas(msg.toolCalls || [], delta.tool_calls);
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
 * Folds streamed `delta.tool_calls` fragments into whole calls (OpenAI's shape): the fragment's
 * `index` says which call it belongs to; `id`, `type` and `function.name` come whole (usually in
 * the first fragment), `function.arguments` arrives in pieces that are concatenated.
 */
export function mergeToolCallDeltas(calls, fragments) {
  const out = calls.map((c) => ({ ...c, function: { ...c.function } }));
  for (const f of fragments) {
    if (!f || typeof f !== 'object') continue;
    const index = Number.isInteger(f.index) ? f.index : out.length;
    while (out.length <= index) out.push({ id: '', type: 'function', function: { name: '', arguments: '' } });
    const call = out[index];
    if (typeof f.id === 'string' && f.id) call.id = f.id;
    if (typeof f.type === 'string' && f.type) call.type = f.type;
    if (typeof f.function?.name === 'string' && f.function.name) call.function.name += f.function.name;
    if (typeof f.function?.arguments === 'string') call.function.arguments += f.function.arguments;
  }
  return out;
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
    speculative: speculativeOf(usage),
  };
}

/**
 * Speculative-decoding acceptance, when the server reports it: `usage.speculative_decoding =
 * {num_draft_tokens, num_accepted_tokens}` (see docs/webui.md). Null otherwise, and then the UI
 * shows nothing about it.
 */
export function speculativeOf(usage) {
  const s = usage?.speculative_decoding;
  if (!s || !Number.isFinite(s.num_draft_tokens) || !Number.isFinite(s.num_accepted_tokens)) return null;
  if (s.num_draft_tokens <= 0) return null;
  return { draft: s.num_draft_tokens, accepted: s.num_accepted_tokens, rate: s.num_accepted_tokens / s.num_draft_tokens };
}
