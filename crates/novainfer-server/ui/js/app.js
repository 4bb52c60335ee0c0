//! The chat app's controller: owns the conversations, runs generations, wires the views together.
//!
//! Invariants: at most one reply streams per conversation (several conversations may stream at
//! once); every change to a conversation is saved before the next render, and one that cannot be
//! saved (storage full) stays in memory, is listed in the storage banner and is saved again after
//! every later change until it fits; the prompt sent is the path shown (tree.js), and the server
//! session used is the one of that branch (chat.js pickSession); Stop both aborts the fetch (the
//! server cancels on disconnect) and calls the cancel endpoint once the request id is known; the
//! composer keeps the keyboard focus across sending and stopping.

import { announce, h, randomId } from './dom.js';
import { cancelRequest, listModels, serverInfo, tokenizeChat } from './api.js';
import { buildRequest, generate, pickSession, rememberTurn } from './chat.js';
import { ContextMeter, renderInfo } from './info.js';
import { autoGrow, MessageView } from './messages.js';
import { SettingsDialog } from './settings.js';
import { Sidebar } from './sidebar.js';
import * as store from './store.js';
import { download, exportDocument, fileName, ImportError, parseImport, toMarkdown } from './transfer.js';
import { addChild, addSibling, pathOf, removeMessage, removeSubtree, select } from './tree.js';

const $ = (id) => document.getElementById(id);

const state = {
  conversations: store.loadAll(),
  currentId: null,
  models: [], // /v1/models cards
  info: null, // /server_info, or null from a server without it
  modelsError: null,
  generations: new Map(), // conversation id → { controller, requestId, msg }
  unsaved: new Set(), // ids of conversations the last save of which did not fit in storage
  prefs: store.loadPrefs(),
};

const modelIds = () => state.models.map((m) => m.id);

// True while the page unloads: a stream that breaks then is not a server error.
let leaving = false;

const view = new MessageView($('messages'), {
  // The clicked control disappears in the re-render: keep the keyboard in the composer, where Esc stops.
  onEdit: (msg, text) => { editAndRegenerate(current(), msg, text); $('prompt').focus(); },
  onRegenerate: (msg) => { regenerate(current(), msg); $('prompt').focus(); },
  onRetry: (msg) => { retry(current(), msg); $('prompt').focus(); },
  onContinue: (msg) => { continueReply(current(), msg); $('prompt').focus(); },
  onDelete: (msg) => deleteMessage(current(), msg),
  onSelectVersion: (msg) => selectVersion(current(), msg),
  onToolResult: (assistantMsg, call, text) => addToolResult(current(), assistantMsg, call, text),
  onSuggestion: (text) => { $('prompt').value = text; $('prompt').dispatchEvent(new Event('input')); $('prompt').focus(); },
});

const sidebar = new Sidebar({
  root: $('sidebar'), list: $('conv-list'), menuButton: $('menu-btn'), backdrop: $('backdrop'), main: $('main'),
}, {
  onSelect: (id) => { switchTo(id); $('prompt').focus(); },
  onRename: (id, title) => rename(id, title),
  onDelete: (id) => removeConversation(id),
});

const settingsDialog = new SettingsDialog($('settings-dialog'), {
  onSave: (settings, prefs) => {
    const conv = current();
    conv.settings = { ...conv.settings, ...settings };
    state.prefs = prefs;
    store.savePrefs(prefs);
    renderHint();
    touch(conv, false);
    renderAll();
    announce('Settings saved');
  },
  onMakeDefault: (settings) => {
    if (store.saveDefaults(settings)) announce('New chats will start with these settings');
    else announce('Could not save the defaults: storage is full');
  },
  loadDefaults: () => store.loadDefaults(),
});

const meter = new ContextMeter({ root: $('context-meter'), bar: $('context-bar'), text: $('context-text'), warning: $('context-warning') });

function current() {
  return state.conversations.find((c) => c.id === state.currentId);
}

function find(id) {
  return state.conversations.find((c) => c.id === id);
}

// Saves a conversation; `bump` moves it to the top of the list (new activity). A save that does
// not fit keeps the conversation in memory and in the banner; every save retries the others.
function touch(conv, bump = true) {
  if (bump) {
    conv.updatedAt = Date.now();
    state.conversations.sort((a, b) => b.updatedAt - a.updatedAt);
  }
  persist(conv);
  retryUnsaved();
}

function persist(conv) {
  if (store.save(conv)) state.unsaved.delete(conv.id); else state.unsaved.add(conv.id);
  renderStorageBanner();
}

function retryUnsaved() {
  for (const id of [...state.unsaved]) {
    const conv = find(id);
    if (!conv) state.unsaved.delete(id); else persist(conv);
  }
  renderStorageBanner();
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

function modelOf(conv) {
  return conv.settings.model || state.models[0]?.id || '';
}

/** The server's account of a model: its /server_info entry, else its /v1/models card. */
function modelInfo(name) {
  return state.info?.models?.find((m) => m.id === name) || state.models.find((m) => m.id === name) || null;
}

function renderChat({ toEnd = false } = {}) {
  const conv = current();
  const busy = state.generations.has(conv.id);
  const title = store.titleOf(conv);
  $('conv-title').textContent = title;
  document.title = `${title} · NovaInfer`;
  const model = modelOf(conv);
  $('model-badge').textContent = model || 'no model';
  $('model-badge').title = model ? `Model: ${model} (details)` : 'No model loaded';
  $('model-badge').setAttribute('aria-label', model ? `Model ${model}: details` : 'No model loaded');
  view.render(conv, { busy, toEnd, emptyHint: state.modelsError ? `Server unreachable: ${state.modelsError}` : null });
  renderComposer();
  renderToBottom();
  if (!busy) refreshContext();
}

function renderComposer() {
  const busy = state.generations.has(state.currentId);
  $('send-btn').hidden = busy;
  $('stop-btn').hidden = !busy;
  $('send-btn').disabled = $('prompt').value.trim() === '';
}

function renderHint() {
  const mod = /Mac|iPhone|iPad/.test(navigator.platform) ? '⌘' : 'Ctrl';
  $('composer-hint').textContent = state.prefs.sendWithCtrlEnter
    ? `${mod}+Enter to send · Enter for a new line · Esc to stop`
    : 'Enter to send · Shift+Enter for a new line · Esc to stop';
  $('send-btn').title = state.prefs.sendWithCtrlEnter ? `Send (${mod}+Enter)` : 'Send (Enter)';
}

function renderToBottom() {
  $('to-bottom-btn').hidden = view.nearBottom() || pathOf(current()).length === 0;
}

// Streaming text arrives faster than the screen refreshes: render at most once per frame.
const dirty = new Set();
function scheduleUpdate(conv, msg) {
  if (dirty.has(msg)) return;
  dirty.add(msg);
  requestAnimationFrame(() => {
    dirty.delete(msg);
    if (conv.id === state.currentId) {
      view.update(msg);
      renderToBottom();
    }
  });
}

// ------------------------------------------------------------------ context meter

let contextAsk = 0;

/**
 * The meter: the last reply's usage when the path ends with one (prompt + completion tokens),
 * else the server's count of the path (POST /tokenize).
 */
async function refreshContext() {
  const conv = current();
  const model = modelOf(conv);
  const max = modelInfo(model)?.max_model_len;
  const ask = ++contextAsk;
  if (!max) { meter.hide(); return; }
  const path = pathOf(conv);
  const last = path[path.length - 1];
  const t = last?.telemetry;
  if (!last) { meter.show(0, max); return; }
  if (last.role === 'assistant' && t && !t.approx && t.promptTokens !== null) {
    meter.show(t.promptTokens + t.completionTokens, max);
    return;
  }
  try {
    const body = buildRequest(conv, path, modelIds());
    const answer = await tokenizeChat(body.model, body.messages, last.role !== 'assistant');
    if (ask === contextAsk && conv.id === state.currentId) meter.show(answer.count, answer.max_model_len || max);
  } catch {
    if (ask === contextAsk) meter.hide();
  }
}

// ------------------------------------------------------------------ conversations

function switchTo(id) {
  if (!find(id)) return;
  state.currentId = id;
  store.saveCurrentId(id);
  view.editingId = null;
  renderAll({ toEnd: true });
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

function removeConversation(id, { focus = true } = {}) {
  stop(id);
  const index = state.conversations.findIndex((c) => c.id === id);
  const [gone] = state.conversations.splice(index, 1);
  store.remove(id);
  state.unsaved.delete(id);
  if (state.conversations.length === 0) {
    const fresh = store.newConversation();
    state.conversations.push(fresh);
    touch(fresh);
  }
  retryUnsaved();
  if (state.currentId === id) {
    switchTo(state.conversations[Math.min(index, state.conversations.length - 1)].id);
  } else {
    renderSidebar();
  }
  announce(`Deleted ${store.titleOf(gone)}`);
  if (focus) (document.querySelector('#conv-list .conv-select[aria-current="true"]') || $('new-chat-btn')).focus();
}

// ------------------------------------------------------------------ generation

/**
 * Generates `msg` (a reply on the path shown) from the messages before it; with `continueFrom`
 * (= msg, a cut-off reply) the model continues msg's text instead.
 */
async function run(conv, msg, { continueFrom = null } = {}) {
  const controller = new AbortController();
  const generation = { controller, requestId: null, msg };
  state.generations.set(conv.id, generation);
  const path = pathOf(conv);
  const history = path.slice(0, path.indexOf(msg));
  let body;
  let session = null;
  try {
    body = buildRequest(conv, history, modelIds(), { continueFrom, features: modelInfo(modelOf(conv))?.features || {} });
  } catch (err) {
    state.generations.delete(conv.id);
    msg.error = { message: `The conversation settings are invalid: ${err.message}`, kind: 'settings', status: 0 };
    touch(conv);
    renderAll();
    return;
  }
  // A continuation ends with a partial reply the server's session merge rule would store as a
  // second assistant turn: it goes without a session (the prefix cache still serves its KV).
  if (!continueFrom) {
    session = pickSession(conv, body, () => randomId('ui-'));
    body.session_id = session.id;
  }
  msg.pending = true;
  touch(conv);
  renderAll({ toEnd: true });
  announce('Assistant is replying');
  let lastSave = 0;
  await generate({
    msg, body, signal: controller.signal, append: Boolean(continueFrom),
    onRequestId: (id) => { generation.requestId = id; },
    onUpdate: () => {
      scheduleUpdate(conv, msg);
      // Save now and then so a reload mid-reply keeps what has arrived (pagehide saves the rest).
      if (performance.now() - lastSave > 1000) { lastSave = performance.now(); persist(conv); }
    },
  });
  state.generations.delete(conv.id);
  // The page is going away (reload, close): the stream broke because of that, not because of the
  // server; what was saved on the way out (the partial reply, still pending) is what the next
  // load shows, marked interrupted.
  if (leaving) return;
  // Deleted while streaming: saving now would bring it back on the next load.
  if (!find(conv.id)) return;
  rememberTurn(session, body, msg);
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

function idle(conv) {
  return !state.generations.has(conv.id);
}

function send(text) {
  const conv = current();
  if (!text.trim() || !idle(conv)) return;
  let path = pathOf(conv);
  // A failed reply with nothing in it is replaced by the new turn rather than kept as a gap.
  const last = path[path.length - 1];
  if (last && last.role === 'assistant' && last.error && !last.content && !last.toolCalls?.length) {
    removeSubtree(conv, last);
    path = pathOf(conv);
  }
  const parent = path[path.length - 1] || null;
  const question = addChild(conv, parent?.id, store.newMessage('user', text));
  run(conv, addChild(conv, question.id, store.newMessage('assistant')));
}

/** A new version of a reply, beside the old one (‹ › switches between them). */
function regenerate(conv, msg) {
  if (!idle(conv) || !conv.messages.includes(msg)) return;
  if (!msg.content && !msg.toolCalls?.length) { retry(conv, msg); return; }
  run(conv, addSibling(conv, msg, store.newMessage('assistant')));
}

/** A failed (or empty) reply is generated again in place. */
function retry(conv, msg) {
  if (!idle(conv) || !conv.messages.includes(msg)) return;
  run(conv, msg);
}

function continueReply(conv, msg) {
  if (!idle(conv) || !conv.messages.includes(msg)) return;
  run(conv, msg, { continueFrom: msg });
}

/** An edited question becomes a new version of it, with a new reply; the old branch stays. */
function editAndRegenerate(conv, userMsg, text) {
  if (!idle(conv) || !conv.messages.includes(userMsg)) return;
  const question = addSibling(conv, userMsg, store.newMessage('user', text));
  run(conv, addChild(conv, question.id, store.newMessage('assistant')));
}

function deleteMessage(conv, msg) {
  if (!idle(conv)) return;
  removeMessage(conv, msg);
  touch(conv, false);
  renderAll();
  announce('Message deleted');
  $('prompt').focus();
}

function selectVersion(conv, msg) {
  if (!idle(conv)) return;
  select(conv, msg);
  touch(conv, false);
  renderAll();
  const siblings = conv.messages.filter((m) => (m.parentId ?? null) === (msg.parentId ?? null));
  announce(`Version ${siblings.indexOf(msg) + 1} of ${siblings.length}`);
  document.querySelector(`article[data-id="${msg.id}"] .versions button:not([disabled])`)?.focus();
}

/** A tool's result, given by the user, as its own message; once every call has one, the model goes on. */
function addToolResult(conv, assistantMsg, call, text) {
  if (!idle(conv)) return;
  const path = pathOf(conv);
  const tail = path[path.length - 1];
  addChild(conv, tail.id, { ...store.newMessage('tool', text), toolCallId: call.id, toolName: call.function.name });
  const after = pathOf(conv).slice(pathOf(conv).indexOf(assistantMsg) + 1);
  const answered = new Set(after.filter((m) => m.role === 'tool').map((m) => m.toolCallId));
  if ((assistantMsg.toolCalls || []).every((c) => answered.has(c.id))) {
    const last = pathOf(conv).at(-1);
    run(conv, addChild(conv, last.id, store.newMessage('assistant')));
  } else {
    touch(conv);
    renderAll({ toEnd: true });
  }
}

// ------------------------------------------------------------------ models and server info

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
  if (!state.modelsError) {
    try { state.info = await serverInfo(); } catch { state.info = null; }
  }
  // A server that is still starting (or restarting) is asked again until it answers.
  if (state.modelsError) modelsRetry = setTimeout(loadModels, 5000);
  $('server-status').textContent = state.modelsError ? 'Server unreachable' : `${state.models.length} model${state.models.length === 1 ? '' : 's'} served`;
  $('server-status').classList.toggle('bad', Boolean(state.modelsError));
  renderChat();
}

async function openInfo(opener) {
  await loadModels();
  const model = modelOf(current());
  const info = modelInfo(model);
  const dialog = $('info-dialog');
  $('info-title').textContent = model ? `Model ${model}` : 'Model';
  if (info) renderInfo($('info-list'), info, state.info?.version);
  else $('info-list').replaceChildren(h('dt', {}, 'Model'), h('dd', {}, state.modelsError || 'not served'));
  dialog.addEventListener('close', () => opener.focus(), { once: true });
  dialog.showModal();
}

// ------------------------------------------------------------------ export, import, storage

function exportAll() {
  download(fileName('conversations', 'json'), `${JSON.stringify(exportDocument(state.conversations), null, 2)}\n`, 'application/json');
  announce(`Exported ${state.conversations.length} conversations`);
}

async function importFile(file) {
  try {
    const imported = parseImport(await file.text(), new Set(state.conversations.map((c) => c.id)));
    if (imported.length === 0) throw new ImportError('the file holds no conversations');
    state.conversations.push(...imported);
    state.conversations.sort((a, b) => b.updatedAt - a.updatedAt);
    for (const conv of imported) persist(conv);
    switchTo(imported[0].id);
    notice(`Imported ${imported.length} conversation${imported.length === 1 ? '' : 's'} from ${file.name}.`);
  } catch (err) {
    notice(`Could not import ${file.name}: ${err.message}`, true);
  }
}

function notice(text, isError = false) {
  const box = $('storage-banner');
  if (state.unsaved.size && !isError) { announce(text); return; }
  box.hidden = false;
  box.classList.toggle('is-error', isError);
  box.classList.add('is-notice');
  $('storage-text').textContent = text;
  $('storage-export').hidden = true;
  $('storage-free').hidden = true;
  announce(text);
  clearTimeout(notice.timer);
  notice.timer = setTimeout(renderStorageBanner, 8000);
}

function renderStorageBanner() {
  const box = $('storage-banner');
  box.classList.remove('is-notice', 'is-error');
  const lost = [...state.unsaved].map(find).filter(Boolean);
  if (lost.length === 0) { box.hidden = true; return; }
  box.hidden = false;
  $('storage-export').hidden = false;
  $('storage-free').hidden = false;
  const names = lost.slice(0, 2).map((c) => `“${store.titleOf(c)}”`).join(', ') + (lost.length > 2 ? ` and ${lost.length - 2} more` : '');
  $('storage-text').textContent = `This browser's storage is full: the latest changes to ${names} are not saved and `
    + 'would be lost if this page closes. Export your conversations, or free up space by deleting old ones.';
  if ($('storage-dialog').open) renderStorageDialog();
}

function renderStorageDialog() {
  const sizes = store.storedSizes();
  const total = [...sizes.values()].reduce((a, b) => a + b, 0);
  $('storage-summary').textContent = `${state.conversations.length} conversations; ${Math.round((total * 2) / 1024)} KB of this `
    + 'browser\'s storage for this site (browsers allow about 5 MB). Oldest first.';
  const oldestFirst = [...state.conversations].sort((a, b) => a.updatedAt - b.updatedAt);
  $('storage-list').replaceChildren(...oldestFirst.map((conv) => {
    const size = sizes.get(conv.id);
    const title = store.titleOf(conv);
    return h('li', { class: 'storage-item', dataset: { id: conv.id } },
      h('span', { class: 'storage-title' }, title),
      h('span', { class: 'storage-meta' }, state.unsaved.has(conv.id) ? 'not saved'
        : `${Math.max(1, Math.round(((size || 0) * 2) / 1024))} KB · ${new Date(conv.updatedAt).toLocaleDateString()}`),
      h('button', { type: 'button', class: 'btn btn-small btn-danger', 'aria-label': `Delete “${title}”`,
        onclick: () => { removeConversation(conv.id, { focus: false }); renderStorageDialog(); $('storage-summary').focus?.(); } }, 'Delete'));
  }));
}

function openStorage() {
  renderStorageDialog();
  $('storage-dialog').showModal();
}

// ------------------------------------------------------------------ wiring

function wireComposer() {
  const prompt = $('prompt');
  autoGrow(prompt);
  prompt.addEventListener('input', renderComposer);
  prompt.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.isComposing) {
      const sendNow = state.prefs.sendWithCtrlEnter ? (e.ctrlKey || e.metaKey) : !e.shiftKey;
      if (!sendNow) return;
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

function wireTools() {
  $('export-all-btn').addEventListener('click', exportAll);
  $('storage-export').addEventListener('click', exportAll);
  $('import-btn').addEventListener('click', () => $('import-file').click());
  $('import-file').addEventListener('change', (e) => {
    const [file] = e.target.files;
    if (file) importFile(file);
    e.target.value = '';
  });
  $('storage-btn').addEventListener('click', openStorage);
  $('storage-free').addEventListener('click', openStorage);
  $('export-json-btn').addEventListener('click', () => {
    const conv = current();
    download(fileName(store.titleOf(conv), 'json'), `${JSON.stringify(exportDocument([conv]), null, 2)}\n`, 'application/json');
  });
  $('export-md-btn').addEventListener('click', () => {
    const conv = current();
    download(fileName(store.titleOf(conv), 'md'), toMarkdown(conv), 'text/markdown');
  });
  $('model-badge').addEventListener('click', (e) => openInfo(e.currentTarget));
  $('messages').addEventListener('scroll', renderToBottom, { passive: true });
  $('to-bottom-btn').addEventListener('click', () => {
    view.scrollToEnd(true);
    renderToBottom();
    $('prompt').focus();
  });
  // A reload or close mid-reply: keep what has arrived (the next load marks it interrupted).
  const saveStreaming = () => {
    for (const id of state.generations.keys()) { const conv = find(id); if (conv) store.save(conv); }
  };
  window.addEventListener('beforeunload', (e) => {
    leaving = true;
    saveStreaming();
    if (state.unsaved.size) { e.preventDefault(); e.returnValue = ''; }
    // If the user chose to stay, this page goes on as before.
    setTimeout(() => { leaving = false; }, 1000);
  });
  window.addEventListener('pagehide', () => { leaving = true; saveStreaming(); });
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
  wireTools();
  renderHint();
  $('new-chat-btn').addEventListener('click', createConversation);
  $('settings-btn').addEventListener('click', async (e) => {
    const opener = e.currentTarget;
    await loadModels();
    settingsDialog.open(current().settings, modelIds(), opener, {
      modelsError: state.modelsError, info: modelInfo(modelOf(current())), prefs: state.prefs,
      parents: Object.fromEntries(state.models.filter((m) => m.parent).map((m) => [m.id, m.parent])),
    });
  });
  renderAll({ toEnd: true });
  loadModels();
  $('prompt').focus();
}

init();
