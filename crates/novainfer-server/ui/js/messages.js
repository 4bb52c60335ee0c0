//! The message list of the open conversation: rendering, streaming updates, per-message actions.
//!
//! Invariants: user text is shown verbatim (pre-wrapped Text nodes); assistant text goes through
//! the sanitizing Markdown renderer only; a message's DOM is keyed by `data-id` so a streaming
//! update touches one article; the streaming reply's body is an aria-live region that is
//! aria-busy until the reply ends, so screen readers read it once, whole, instead of per token.
//! What is shown is the conversation's active path (tree.js); a message with other versions
//! (siblings) carries `‹ 2/3 ›` to switch between them.

import { announce, copyText, h, icon, iconButton } from './dom.js';
import { renderMarkdown } from './markdown.js';
import { prettyJson } from './transfer.js';
import { pathOf, siblingsOf } from './tree.js';

export class MessageView {
  /**
   * handlers: onEdit(msg, text), onRegenerate(msg), onRetry(msg), onContinue(msg), onDelete(msg),
   * onSelectVersion(msg), onToolResult(assistantMsg, call, text), onSuggestion(text); all receive
   * message objects from the conversation passed to render().
   */
  constructor(container, handlers) {
    this.container = container;
    this.handlers = handlers;
    this.conv = null;
    this.busy = false;
    this.editingId = null;
    this.reasoningOpen = new Map(); // message id → open state the user chose
    this.toolOpen = new Map(); // "message id:call index" → open state of a tool-call card
  }

  /** Re-renders the whole conversation. `busy`: a reply of this conversation is streaming. */
  render(conv, { busy = false, emptyHint = null, toEnd = false } = {}) {
    // Same conversation: stay where the reader is, unless they were following the end.
    const sameConv = this.conv === conv;
    const follow = toEnd || !sameConv || this.nearBottom();
    const keepScroll = this.container.scrollTop;
    this.conv = conv;
    this.busy = busy;
    this.container.replaceChildren();
    this.path = pathOf(conv);
    if (this.path.length === 0) {
      this.container.append(emptyState(emptyHint, this.handlers.onSuggestion));
      return;
    }
    for (const msg of this.path) {
      this.container.append(this.article(msg, msg === this.path[this.path.length - 1]));
    }
    if (follow) this.scrollToEnd(true); else this.container.scrollTop = keepScroll;
  }

  /**
   * Refreshes one message in place (called per animation frame while it streams). The body and the
   * reasoning block are kept as the same elements, so the live region persists and so does the
   * reader's scroll position inside the reasoning.
   */
  update(msg) {
    const old = this.container.querySelector(`article[data-id="${msg.id}"]`);
    if (!old) return;
    const follow = this.nearBottom();
    const fresh = this.article(msg, msg === this.path[this.path.length - 1]);
    for (const selector of [':scope > .msg-body', ':scope > details.reasoning']) {
      const kept = old.querySelector(selector);
      const next = fresh.querySelector(selector);
      if (!kept || !next) continue;
      kept.replaceChildren(...next.childNodes);
      for (const name of ['aria-live', 'aria-busy', 'open']) {
        if (next.hasAttribute(name)) kept.setAttribute(name, next.getAttribute(name)); else kept.removeAttribute(name);
      }
      next.replaceWith(kept);
    }
    old.className = fresh.className;
    old.setAttribute('aria-label', fresh.getAttribute('aria-label'));
    old.replaceChildren(...fresh.childNodes);
    // Forced: the reader was at the end before this update; one frame's worth of streamed
    // text can add more than the "near" margin, and asking again would then stop following.
    if (follow) this.scrollToEnd(true);
  }

  nearBottom() {
    const c = this.container;
    return c.scrollHeight - c.scrollTop - c.clientHeight < 80;
  }

  scrollToEnd(force) {
    if (force || this.nearBottom()) this.container.scrollTop = this.container.scrollHeight;
  }

  article(msg, isLast) {
    if (msg.role === 'user') return this.userArticle(msg);
    if (msg.role === 'tool') return this.toolArticle(msg);
    return this.assistantArticle(msg, isLast);
  }

  /** `‹ 2/3 ›` between the versions of a message, or nothing when it has none. */
  versions(msg) {
    const siblings = siblingsOf(this.conv, msg);
    if (siblings.length < 2) return null;
    const at = siblings.indexOf(msg);
    const go = (k) => () => this.handlers.onSelectVersion(siblings[k]);
    return h('span', { class: 'versions', role: 'group', 'aria-label': 'Versions' },
      iconButton('left', 'Previous version', go(at - 1), { class: 'icon-btn version-prev', disabled: at === 0 || this.busy }),
      h('span', { class: 'version-count' }, `${at + 1}/${siblings.length}`),
      iconButton('right', 'Next version', go(at + 1), { class: 'icon-btn version-next', disabled: at === siblings.length - 1 || this.busy }));
  }

  deleteButton(msg) {
    return iconButton('trash', 'Delete message', () => this.handlers.onDelete(msg), { disabled: this.busy, class: 'icon-btn delete-msg-btn' });
  }

  toolArticle(msg) {
    const article = h('article', { class: 'msg msg-tool', dataset: { id: msg.id }, 'aria-label': 'Tool result' });
    article.append(
      h('h2', { class: 'msg-role' }, h('span', { class: 'avatar', 'aria-hidden': 'true' }, icon('tool')),
        `Tool result${msg.toolName ? ` · ${msg.toolName}` : ''}`, msg.toolCallId ? h('code', { class: 'tool-id' }, msg.toolCallId) : null),
      h('pre', { class: 'msg-body tool-result' }, prettyJson(msg.content)),
      h('div', { class: 'msg-actions' }, this.versions(msg), copyButton(msg.content, 'Copy tool result'), this.deleteButton(msg)));
    return article;
  }

  /** A tool call as a collapsible card: name, id, arguments pretty-printed; a result form under it. */
  toolCallCard(msg, call, index) {
    // The results given so far follow the call in the path; the form stays until this one has one.
    const after = this.path.slice(this.path.indexOf(msg) + 1);
    const answered = after.some((m) => m.role === 'tool' && m.toolCallId === call.id);
    const awaiting = !msg.pending && !answered && after.every((m) => m.role === 'tool');
    const key = `${msg.id}:${index}`;
    const card = h('details', { class: 'tool-call', open: this.toolOpen.get(key) ?? true, dataset: { index: String(index) } },
      h('summary', {}, icon('tool'), h('span', { class: 'tool-name' }, call.function.name || '(unnamed tool)'),
        call.id ? h('code', { class: 'tool-id' }, call.id) : null),
      h('pre', { class: 'tool-args' }, prettyJson(call.function.arguments)),
      h('div', { class: 'tool-actions' }, copyButton(call.function.arguments, 'Copy arguments')));
    card.addEventListener('toggle', () => this.toolOpen.set(key, card.open));
    if (awaiting) {
      const area = h('textarea', { class: 'tool-result-input', rows: 2, 'aria-label': `Result of ${call.function.name}` });
      const submit = (e) => {
        e.preventDefault();
        if (area.value.trim()) this.handlers.onToolResult(msg, call, area.value);
      };
      card.append(h('form', { class: 'tool-result-form', onsubmit: submit }, area,
        h('button', { type: 'submit', class: 'btn btn-small', disabled: this.busy }, 'Add result')));
    }
    return card;
  }

  userArticle(msg) {
    const article = h('article', { class: 'msg msg-user', dataset: { id: msg.id }, 'aria-label': 'You' });
    if (this.editingId === msg.id) {
      article.append(this.editForm(msg));
      return article;
    }
    if (siblingsOf(this.conv, msg).length > 1) article.classList.add('has-versions');
    article.append(
      h('h2', { class: 'msg-role visually-hidden' }, 'You'),
      h('div', { class: 'msg-body user-text' }, msg.content),
      h('div', { class: 'msg-actions' },
        this.versions(msg),
        copyButton(msg.content, 'Copy message'),
        iconButton('edit', 'Edit message', () => this.startEdit(msg.id), { disabled: this.busy, class: 'icon-btn edit-btn' }),
        this.deleteButton(msg)),
    );
    return article;
  }

  assistantArticle(msg, isLast) {
    const label = msg.model ? `Assistant (${msg.model})` : 'Assistant';
    const article = h('article', { class: 'msg msg-assistant', dataset: { id: msg.id }, 'aria-label': label });
    if (msg.pending) article.classList.add('streaming');
    article.append(h('h2', { class: 'msg-role' }, h('span', { class: 'avatar', 'aria-hidden': 'true' }, icon('bolt')),
      msg.model || 'Assistant'));

    if (msg.reasoning) article.append(this.reasoningBlock(msg));

    const body = h('div', {
      class: 'msg-body md', 'aria-live': msg.pending ? 'polite' : null, 'aria-busy': msg.pending ? 'true' : null,
    });
    if (msg.content) {
      body.append(renderMarkdown(msg.content, { onCopyCode: copyCode }));
    } else if (msg.pending && !msg.reasoning) {
      body.append(h('span', { class: 'typing', 'aria-label': 'Waiting for the first token' }, h('i'), h('i'), h('i')));
    }
    if (msg.pending && msg.content) {
      // The cursor follows the text: inside the last paragraph or list item, not under it.
      let tail = body;
      while (tail.lastElementChild && ['P', 'UL', 'OL', 'LI', 'BLOCKQUOTE'].includes(tail.lastElementChild.tagName)) {
        tail = tail.lastElementChild;
      }
      tail.append(h('span', { class: 'cursor', 'aria-hidden': 'true' }));
    }
    article.append(body);
    (msg.toolCalls || []).forEach((call, k) => article.append(this.toolCallCard(msg, call, k)));

    if (msg.stopped) article.append(h('p', { class: 'msg-note' }, 'Stopped.'));
    if (msg.interrupted) {
      article.append(h('p', { class: 'msg-note msg-interrupted' },
        'Interrupted: the page was closed or reloaded while this reply streamed; the text above is what had arrived.'));
    }
    if (msg.error) article.append(this.errorBox(msg));
    if (!msg.pending) {
      const actions = h('div', { class: 'msg-actions' }, this.versions(msg));
      if (msg.content) actions.append(copyButton(msg.content, 'Copy reply'));
      if (!msg.error) {
        actions.append(iconButton('regenerate', 'Regenerate reply', () => this.handlers.onRegenerate(msg),
          { disabled: this.busy, class: 'icon-btn regen-btn' }));
      }
      // A cut-off reply (max tokens, Stop, a reload) can be continued where it ended.
      const cutOff = msg.finishReason === 'length' || msg.stopped || msg.interrupted;
      if (isLast && cutOff && msg.content && !msg.error) {
        actions.append(h('button', { type: 'button', class: 'btn btn-small continue-btn', disabled: this.busy,
          onclick: () => this.handlers.onContinue(msg) }, icon('continue'), 'Continue'));
      }
      actions.append(this.deleteButton(msg));
      // A request that failed before any text has nothing worth measuring.
      if (msg.telemetry && (msg.content || msg.reasoning || msg.toolCalls?.length)) actions.append(telemetryLine(msg.telemetry));
      article.append(actions);
    }
    return article;
  }

  reasoningBlock(msg) {
    const thinking = msg.pending && !msg.content;
    const chosen = this.reasoningOpen.get(msg.id);
    const details = h('details', { class: 'reasoning', open: chosen ?? thinking });
    details.append(
      h('summary', {}, thinking ? 'Thinking…' : 'Reasoning', h('span', { class: 'reasoning-size' },
        ` · ${countWords(msg.reasoning)} words`)),
      h('div', { class: 'reasoning-body md' }, renderMarkdown(msg.reasoning, { onCopyCode: copyCode })),
    );
    // Remember the user's own choice (click or Enter/Space on the summary), not our re-renders.
    details.querySelector('summary').addEventListener('click', (event) => {
      this.reasoningOpen.set(msg.id, !event.currentTarget.parentElement.open);
    });
    return details;
  }

  errorBox(msg) {
    const err = msg.error;
    const text = err.status ? `${err.status}: ${err.message}` : err.message;
    return h('div', { class: 'msg-error', role: 'alert' },
      h('div', { class: 'msg-error-text' }, text,
        err.retryAfter ? h('small', { class: 'msg-error-hint' }, `Try again in ${err.retryAfter} s.`) : null),
      h('button', { type: 'button', class: 'btn btn-small retry-btn', disabled: this.busy,
        onclick: () => this.handlers.onRetry(msg) }, icon('regenerate'), 'Retry'));
  }

  startEdit(id) {
    this.editingId = id;
    this.render(this.conv, { busy: this.busy });
    const area = this.container.querySelector(`article[data-id="${id}"] textarea`);
    if (area) {
      area.focus();
      area.setSelectionRange(area.value.length, area.value.length);
    }
  }

  editForm(msg) {
    const area = h('textarea', { class: 'edit-area', 'aria-label': 'Edit your message', rows: 3 });
    area.value = msg.content;
    const finish = (save) => {
      const text = area.value;
      this.editingId = null;
      if (save && text.trim()) {
        this.handlers.onEdit(msg, text);
      } else {
        this.render(this.conv, { busy: this.busy });
        this.container.querySelector(`article[data-id="${msg.id}"] .edit-btn`)?.focus();
      }
    };
    area.addEventListener('keydown', (e) => {
      if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); finish(true); }
      if (e.key === 'Escape') { e.preventDefault(); finish(false); }
    });
    autoGrow(area);
    return h('form', { class: 'edit-form', onsubmit: (e) => { e.preventDefault(); finish(true); } },
      area,
      h('div', { class: 'edit-buttons' },
        h('span', { class: 'hint' }, 'Saved as a new version; the current one stays (‹ › switches).'),
        h('button', { type: 'button', class: 'btn', onclick: () => finish(false) }, 'Cancel'),
        h('button', { type: 'submit', class: 'btn btn-primary save-edit' }, 'Save & regenerate')));
  }
}

/** Grows a textarea with its content up to the CSS max-height. */
export function autoGrow(area) {
  const fit = () => {
    area.style.height = 'auto';
    area.style.height = `${area.scrollHeight + 2}px`;
  };
  area.addEventListener('input', fit);
  requestAnimationFrame(fit);
}

function countWords(text) {
  return (text.trim().match(/\S+/g) || []).length;
}

function copyButton(text, label) {
  const button = iconButton('copy', label, async () => {
    const ok = await copyText(text);
    flashCopied(button, ok);
  }, { class: 'icon-btn copy-btn' });
  return button;
}

async function copyCode(text, button) {
  const ok = await copyText(text);
  button.textContent = ok ? 'Copied' : 'Copy failed';
  announce(ok ? 'Code copied' : 'Copy failed');
  setTimeout(() => { button.textContent = 'Copy'; }, 1500);
}

function flashCopied(button, ok) {
  button.replaceChildren(icon(ok ? 'check' : 'close'));
  button.classList.toggle('copied', ok);
  announce(ok ? 'Copied to clipboard' : 'Copy failed');
  setTimeout(() => { button.replaceChildren(icon('copy')); button.classList.remove('copied'); }, 1500);
}

function formatMs(ms) {
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`;
}

/** The line under a reply: speed, TTFT, size, and how much of the prompt came from the KV cache. */
export function telemetryLine(t) {
  const items = [];
  if (t.promptTokens !== null && t.cachedTokens !== null) {
    const hit = t.cachedTokens > 0;
    const rate = t.promptTokens > 0 ? Math.round((100 * t.cachedTokens) / t.promptTokens) : 0;
    items.push(h('span', {
      class: `tele tele-cache${hit ? ' hit' : ''}`,
      title: 'Prompt tokens whose KV was reused from earlier turns (prefix cache) instead of recomputed, and the hit rate',
    }, icon('bolt'), `${t.cachedTokens}/${t.promptTokens} prompt tokens cached (${rate}%)`));
  }
  if (t.speculative) {
    const s = t.speculative;
    items.push(h('span', { class: 'tele tele-spec', title: 'Speculative decoding: draft tokens the model accepted' },
      `${Math.round(s.rate * 100)}% drafts accepted (${s.accepted}/${s.draft})`));
  }
  if (t.tokensPerSec !== null) {
    const over = t.rateOver === 'request' ? 'over the whole request, TTFT included' : 'after the first token';
    items.push(h('span', { class: 'tele tele-speed', title: `Generation speed in tokens per second, ${over}` },
      `${t.tokensPerSec >= 100 ? Math.round(t.tokensPerSec) : t.tokensPerSec.toFixed(1)} tok/s`));
  }
  if (t.ttftMs !== null) {
    items.push(h('span', { class: 'tele tele-ttft', title: 'Time to first token' }, `TTFT ${formatMs(t.ttftMs)}`));
  }
  items.push(h('span', { class: 'tele tele-tokens', title: t.approx ? 'Counted from streamed pieces' : 'Completion tokens' },
    `${t.approx ? '≈' : ''}${t.completionTokens} tokens`));
  if (t.finishReason === 'tool_calls') {
    items.push(h('span', { class: 'tele tele-finish', title: 'The reply ended to call tools' }, 'tool calls'));
  }
  if (t.finishReason === 'length') {
    items.push(h('span', { class: 'tele tele-finish', title: 'The reply hit the max tokens limit' }, 'max tokens reached'));
  }
  return h('div', { class: 'telemetry', 'aria-label': 'Reply statistics' }, items);
}

const SUGGESTIONS = [
  'Explain the KV cache in two sentences.',
  'Write a Python function that checks whether a string is a palindrome.',
  'What is continuous batching?',
];

function emptyState(hint, onSuggestion) {
  return h('div', { class: 'empty' },
    h('div', { class: 'empty-logo', 'aria-hidden': 'true' }, icon('bolt')),
    h('p', { class: 'empty-title' }, 'How can I help?'),
    hint ? h('p', { class: 'empty-hint' }, hint) : null,
    h('ul', { class: 'suggestions', 'aria-label': 'Suggestions' },
      SUGGESTIONS.map((text) => h('li', {}, h('button', { type: 'button', class: 'suggestion', onclick: () => onSuggestion(text) }, text)))),
    h('p', { class: 'empty-note' },
      'Each conversation keeps its own server session, so follow-up turns reuse the KV cache of earlier ones.'));
}
