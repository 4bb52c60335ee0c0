//! What the server says about the model (GET /server_info, else /v1/models): the model info
//! dialog, and the context meter that compares this conversation's tokens with max_model_len.
//!
//! Invariants: the meter's number is the server's count, never a guess: the last reply's usage
//! (prompt + completion tokens, which is what the conversation occupies) or, when the path shown
//! ends without one (an edit, a branch switch, an import, a stopped reply), POST /tokenize of the
//! path; a stale answer (the path changed meanwhile) is dropped.

import { h } from './dom.js';

// From this share of max_model_len on, the meter warns.
export const WARN_AT = 0.8;

const fmt = (n) => Number(n).toLocaleString('en-US');

function mib(bytes) {
  return `${(bytes / (1 << 20)).toFixed(bytes < 10 << 20 ? 1 : 0)} MiB`;
}

/** The model info rows (label, value, note) for a /server_info model entry. */
export function infoRows(model, version) {
  const rows = [['Model', model.id], ['Context length (max_model_len)', `${fmt(model.max_model_len)} tokens`]];
  if (model.device) rows.push(['Device', model.device, model.device_reason]);
  const kv = model.kv_cache;
  if (kv) {
    rows.push(['KV cache', `${kv.layout} layout, ${kv.block_size}-token blocks, ${kv.dtype}`]);
    if (kv.num_blocks !== null && kv.num_blocks !== undefined) {
      const tokens = kv.num_blocks * kv.block_size;
      rows.push(['KV blocks', `${fmt(kv.num_used_blocks)} of ${fmt(kv.num_blocks)} in use (${fmt(tokens)} tokens, ${mib(kv.bytes)})`]);
    }
    rows.push(['Prefix caching', kv.prefix_caching ? 'on' : 'off']);
  }
  const pc = model.prefix_cache;
  if (pc && pc.query_tokens !== null) {
    rows.push(['Prefix-cache hit rate', pc.hit_rate === null ? 'no lookups yet'
      : `${(pc.hit_rate * 100).toFixed(1)}% (${fmt(pc.hit_tokens)} of ${fmt(pc.query_tokens)} prompt tokens, since the server started)`]);
  }
  const on = Object.entries(model.features || {}).filter(([, v]) => v).map(([k]) => k.replace(/_/g, ' '));
  if (model.features) rows.push(['Optional features', on.length ? on.join(', ') : 'none']);
  if (version) rows.push(['Server version', version]);
  return rows;
}

/** Fills the info dialog's list. `model`: a /server_info entry, or a /v1/models card. */
export function renderInfo(list, model, version) {
  list.replaceChildren(...infoRows(model, version).flatMap(([label, value, note]) => [
    h('dt', {}, label),
    h('dd', {}, value, note ? h('small', { class: 'info-note' }, note) : null),
  ]));
}

/** The meter's state: {used, max, ratio, level: 'ok'|'warn'|'full'}. */
export function meterState(used, max) {
  const ratio = max > 0 ? used / max : 0;
  return { used, max, ratio, level: ratio >= 1 ? 'full' : ratio >= WARN_AT ? 'warn' : 'ok' };
}

export class ContextMeter {
  constructor({ root, bar, text, warning }) {
    Object.assign(this, { root, bar, text, warning });
  }

  hide() { this.root.hidden = true; }

  show(used, max) {
    const s = meterState(used, max);
    this.root.hidden = false;
    this.root.dataset.level = s.level;
    this.root.dataset.used = String(used);
    this.root.dataset.max = String(max);
    this.bar.setAttribute('aria-valuemax', String(max));
    this.bar.setAttribute('aria-valuenow', String(used));
    this.bar.setAttribute('aria-valuetext', `${used} of ${max} tokens`);
    this.bar.firstElementChild.style.width = `${Math.min(100, s.ratio * 100).toFixed(1)}%`;
    this.text.textContent = `Context ${fmt(used)} / ${fmt(max)} tokens (${Math.round(s.ratio * 100)}%)`;
    this.text.title = 'Prompt + reply tokens of the conversation shown, as the server counts them, against the model\'s max_model_len';
    this.warning.hidden = s.level === 'ok';
    this.warning.textContent = s.level === 'ok' ? '' : `${s.level === 'full' ? 'The context is full' : `The context is ${Math.round(s.ratio * 100)}% full`}: `
      + `prompt and reply together cannot exceed ${fmt(max)} tokens. Past that a reply stops early ("max tokens reached") `
      + 'and a longer prompt is refused by the server. Start a new chat, or delete or edit earlier messages to make room.';
  }
}
