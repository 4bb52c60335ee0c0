//! Export and import of conversations: a versioned JSON format (docs/webui.md describes it) for
//! one conversation or all, and Markdown for reading or sharing one.
//!
//! Invariants: export → import gives back the same conversations (every branch, the branch shown,
//! settings, telemetry), except what only made sense on this browser and that server (server
//! session ids); an import never overwrites a stored conversation (a clashing id gets a new one);
//! a file that is not this format is refused whole with a reason, never half imported.

import { h, randomId } from './dom.js';
import { normalize, titleOf } from './store.js';
import { pathOf } from './tree.js';

export const FORMAT = 'novainfer.conversations';
export const VERSION = 1;

// Server-side state (sessions live in one server's memory) and in-flight flags: not exported.
const LOCAL_ONLY = ['sessions', 'sessionId', 'sessionHistory'];

export class ImportError extends Error {}

/** A conversation as the export format holds it (a deep copy). */
export function exportedConversation(conv) {
  const copy = JSON.parse(JSON.stringify(conv));
  for (const key of LOCAL_ONLY) delete copy[key];
  for (const msg of copy.messages) delete msg.pending;
  return copy;
}

/** The export document for `conversations`. */
export function exportDocument(conversations, now = new Date()) {
  return {
    format: FORMAT,
    version: VERSION,
    exported_at: now.toISOString(),
    conversations: conversations.map(exportedConversation),
  };
}

const isString = (v) => typeof v === 'string';

/** Checks one conversation of an import; throws ImportError naming what is wrong. */
function checkConversation(conv, n) {
  const where = `conversation ${n + 1}`;
  if (!conv || typeof conv !== 'object') throw new ImportError(`${where} is not an object`);
  if (!isString(conv.id) || !conv.id) throw new ImportError(`${where} has no id`);
  if (!Array.isArray(conv.messages)) throw new ImportError(`${where} has no messages list`);
  const ids = new Set();
  conv.messages.forEach((m, k) => {
    const at = `${where}, message ${k + 1}`;
    if (!m || typeof m !== 'object') throw new ImportError(`${at} is not an object`);
    if (!isString(m.id) || !m.id || ids.has(m.id)) throw new ImportError(`${at} has a missing or repeated id`);
    ids.add(m.id);
    if (!['user', 'assistant', 'tool'].includes(m.role)) throw new ImportError(`${at} has an unknown role ${JSON.stringify(m.role)}`);
    if (!isString(m.content)) throw new ImportError(`${at} has no text content`);
  });
  for (const m of conv.messages) {
    if (m.parentId !== null && m.parentId !== undefined && !ids.has(m.parentId)) {
      throw new ImportError(`${where}: message ${m.id} has a parent that is not in the file`);
    }
  }
}

/**
 * Parses an export file's text into conversations ready to store: checked, brought to the current
 * shape, with ids that clash with `existingIds` replaced. Throws ImportError.
 */
export function parseImport(text, existingIds = new Set()) {
  let doc;
  try {
    doc = JSON.parse(text);
  } catch (err) {
    throw new ImportError(`the file is not JSON (${err.message})`);
  }
  if (!doc || doc.format !== FORMAT) throw new ImportError(`the file is not a NovaInfer conversations export (no "format": "${FORMAT}")`);
  if (!Number.isInteger(doc.version) || doc.version > VERSION) {
    throw new ImportError(`the file has format version ${doc.version}; this page reads version ${VERSION} and older`);
  }
  if (!Array.isArray(doc.conversations)) throw new ImportError('the file has no "conversations" list');
  doc.conversations.forEach(checkConversation);
  const taken = new Set(existingIds);
  return doc.conversations.map((raw) => {
    const conv = normalize(JSON.parse(JSON.stringify(raw)));
    if (taken.has(conv.id)) conv.id = randomId('c');
    taken.add(conv.id);
    conv.title ??= '';
    conv.titleEdited = Boolean(conv.titleEdited);
    conv.createdAt = Number.isFinite(conv.createdAt) ? conv.createdAt : Date.now();
    conv.updatedAt = Number.isFinite(conv.updatedAt) ? conv.updatedAt : conv.createdAt;
    conv.sessions = [];
    return conv;
  });
}

/** The branch shown of a conversation as Markdown (reasoning as a quote, tool calls as JSON). */
export function toMarkdown(conv, now = new Date()) {
  const out = [`# ${titleOf(conv)}`, ''];
  const model = conv.settings?.model;
  out.push(`_Exported from NovaInfer on ${now.toISOString().slice(0, 10)}${model ? `, model ${model}` : ''}._`, '');
  if (conv.settings?.systemPrompt?.trim()) out.push('## System', '', conv.settings.systemPrompt.trim(), '');
  for (const msg of pathOf(conv)) {
    if (msg.role === 'user') {
      out.push('## You', '', msg.content, '');
    } else if (msg.role === 'tool') {
      out.push(`## Tool result${msg.toolCallId ? ` (\`${msg.toolCallId}\`)` : ''}`, '', fence(msg.content), '');
    } else {
      out.push(`## Assistant${msg.model ? ` (${msg.model})` : ''}`, '');
      if (msg.reasoning) out.push(msg.reasoning.split('\n').map((l) => `> ${l}`).join('\n'), '');
      if (msg.content) out.push(msg.content, '');
      for (const call of msg.toolCalls || []) {
        out.push(`**Tool call** \`${call.function.name}\`${call.id ? ` (\`${call.id}\`)` : ''}`, '', fence(prettyJson(call.function.arguments), 'json'), '');
      }
    }
  }
  return `${out.join('\n').trimEnd()}\n`;
}

/** A fenced code block whose fence is longer than any backtick run inside. */
function fence(text, lang = '') {
  const longest = Math.max(2, ...(String(text).match(/`+/g) || []).map((r) => r.length));
  const ticks = '`'.repeat(longest + 1);
  return `${ticks}${lang}\n${text}\n${ticks}`;
}

/** JSON text pretty-printed with two spaces; text that is not JSON is returned as it is. */
export function prettyJson(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

/** A file name made of a conversation's title. */
export function fileName(title, ext, now = new Date()) {
  const slug = title.toLowerCase().normalize('NFKD').replace(/[^a-z0-9]+/g, '-').replace(/^-|-$/g, '').slice(0, 40);
  return `novainfer-${slug || 'chat'}-${now.toISOString().slice(0, 10)}.${ext}`;
}

/** Offers `text` as a download named `name`. */
export function download(name, text, type) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = h('a', { href: url, download: name, hidden: true });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}
