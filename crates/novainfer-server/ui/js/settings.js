//! The per-conversation settings dialog: model, system prompt, every sampling parameter the API
//! takes, JSON mode with a schema, tool definitions (when the server has tool calling), plus the
//! browser-wide preferences (Ctrl+Enter to send, API key).
//!
//! Invariants: an empty field means "server default" and is stored as null (the request then
//! omits the field); a value the server would refuse is refused by the form first, on the field,
//! with the server's own limit in the message (the limits mirror SamplingParams::build in
//! novainfer-core and crates/novainfer-server/src/params.rs); the modal <dialog> traps focus
//! and returns it to the button that opened it. Defaults for new chats are only changed by
//! "Use for new chats"; "Reset to defaults" refills the form from them.

import { h } from './dom.js';
import { getApiKey, setApiKey } from './api.js';

// The server's limit on stop strings (MAX_STOP in protocol/inputs.rs).
export const MAX_STOP = 16;

/** The `tool_choice` values the dialog offers (`auto`, the default, is not sent). */
export const TOOL_CHOICES = ['auto', 'required', 'none'];

/**
 * [settings key, input id, integer?, check(value) → message or ''] for each number field. The
 * inputs' own min/max/step carry the simple bounds; `check` adds what HTML cannot say.
 */
const NUMBER_FIELDS = [
  ['temperature', 'set-temperature', false, () => ''],
  ['topP', 'set-top-p', false, (v) => (v <= 0 ? 'Top-p must be greater than 0 (0 would leave no token to sample; the server refuses it).' : '')],
  ['topK', 'set-top-k', true, (v) => (v < -1 ? 'Top-k is -1 or 0 (off) or at least 1.' : '')],
  ['minP', 'set-min-p', false, () => ''],
  ['maxTokens', 'set-max-tokens', true, () => ''],
  ['repetitionPenalty', 'set-repetition-penalty', false, (v) => (v <= 0 ? 'The repetition penalty must be greater than 0 (1 is off).' : '')],
  ['presencePenalty', 'set-presence-penalty', false, () => ''],
  ['frequencyPenalty', 'set-frequency-penalty', false, () => ''],
  ['seed', 'set-seed', true, () => ''],
];

/** Stop strings from the textarea: one per line; `\n`, `\t` and `\\` stand for themselves. */
export function parseStops(text) {
  return text.split('\n').filter((line) => line !== '')
    .map((line) => line.replace(/\\(n|t|\\)/g, (_, c) => ({ n: '\n', t: '\t', '\\': '\\' })[c]));
}

export function formatStops(stops) {
  return (stops || []).map((s) => s.replace(/\\/g, '\\\\').replace(/\n/g, '\\n').replace(/\t/g, '\\t')).join('\n');
}

/** '' when `text` is empty or a JSON Schema object; else why not. */
export function schemaProblem(text) {
  if (!text.trim()) return '';
  try {
    const v = JSON.parse(text);
    return v && typeof v === 'object' && !Array.isArray(v) ? '' : 'The schema must be a JSON object.';
  } catch (err) {
    return `The schema is not valid JSON: ${err.message}`;
  }
}

/** '' when `text` is empty or a JSON array of tool definitions; else why not. */
export function toolsProblem(text) {
  if (!text.trim()) return '';
  try {
    const v = JSON.parse(text);
    if (!Array.isArray(v)) return 'Tools must be a JSON array of {"type": "function", "function": {...}}.';
    const bad = v.findIndex((t) => !t || t.type !== 'function' || typeof t.function?.name !== 'string');
    return bad >= 0 ? `Tool ${bad + 1} needs "type": "function" and a function name.` : '';
  } catch (err) {
    return `The tools are not valid JSON: ${err.message}`;
  }
}

export class SettingsDialog {
  /**
   * onSave(settings, prefs) receives the conversation's new settings and the browser-wide
   * preferences; onMakeDefault(settings) the settings to use for new chats; loadDefaults() gives
   * the current defaults.
   */
  constructor(dialog, { onSave, onMakeDefault, loadDefaults }) {
    this.dialog = dialog;
    this.form = dialog.querySelector('form');
    this.onSave = onSave;
    this.onMakeDefault = onMakeDefault;
    this.loadDefaults = loadDefaults;
    this.opener = null;
    this.$ = (id) => this.form.querySelector(`#${id}`);
    this.form.addEventListener('submit', (e) => {
      e.preventDefault();
      if (!this.validate()) return;
      this.onSave(this.read(), this.readPrefs());
      setApiKey(this.$('set-api-key').value.trim());
      this.close();
    });
    this.form.addEventListener('input', (e) => this.check(e.target));
    this.$('set-json-mode').addEventListener('change', () => { this.syncJsonMode(); this.check(this.$('set-json-schema')); });
    dialog.querySelector('.dialog-cancel').addEventListener('click', () => this.close());
    this.$('settings-reset').addEventListener('click', () => {
      this.fill(this.loadDefaults(), { keepModel: true });
      this.$('settings-note').textContent = 'Filled in the defaults for new chats; Save applies them to this conversation.';
    });
    this.$('settings-make-default').addEventListener('click', () => {
      if (!this.validate()) return;
      this.onMakeDefault(this.read());
      this.$('settings-note').textContent = 'New chats will start with these settings.';
    });
    dialog.addEventListener('close', () => this.opener?.focus());
  }

  /**
   * Opens the dialog for `settings`, offering `models` (ids) and keeping an unknown current one.
   * `info`: the model's /server_info entry (limits and features) or null. `parents`: for each
   * LoRA adapter among `models`, the model it adapts (its /v1/models card's `parent`).
   */
  open(settings, models, opener, { modelsError = null, info = null, prefs = {}, parents = {} } = {}) {
    this.opener = opener;
    const select = this.$('set-model');
    const ids = [...models];
    if (settings.model && !ids.includes(settings.model)) ids.push(settings.model);
    const label = (id) => {
      if (!models.includes(id)) return `${id} (not served now)`;
      return parents[id] ? `${id} (LoRA adapter of ${parents[id]})` : id;
    };
    select.replaceChildren(...ids.map((id) => h('option', { value: id }, label(id))));
    this.$('set-model-note').textContent = modelsError ? `Could not load the model list: ${modelsError}` : '';
    // max_tokens cannot exceed the context the model has.
    if (info?.max_model_len) this.$('set-max-tokens').max = String(info.max_model_len); else this.$('set-max-tokens').removeAttribute('max');
    this.$('tools-field').hidden = !info?.features?.tool_calls;
    this.$('json-field').hidden = info ? !info.features?.json_schema : false;
    this.fill(settings);
    select.value = settings.model || models[0] || '';
    this.$('set-ctrl-enter').checked = Boolean(prefs.sendWithCtrlEnter);
    this.$('set-api-key').value = getApiKey();
    this.$('settings-note').textContent = '';
    this.dialog.showModal();
    select.focus();
  }

  fill(settings, { keepModel = false } = {}) {
    if (!keepModel && settings.model) this.$('set-model').value = settings.model;
    this.$('set-system').value = settings.systemPrompt || '';
    for (const [key, id] of NUMBER_FIELDS) {
      const value = settings[key];
      this.$(id).value = value === null || value === undefined ? '' : String(value);
    }
    this.$('set-stop').value = formatStops(settings.stop);
    this.$('set-json-mode').checked = Boolean(settings.jsonMode);
    this.$('set-json-schema').value = settings.jsonSchema || '';
    this.$('set-tools').value = settings.tools || '';
    this.$('set-tool-choice').value = TOOL_CHOICES.includes(settings.toolChoice) ? settings.toolChoice : 'auto';
    this.syncJsonMode();
    for (const el of this.form.querySelectorAll('input, textarea')) this.check(el);
  }

  syncJsonMode() {
    this.$('json-schema-field').hidden = !this.$('set-json-mode').checked;
  }

  /** Sets the field's custom validity from the rules HTML cannot express. */
  check(el) {
    if (!el || !el.id) return;
    const field = NUMBER_FIELDS.find(([, id]) => id === el.id);
    if (!field && !['set-stop', 'set-json-schema', 'set-tools'].includes(el.id)) return;
    // Cleared first: the input's own checks (range, step, number syntax) speak before ours.
    el.setCustomValidity('');
    if (!el.validity.valid) return;
    let message = '';
    if (field) {
      if (el.value.trim() !== '') message = field[3](Number(el.value));
    } else if (el.id === 'set-stop') {
      const n = parseStops(el.value).length;
      if (n > MAX_STOP) message = `At most ${MAX_STOP} stop strings (the server's limit), got ${n}.`;
    } else if (el.id === 'set-json-schema') {
      if (this.$('set-json-mode').checked) message = schemaProblem(el.value);
    } else if (!this.$('tools-field').hidden) {
      message = toolsProblem(el.value);
    }
    if (message) el.setCustomValidity(message);
  }

  validate() {
    for (const el of this.form.querySelectorAll('input, textarea')) this.check(el);
    return this.form.reportValidity();
  }

  close() {
    if (this.dialog.open) this.dialog.close();
  }

  read() {
    const settings = {
      model: this.$('set-model').value,
      systemPrompt: this.$('set-system').value,
      stop: parseStops(this.$('set-stop').value),
      jsonMode: this.$('set-json-mode').checked,
      jsonSchema: this.$('set-json-schema').value,
      tools: this.$('set-tools').value,
      toolChoice: this.$('set-tool-choice').value,
    };
    for (const [key, id, integer] of NUMBER_FIELDS) {
      const raw = this.$(id).value.trim();
      const value = raw === '' ? null : integer ? parseInt(raw, 10) : parseFloat(raw);
      settings[key] = Number.isFinite(value) ? value : null;
    }
    return settings;
  }

  readPrefs() {
    return { sendWithCtrlEnter: this.$('set-ctrl-enter').checked };
  }
}
