//! Conversations persisted in localStorage, one key per conversation plus defaults.
//!
//! Invariants: a conversation is always written whole (JSON of the plain object), so a reload sees
//! either the previous or the new version, never a mix; keys are `novainfer.conv.<id>`; a corrupt
//! entry is skipped (and reported in the console), never allowed to break the page. A reply that
//! was still streaming when the page went away is restored with its partial text, marked
//! `interrupted`. A write that does not fit (quota) returns false: the caller keeps the
//! conversation in memory, tells the user and retries; nothing is dropped here.

import { randomId } from './dom.js';
import { migrate, pathOf } from './tree.js';

const PREFIX = 'novainfer.conv.';
const CURRENT_KEY = 'novainfer.current';
const DEFAULTS_KEY = 'novainfer.defaults';
const PREFS_KEY = 'novainfer.prefs';

/** Per-conversation settings; null (or empty) means "the server's default", and is not sent. */
export const EMPTY_SETTINGS = Object.freeze({
  model: '', systemPrompt: '',
  temperature: null, topP: null, topK: null, minP: null, maxTokens: null,
  repetitionPenalty: null, presencePenalty: null, frequencyPenalty: null, seed: null, stop: [],
  jsonMode: false, jsonSchema: '', tools: '', toolChoice: 'auto',
});

/** Browser-wide preferences (not per conversation). */
export const DEFAULT_PREFS = Object.freeze({ sendWithCtrlEnter: false });

export function loadPrefs() {
  try {
    const saved = JSON.parse(localStorage.getItem(PREFS_KEY) || 'null');
    return { ...DEFAULT_PREFS, ...(saved && typeof saved === 'object' ? saved : {}) };
  } catch {
    return { ...DEFAULT_PREFS };
  }
}

export function savePrefs(prefs) {
  try { localStorage.setItem(PREFS_KEY, JSON.stringify(prefs)); return true; } catch { return false; }
}

/** Settings for a new conversation: the last saved ones (model, prompt, sampling), else empty. */
export function loadDefaults() {
  try {
    const saved = JSON.parse(localStorage.getItem(DEFAULTS_KEY) || 'null');
    return { ...EMPTY_SETTINGS, ...(saved && typeof saved === 'object' ? saved : {}) };
  } catch {
    return { ...EMPTY_SETTINGS };
  }
}

/** Saves the defaults for new chats; false when storage is full. */
export function saveDefaults(settings) {
  try {
    localStorage.setItem(DEFAULTS_KEY, JSON.stringify(settings));
    return true;
  } catch {
    return false;
  }
}

export function newConversation(settings = loadDefaults()) {
  const now = Date.now();
  return {
    id: randomId('c'),
    title: '',
    titleEdited: false,
    createdAt: now,
    updatedAt: now,
    settings: { ...EMPTY_SETTINGS, ...settings },
    messages: [],
    // Which child is shown under each message (see tree.js).
    active: {},
    // Server sessions, one per branch in use (see chat.js pickSession); never exported.
    sessions: [],
  };
}

export function newMessage(role, content = '') {
  return { id: randomId('m'), role, content, reasoning: '', createdAt: Date.now() };
}

/** All stored conversations, most recently updated first. */
export function loadAll() {
  const conversations = [];
  for (let k = 0; k < localStorage.length; k += 1) {
    const key = localStorage.key(k);
    if (!key || !key.startsWith(PREFIX)) continue;
    try {
      const conv = JSON.parse(localStorage.getItem(key));
      if (!conv || typeof conv.id !== 'string' || !Array.isArray(conv.messages)) throw new Error('bad shape');
      conversations.push(normalize(conv));
    } catch (err) {
      console.warn(`NovaInfer UI: skipping unreadable stored conversation ${key}`, err);
    }
  }
  return conversations.sort((a, b) => b.updatedAt - a.updatedAt);
}

/**
 * Fills in what older versions did not store (settings added since, the message tree, per-branch
 * sessions) and marks a reply that was streaming when the page went away as interrupted.
 */
export function normalize(conv) {
  conv.settings = { ...EMPTY_SETTINGS, ...(conv.settings || {}) };
  if (!Array.isArray(conv.settings.stop)) conv.settings.stop = [];
  migrate(conv);
  if (!Array.isArray(conv.sessions)) {
    // Before branches: one session per conversation, and a fingerprint of what it stored.
    conv.sessions = conv.sessionId ? [{ id: conv.sessionId, ...(conv.sessionHistory || { model: null, count: 0, hash: null }) }] : [];
  }
  delete conv.sessionId;
  delete conv.sessionHistory;
  for (const msg of conv.messages) {
    if (msg.pending) {
      delete msg.pending;
      msg.interrupted = true;
    }
  }
  return conv;
}

/** Writes a conversation; returns false (and keeps the page working) if storage is full. */
export function save(conv) {
  try {
    localStorage.setItem(PREFIX + conv.id, JSON.stringify(conv));
    return true;
  } catch (err) {
    console.warn('NovaInfer UI: could not save the conversation (storage full?)', err);
    return false;
  }
}

/** Characters each stored conversation takes (localStorage counts UTF-16 code units). */
export function storedSizes() {
  const sizes = new Map();
  for (let k = 0; k < localStorage.length; k += 1) {
    const key = localStorage.key(k);
    if (key && key.startsWith(PREFIX)) sizes.set(key.slice(PREFIX.length), (localStorage.getItem(key) || '').length);
  }
  return sizes;
}

export function remove(id) {
  localStorage.removeItem(PREFIX + id);
}

export function loadCurrentId() { return localStorage.getItem(CURRENT_KEY); }
export function saveCurrentId(id) {
  // Which conversation is open is a convenience: when storage is full it is simply not kept.
  try {
    if (id) localStorage.setItem(CURRENT_KEY, id); else localStorage.removeItem(CURRENT_KEY);
  } catch { /* storage full */ }
}

/** The title shown in the sidebar: the user's name for it, else the start of the first question. */
export function titleOf(conv) {
  if (conv.title) return conv.title;
  // The first question of the branch shown (after an edit of it, the edited text).
  const first = pathOf(conv).find((m) => m.role === 'user');
  if (!first) return 'New chat';
  const line = first.content.trim().replace(/\s+/g, ' ');
  return line.length > 48 ? `${line.slice(0, 47)}…` : line || 'New chat';
}
