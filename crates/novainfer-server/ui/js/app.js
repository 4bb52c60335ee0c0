//! The chat app's controller: owns the conversations, runs generations, wires the views together.
//!
//! Invariants: at most one reply streams per conversation (several conversations may stream at
//! once); every change to a conversation is saved before the next render; Stop both aborts the
//! fetch (the server cancels on disconnect) and calls the cancel endpoint once the request id is
//! known; the composer keeps the keyboard focus across sending and stopping.

import { announce, randomId } from './dom.js';
import { cancelRequest, listModels } from './api.js';
import { buildRequest, generate, rememberTurn, sessionFits } from './chat.js';
import { autoGrow, MessageView } from './messages.js';
import { SettingsDialog } from './settings.js';
import { Sidebar } from './sidebar.js';
import * as store from './store.js';

const $ = (id) => document.getElementById(id);

const state = {
  conversations: store.loadAll(),
  currentId: null,
  models: [],
  modelsError: null,
  generations: new Map(), // conversation id → { controller, requestId, msg }
};

const view = new MessageView($('messages'), {
  // The clicked control disappears in the re-render: keep the keyboard in the composer, where Esc stops.
  onEdit: (msg, text) => { editAndRegenerate(current(), msg, text); $('prompt').focus(); },
  onRegenerate: (msg) => { regenerate(current(), msg); $('prompt').focus(); },
  onRetry: (msg) => { regenerate(current(), msg); $('prompt').focus(); },
  onSuggestion: (text) => { $('prompt').value = text; $('prompt').dispatchEvent(new Event('input')); $('prompt').focus(); },
});

const sidebar = new Sidebar({
  root: $('sidebar'), list: $('conv-list'), menuButton: $('menu-btn'), backdrop: $('backdrop'), main: $('main'),
}, {
  onSelect: (id) => { switchTo(id); $('prompt').focus(); },
  onRename: (id, title) => rename(id, title),
  onDelete: (id) => removeConversation(id),
});

const settingsDialog = new SettingsDialog($('settings-dialog'), (settings) => {
  const conv = current();
  conv.settings = { ...conv.settings, ...settings };
  store.saveDefaults(conv.settings);
  touch(conv, false);
  renderAll();
  announce('Settings saved');
});

function current() {
  return state.conversations.find((c) => c.id === state.currentId);
}

function find(id) {
  return state.conversations.find((c) => c.id === id);
}

// Saves a conversation; `bump` moves it to the top of the list (new activity).
function touch(conv, bump = true) {
  if (bump) {
    conv.updatedAt = Date.now();
    state.conversations.sort((a, b) => b.updatedAt - a.updatedAt);
  }
  store.save(conv);
}

// ------------------------------------------------------------------ rendering

function renderAll(options) {
  renderSidebar();
  renderChat(options);
}

function renderSidebar() {
  sidebar.render({
    conversations: state.conversations, currentId: state.currentId, busyIds: new Set(state.generations.keys()),
  });
}

function renderChat({ toEnd = false } = {}) {
  const conv = current();
  const busy = state.generations.has(conv.id);
  const title = store.titleOf(conv);
  $('conv-title').textContent = title;
  document.title = `${title} · NovaInfer`;
  const model = conv.settings.model || state.models[0] || '';
  $('model-badge').textContent = model || 'no model';
  $('model-badge').title = model ? `Model: ${model}` : 'No model loaded';
  view.render(conv, { busy, toEnd, emptyHint: state.modelsError ? `Server unreachable: ${state.modelsError}` : null });
  renderComposer();
}

function renderComposer() {
  const busy = state.generations.has(state.currentId);
  $('send-btn').hidden = busy;
  $('stop-btn').hidden = !busy;
  $('send-btn').disabled = $('prompt').value.trim() === '';
}

// Streaming text arrives faster than the screen refreshes: render at most once per frame.
const dirty = new Set();
function scheduleUpdate(conv, msg) {
  if (dirty.has(msg)) return;
  dirty.add(msg);
  requestAnimationFrame(() => {
    dirty.delete(msg);
    if (conv.id === state.currentId) view.update(msg);
  });
}

// ------------------------------------------------------------------ conversations

function switchTo(id) {
  if (!find(id)) return;
  state.currentId = id;
  store.saveCurrentId(id);
  view.editingId = null;
  renderAll();
}

function createConversation() {
  const conv = current();
  // An empty conversation is reused rather than stacking up blank ones.
  if (conv && conv.messages.length === 0 && !conv.titleEdited) {
    sidebar.close({ restoreFocus: false });
    $('prompt').focus();
    return;
  }
  const fresh = store.newConversation();
  state.conversations.unshift(fresh);
  touch(fresh);
  switchTo(fresh.id);
  sidebar.close({ restoreFocus: false });
  $('prompt').focus();
  announce('New conversation');
}

function rename(id, title) {
  const conv = find(id);
  conv.title = title;
  conv.titleEdited = true;
  touch(conv, false);
  renderAll();
  announce(`Renamed to ${title}`);
}

function removeConversation(id) {
  stop(id);
  const index = state.conversations.findIndex((c) => c.id === id);
  const [gone] = state.conversations.splice(index, 1);
  store.remove(id);
  if (state.conversations.length === 0) {
    const fresh = store.newConversation();
    state.conversations.push(fresh);
    touch(fresh);
  }
  if (state.currentId === id) {
    switchTo(state.conversations[Math.min(index, state.conversations.length - 1)].id);
  } else {
    renderSidebar();
  }
  announce(`Deleted ${store.titleOf(gone)}`);
  (document.querySelector('#conv-list .conv-select[aria-current="true"]') || $('new-chat-btn')).focus();
}

// ------------------------------------------------------------------ generation

async function run(conv, msg) {
  const controller = new AbortController();
  const generation = { controller, requestId: null, msg };
  state.generations.set(conv.id, generation);
  const body = buildRequest(conv, conv.messages.indexOf(msg), state.models);
  if (!sessionFits(conv, body)) {
    conv.sessionId = randomId('ui-');
    conv.sessionHistory = null;
    body.session_id = conv.sessionId;
  }
  msg.pending = true;
  touch(conv);
  renderAll({ toEnd: true });
  announce('Assistant is replying');
  let lastSave = 0;
  await generate({
    msg, body, signal: controller.signal,
    onRequestId: (id) => { generation.requestId = id; },
    onUpdate: () => {
      scheduleUpdate(conv, msg);
      // Save now and then so a reload mid-reply keeps what has arrived.
      if (performance.now() - lastSave > 1000) { lastSave = performance.now(); store.save(conv); }
    },
  });
  state.generations.delete(conv.id);
  // Deleted while streaming: saving now would bring it back on the next load.
  if (!find(conv.id)) return;
  rememberTurn(conv, body, msg);
  touch(conv);
  if (conv.id === state.currentId) {
    renderAll();
  } else {
    renderSidebar();
  }
  if (msg.error) announce(`Error: ${msg.error.message}`);
  else if (msg.stopped) announce('Reply stopped');
  else announce('Reply finished');
}

function stop(convId) {
  const generation = state.generations.get(convId);
  if (!generation) return;
  if (generation.requestId) cancelRequest(generation.requestId);
  generation.controller.abort();
}

function send(text) {
  const conv = current();
  if (!text.trim() || state.generations.has(conv.id)) return;
  // A failed reply with nothing in it is replaced by the new turn rather than kept as a gap.
  const last = conv.messages[conv.messages.length - 1];
  if (last && last.role === 'assistant' && last.error && !last.content) conv.messages.pop();
  conv.messages.push(store.newMessage('user', text));
  const reply = store.newMessage('assistant');
  conv.messages.push(reply);
  run(conv, reply);
}

function regenerate(conv, msg) {
  if (state.generations.has(conv.id)) return;
  const index = conv.messages.indexOf(msg);
  if (index < 0) return;
  conv.messages.splice(index + 1);
  run(conv, msg);
}

function editAndRegenerate(conv, userMsg, text) {
  if (state.generations.has(conv.id)) return;
  const index = conv.messages.indexOf(userMsg);
  if (index < 0) return;
  userMsg.content = text;
  conv.messages.splice(index + 1);
  const reply = store.newMessage('assistant');
  conv.messages.push(reply);
  run(conv, reply);
}

// ------------------------------------------------------------------ models

let modelsRetry = null;

async function loadModels() {
  clearTimeout(modelsRetry);
  try {
    state.models = await listModels();
    state.modelsError = state.models.length ? null : 'the server lists no models';
  } catch (err) {
    state.models = [];
    state.modelsError = err.message;
  }
  // A server that is still starting (or restarting) is asked again until it answers.
  if (state.modelsError) modelsRetry = setTimeout(loadModels, 5000);
  $('server-status').textContent = state.modelsError ? 'Server unreachable' : `${state.models.length} model${state.models.length === 1 ? '' : 's'} served`;
  $('server-status').classList.toggle('bad', Boolean(state.modelsError));
  renderChat();
}

// ------------------------------------------------------------------ wiring

function wireComposer() {
  const prompt = $('prompt');
  autoGrow(prompt);
  prompt.addEventListener('input', renderComposer);
  prompt.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      if (!state.generations.has(state.currentId)) $('composer').requestSubmit();
    } else if (e.key === 'Escape' && state.generations.has(state.currentId)) {
      e.preventDefault();
      stop(state.currentId);
    }
  });
  $('composer').addEventListener('submit', (e) => {
    e.preventDefault();
    const text = prompt.value;
    if (!text.trim()) return;
    prompt.value = '';
    prompt.dispatchEvent(new Event('input'));
    send(text);
    prompt.focus();
  });
  $('stop-btn').addEventListener('click', () => { stop(state.currentId); prompt.focus(); });
}

function init() {
  let id = store.loadCurrentId();
  if (!find(id)) id = state.conversations[0]?.id;
  if (!id) {
    const fresh = store.newConversation();
    state.conversations.push(fresh);
    touch(fresh);
    id = fresh.id;
  }
  state.currentId = id;
  store.saveCurrentId(id);
  wireComposer();
  $('new-chat-btn').addEventListener('click', createConversation);
  $('settings-btn').addEventListener('click', async (e) => {
    const opener = e.currentTarget;
    await loadModels();
    settingsDialog.open(current().settings, state.models, opener, state.modelsError);
  });
  renderAll();
  loadModels();
  $('prompt').focus();
}

init();
