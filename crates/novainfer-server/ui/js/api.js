//! The server's API as the UI uses it: model list, server info, tokenize, streamed chat, cancel.
//!
//! Invariants: every failure surfaces as an `ApiError` carrying what a person needs to act
//! (HTTP status, the server's message, Retry-After seconds, whether retrying can help); an abort
//! by the caller surfaces as a DOMException named "AbortError" and nothing else.

import { SseParser } from './sse.js';

const API_KEY_STORAGE = 'novainfer.apiKey';

export class ApiError extends Error {
  constructor(message, { status = 0, type = null, code = null, param = null, retryAfter = null, kind = 'http' } = {}) {
    super(message);
    this.name = 'ApiError';
    this.status = status;
    this.type = type;
    this.code = code;
    this.param = param;
    this.retryAfter = retryAfter;
    // 'http' (the server answered with an error), 'network' (no answer / lost connection),
    // 'stream' (an error event inside the stream), 'protocol' (an answer we cannot read).
    this.kind = kind;
  }
}

export function getApiKey() { return localStorage.getItem(API_KEY_STORAGE) || ''; }
export function setApiKey(key) {
  if (key) localStorage.setItem(API_KEY_STORAGE, key); else localStorage.removeItem(API_KEY_STORAGE);
}

function headers(extra = {}) {
  const key = getApiKey();
  return { ...(key ? { Authorization: `Bearer ${key}` } : {}), ...extra };
}

/** Parses Retry-After (seconds or an HTTP date) into whole seconds, or null. */
export function parseRetryAfter(value) {
  if (!value) return null;
  if (/^\d+$/.test(value.trim())) return parseInt(value, 10);
  const at = Date.parse(value);
  return Number.isNaN(at) ? null : Math.max(0, Math.ceil((at - Date.now()) / 1000));
}

async function errorFromResponse(response) {
  let message = `${response.status} ${response.statusText || 'error'}`.trim();
  let details = {};
  try {
    const text = await response.text();
    try {
      const body = JSON.parse(text);
      const err = body && typeof body === 'object' ? (body.error ?? body) : null;
      if (err && typeof err === 'object') {
        if (typeof err.message === 'string' && err.message) message = err.message;
        details = { type: err.type ?? null, code: err.code ?? null, param: err.param ?? null };
      } else if (typeof err === 'string') {
        message = err;
      }
    } catch {
      if (text.trim()) message = text.trim().slice(0, 500);
    }
  } catch { /* body unreadable: keep the status line */ }
  return new ApiError(message, {
    status: response.status, ...details, retryAfter: parseRetryAfter(response.headers.get('Retry-After')),
  });
}

async function send(url, init) {
  try {
    return await fetch(url, init);
  } catch (err) {
    if (err?.name === 'AbortError') throw err;
    throw new ApiError('Could not reach the server (connection refused or lost).', { kind: 'network' });
  }
}

/** GET /v1/models → the model cards ({id, max_model_len, ...}) with a string id. */
export async function listModels() {
  const response = await send('v1/models', { headers: headers() });
  if (!response.ok) throw await errorFromResponse(response);
  const body = await response.json();
  return (body?.data ?? []).filter((m) => m && typeof m.id === 'string');
}

/**
 * GET /server_info → {version, models: [{id, max_model_len, device, kv_cache, prefix_cache,
 * features}]}, or null from a server without it (older builds, other OpenAI servers).
 */
export async function serverInfo() {
  const response = await send('server_info', { headers: headers() });
  if (response.status === 404) return null;
  if (!response.ok) throw await errorFromResponse(response);
  return response.json();
}

/** POST /tokenize with chat messages → {count, max_model_len}. */
export async function tokenizeChat(model, messages, addGenerationPrompt) {
  const response = await send('tokenize', {
    method: 'POST', headers: headers({ 'Content-Type': 'application/json' }),
    body: JSON.stringify({ model, messages, add_generation_prompt: addGenerationPrompt }),
  });
  if (!response.ok) throw await errorFromResponse(response);
  return response.json();
}

/**
 * POST /v1/chat/completions with stream:true; yields each parsed chunk object.
 * Ends normally only after `data: [DONE]`; a stream that stops before it is a lost connection.
 */
export async function* streamChat(body, signal) {
  const response = await send('v1/chat/completions', {
    method: 'POST', signal, headers: headers({ 'Content-Type': 'application/json', Accept: 'text/event-stream' }),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
  });
  if (!response.ok) throw await errorFromResponse(response);
  if (!response.body) throw new ApiError('The server sent no stream.', { kind: 'protocol' });
  const reader = response.body.getReader();
  const parser = new SseParser();
  try {
    for (;;) {
      let result;
      try {
        result = await reader.read();
      } catch (err) {
        if (err?.name === 'AbortError' || signal?.aborted) throw abortError();
        throw new ApiError('The connection to the server was lost mid-reply.', { kind: 'network' });
      }
      const events = result.done ? parser.end() : parser.push(result.value);
      for (const data of events) {
        if (data.trim() === '[DONE]') return;
        let chunk;
        try { chunk = JSON.parse(data); } catch {
          throw new ApiError(`Unreadable stream event: ${data.slice(0, 200)}`, { kind: 'protocol' });
        }
        if (chunk?.error) {
          const e = chunk.error;
          throw new ApiError(typeof e === 'string' ? e : (e.message || 'The server reported an error.'),
            { kind: 'stream', status: e.code && Number.isInteger(e.code) ? e.code : 0, type: e.type ?? null });
        }
        yield chunk;
      }
      if (result.done) {
        throw new ApiError('The connection to the server was lost mid-reply.', { kind: 'network' });
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function abortError() {
  return new DOMException('The request was stopped.', 'AbortError');
}

/** POST /v1/requests/{id}/cancel; best effort (the aborted fetch also cancels server-side). */
export async function cancelRequest(requestId) {
  try {
    await fetch(`v1/requests/${encodeURIComponent(requestId)}/cancel`, { method: 'POST', headers: headers(), keepalive: true });
  } catch { /* the disconnect of the aborted stream cancels it anyway */ }
}
