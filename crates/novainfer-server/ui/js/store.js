//! Conversations persisted in localStorage, one key per conversation plus defaults.
//!
//! Invariants: a conversation is always written whole (JSON of the plain object), so a reload sees
//! either the previous or the new version, never a mix; keys are `novainfer.conv.<id>`; a corrupt
//! entry is skipped (and reported in the console), never allowed to break the page. A reply that
//! was still streaming when the page went away is restored as interrupted, with a retry.

import { randomId } from './dom.js';

const PREFIX = 'novainfer.conv.';
const CURRENT_KEY = 'novainfer.current';
const DEFAULTS_KEY = 'novainfer.defaults';

export const EMPTY_SETTINGS = Object.freeze({
  model: '', systemPrompt: '', temperature: null, topP: null, maxTokens: null,
});

/** Settings for a new conversation: the last saved ones (model, prompt, sampling), else empty. */
export function loadDefaults() {
  try {
    const saved = JSON.parse(localStorage.getItem(DEFAULTS_KEY) || 'null');
    return { ...EMPTY_SETTINGS, ...(saved && typeof saved === 'object' ? saved : {}) };
  } catch {
    return { ...EMPTY_SETTINGS };
  }
}

export function saveDefaults(settings) {
  localStorage.setItem(DEFAULTS_KEY, JSON.stringify(settings));
}

export function newConversation(settings = loadDefaults()) {
  const now = Date.now();
  return {
    id: randomId('c'),
    // One server session per conversation: its turns reuse the KV of earlier turns.
    sessionId: randomId('ui-'),
    title: '',
    titleEdited: false,
    createdAt: now,
    updatedAt: now,
    settings: { ...settings },
    messages: [],
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
      conv.settings = { ...EMPTY_SETTINGS, ...(conv.settings || {}) };
      for (const msg of conv.messages) {
        if (msg.pending) {
          delete msg.pending;
          msg.error = { message: 'This reply was interrupted when the page closed.', kind: 'interrupted' };
        }
      }
      conversations.push(conv);
    } catch (err) {
      console.warn(`NovaInfer UI: skipping unreadable stored conversation ${key}`, err);
    }
  }
  return conversations.sort((a, b) => b.updatedAt - a.updatedAt);
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

export function remove(id) {
  localStorage.removeItem(PREFIX + id);
}

export function loadCurrentId() { return localStorage.getItem(CURRENT_KEY); }
export function saveCurrentId(id) {
  if (id) localStorage.setItem(CURRENT_KEY, id); else localStorage.removeItem(CURRENT_KEY);
}

/** The title shown in the sidebar: the user's name for it, else the start of the first question. */
export function titleOf(conv) {
  if (conv.title) return conv.title;
  const first = conv.messages.find((m) => m.role === 'user');
  if (!first) return 'New chat';
  const line = first.content.trim().replace(/\s+/g, ' ');
  return line.length > 48 ? `${line.slice(0, 47)}…` : line || 'New chat';
}
