//! The conversation list (select, rename, delete) and, on narrow screens, the drawer that holds it.
//!
//! Invariants: the list mirrors the conversations it was last given; rename and delete are inline
//! (no browser prompt/confirm dialogs) and keyboard-complete: Enter saves, Escape cancels, and
//! focus always lands somewhere sensible afterwards. While the drawer is open on a narrow screen
//! the chat behind it is inert and Escape closes it, returning focus to the menu button.

import { h, icon, iconButton } from './dom.js';
import { titleOf } from './store.js';

const NARROW = window.matchMedia('(max-width: 760px)');

export class Sidebar {
  /** handlers: onSelect(id), onRename(id, title), onDelete(id). */
  constructor({ root, list, menuButton, backdrop, main }, handlers) {
    this.root = root;
    this.list = list;
    this.menuButton = menuButton;
    this.backdrop = backdrop;
    this.main = main;
    this.handlers = handlers;
    this.renamingId = null;
    this.confirmingId = null;
    this.state = { conversations: [], currentId: null, busyIds: new Set() };

    menuButton.addEventListener('click', () => (this.isOpen() ? this.close() : this.open()));
    backdrop.addEventListener('click', () => this.close());
    root.addEventListener('keydown', (e) => {
      if (e.key === 'Escape' && this.isOpen() && !this.renamingId && !this.confirmingId) {
        e.preventDefault();
        this.close();
      }
    });
    NARROW.addEventListener('change', () => this.syncLayout());
    this.syncLayout();
  }

  isNarrow() { return NARROW.matches; }
  isOpen() { return this.root.classList.contains('open'); }

  open() {
    if (!this.isNarrow()) return;
    this.root.classList.add('open');
    this.backdrop.hidden = false;
    this.main.inert = true;
    this.menuButton.setAttribute('aria-expanded', 'true');
    (this.list.querySelector('[aria-current="true"]') || this.root.querySelector('button'))?.focus();
  }

  close({ restoreFocus = true } = {}) {
    if (!this.isOpen()) return;
    this.root.classList.remove('open');
    this.backdrop.hidden = true;
    this.main.inert = false;
    this.menuButton.setAttribute('aria-expanded', 'false');
    if (restoreFocus) this.menuButton.focus();
  }

  // On a wide screen the sidebar is always visible, so the drawer state must not linger.
  syncLayout() {
    if (!this.isNarrow()) {
      this.root.classList.remove('open');
      this.backdrop.hidden = true;
      this.main.inert = false;
      this.menuButton.setAttribute('aria-expanded', 'false');
    }
  }

  render(state = this.state) {
    this.state = state;
    const items = state.conversations.map((conv) => this.item(conv));
    this.list.replaceChildren(...items);
    if (items.length === 0) this.list.append(h('li', { class: 'conv-empty' }, 'No conversations yet'));
  }

  item(conv) {
    const current = conv.id === this.state.currentId;
    const li = h('li', { class: `conv${current ? ' current' : ''}`, dataset: { id: conv.id } });
    const title = titleOf(conv);
    if (this.renamingId === conv.id) {
      li.append(this.renameForm(conv, title));
      return li;
    }
    if (this.confirmingId === conv.id) {
      li.append(this.confirmDelete(conv, title));
      return li;
    }
    const busy = this.state.busyIds.has(conv.id);
    li.append(
      h('button', {
        type: 'button', class: 'conv-select', 'aria-current': current ? 'true' : null,
        onclick: () => { this.handlers.onSelect(conv.id); this.close({ restoreFocus: false }); },
      }, h('span', { class: 'conv-title' }, title), busy ? h('span', { class: 'conv-busy', title: 'Replying…' }, h('span', { class: 'visually-hidden' }, ' (replying)')) : null),
      h('div', { class: 'conv-actions' },
        iconButton('edit', `Rename “${title}”`, () => this.startRename(conv.id), { class: 'icon-btn rename-btn' }),
        iconButton('trash', `Delete “${title}”`, () => this.startDelete(conv.id), { class: 'icon-btn delete-btn' })),
    );
    return li;
  }

  startRename(id) {
    this.renamingId = id;
    this.confirmingId = null;
    this.render();
    const input = this.list.querySelector(`li[data-id="${id}"] input`);
    input?.focus();
    input?.select();
  }

  renameForm(conv, title) {
    const input = h('input', { type: 'text', class: 'rename-input', 'aria-label': 'Conversation name', maxlength: 120 });
    input.value = title;
    let done = false;
    const finish = (save) => {
      if (done) return;
      done = true;
      this.renamingId = null;
      if (save && input.value.trim() && input.value.trim() !== title) this.handlers.onRename(conv.id, input.value.trim());
      else this.render();
      this.focusItem(conv.id, '.rename-btn');
    };
    input.addEventListener('keydown', (e) => {
      if (e.key === 'Enter') { e.preventDefault(); finish(true); }
      if (e.key === 'Escape') { e.preventDefault(); e.stopPropagation(); finish(false); }
    });
    input.addEventListener('blur', () => finish(true));
    return h('form', { class: 'rename-form', onsubmit: (e) => { e.preventDefault(); finish(true); } }, input);
  }

  startDelete(id) {
    this.confirmingId = id;
    this.renamingId = null;
    this.render();
    this.list.querySelector(`li[data-id="${id}"] .confirm-cancel`)?.focus();
  }

  confirmDelete(conv, title) {
    const cancel = () => { this.confirmingId = null; this.render(); this.focusItem(conv.id, '.delete-btn'); };
    const box = h('div', { class: 'confirm', role: 'group', 'aria-label': `Delete “${title}”?` },
      h('span', { class: 'confirm-text' }, `Delete “${title}”?`),
      h('div', { class: 'confirm-buttons' },
        h('button', { type: 'button', class: 'btn btn-small confirm-cancel', onclick: cancel }, 'Cancel'),
        h('button', {
          type: 'button', class: 'btn btn-small btn-danger confirm-delete',
          onclick: () => { this.confirmingId = null; this.handlers.onDelete(conv.id); },
        }, icon('trash'), 'Delete')));
    box.addEventListener('keydown', (e) => {
      if (e.key === 'Escape') { e.preventDefault(); e.stopPropagation(); cancel(); }
    });
    return box;
  }

  focusItem(id, selector) {
    this.list.querySelector(`li[data-id="${id}"] ${selector}`)?.focus();
  }
}
