//! The per-conversation settings dialog: model, system prompt, temperature, top_p, max tokens
//! (plus the browser-wide API key, for servers started with --api-key).
//!
//! Invariants: an empty number field means "server default" and is stored as null (the request
//! then omits the field); out-of-range values are refused by the form before they reach the
//! server, with the browser's own validation message on the field; the modal <dialog> traps focus
//! and returns it to the button that opened it.

import { h } from './dom.js';
import { getApiKey, setApiKey } from './api.js';

const NUMBER_FIELDS = [
  // [settings key, input id, parse]
  ['temperature', 'set-temperature', parseFloat],
  ['topP', 'set-top-p', parseFloat],
  ['maxTokens', 'set-max-tokens', (v) => parseInt(v, 10)],
];

export class SettingsDialog {
  /** onSave(settings) receives the new settings of the conversation being edited. */
  constructor(dialog, onSave) {
    this.dialog = dialog;
    this.form = dialog.querySelector('form');
    this.onSave = onSave;
    this.opener = null;
    this.form.addEventListener('submit', (e) => {
      e.preventDefault();
      if (!this.form.reportValidity()) return;
      this.onSave(this.read());
      setApiKey(this.form.querySelector('#set-api-key').value.trim());
      this.close();
    });
    dialog.querySelector('.dialog-cancel').addEventListener('click', () => this.close());
    dialog.addEventListener('close', () => this.opener?.focus());
  }

  /** Opens the dialog for `settings`, offering `models` (ids) and keeping an unknown current one. */
  open(settings, models, opener, modelsError = null) {
    this.opener = opener;
    const select = this.form.querySelector('#set-model');
    const ids = [...models];
    if (settings.model && !ids.includes(settings.model)) ids.push(settings.model);
    select.replaceChildren(...ids.map((id) => h('option', { value: id },
      models.includes(id) ? id : `${id} (not served now)`)));
    select.value = settings.model || models[0] || '';
    const note = this.form.querySelector('#set-model-note');
    note.textContent = modelsError ? `Could not load the model list: ${modelsError}` : '';
    this.form.querySelector('#set-system').value = settings.systemPrompt || '';
    for (const [key, id] of NUMBER_FIELDS) {
      const value = settings[key];
      this.form.querySelector(`#${id}`).value = value === null || value === undefined ? '' : String(value);
    }
    this.form.querySelector('#set-api-key').value = getApiKey();
    this.dialog.showModal();
    select.focus();
  }

  close() {
    if (this.dialog.open) this.dialog.close();
  }

  read() {
    const settings = {
      model: this.form.querySelector('#set-model').value,
      systemPrompt: this.form.querySelector('#set-system').value,
    };
    for (const [key, id, parse] of NUMBER_FIELDS) {
      const raw = this.form.querySelector(`#${id}`).value.trim();
      const value = raw === '' ? null : parse(raw);
      settings[key] = Number.isFinite(value) ? value : null;
    }
    return settings;
  }
}
