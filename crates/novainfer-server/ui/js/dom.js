//! Tiny DOM helpers shared by every view.
//!
//! Invariant: text only ever enters the page as Text nodes (`append(string)`, `textContent`),
//! never through `innerHTML`; attribute values go through `setAttribute`. Model output can
//! therefore never become markup, whatever it contains.

/** Creates an element: `h('button', {class: 'x', onclick: f, 'aria-label': 'Stop'}, 'Stop')`. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === 'class') el.className = value;
    else if (key === 'text') el.textContent = value;
    else if (key === 'dataset') Object.assign(el.dataset, value);
    else if (key.startsWith('on') && typeof value === 'function') el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? '' : String(value));
  }
  appendAll(el, children);
  return el;
}

/** Appends nodes and strings (as Text nodes), skipping null/false, flattening arrays. */
export function appendAll(parent, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    parent.append(child instanceof Node ? child : String(child));
  }
  return parent;
}

const SVG_NS = 'http://www.w3.org/2000/svg';

// 24×24 stroke icons drawn for this UI; each is a list of [element, attributes].
const ICONS = {
  plus: [['path', { d: 'M12 5v14M5 12h14' }]],
  menu: [['path', { d: 'M4 6h16M4 12h16M4 18h16' }]],
  close: [['path', { d: 'M6 6l12 12M18 6L6 18' }]],
  send: [['path', { d: 'M12 19V5M5 12l7-7 7 7' }]],
  stop: [['rect', { x: 7, y: 7, width: 10, height: 10, rx: 1.5, fill: 'currentColor' }]],
  copy: [['rect', { x: 9, y: 9, width: 11, height: 11, rx: 2 }], ['path', { d: 'M5 15V6a2 2 0 0 1 2-2h8' }]],
  check: [['path', { d: 'M5 13l4 4L19 7' }]],
  edit: [['path', { d: 'M4 20h4L19 9l-4-4L4 16v4zM14 6l4 4' }]],
  regenerate: [['path', { d: 'M20 12a8 8 0 1 1-2.3-5.7M20 4v4.5h-4.5' }]],
  trash: [['path', { d: 'M4 7h16M10 11v6M14 11v6M6 7l1 13h10l1-13M9 7V4h6v3' }]],
  settings: [
    ['path', { d: 'M4 6h9M17 6h3M4 12h3M11 12h9M4 18h11M19 18h1' }],
    ['circle', { cx: 15, cy: 6, r: 2 }], ['circle', { cx: 9, cy: 12, r: 2 }], ['circle', { cx: 17, cy: 18, r: 2 }],
  ],
  bolt: [['path', { d: 'M13 3L5 14h6l-1 7 8-11h-6l1-7z' }]],
  chat: [['path', { d: 'M5 5h14v10H9l-4 4V5z' }]],
  left: [['path', { d: 'M15 6l-6 6 6 6' }]],
  right: [['path', { d: 'M9 6l6 6-6 6' }]],
  continue: [['path', { d: 'M5 12h11M12 7l5 5-5 5M20 5v14' }]],
  tool: [['path', { d: 'M14 6a4 4 0 0 0 5 5l-8 8a2 2 0 0 1-3-3l8-8a4 4 0 0 0-2-2z' }]],
};

/** An inline SVG icon, hidden from assistive technology (its button carries the label). */
export function icon(name) {
  const svg = document.createElementNS(SVG_NS, 'svg');
  svg.setAttribute('viewBox', '0 0 24 24');
  svg.setAttribute('class', `icon icon-${name}`);
  svg.setAttribute('aria-hidden', 'true');
  svg.setAttribute('focusable', 'false');
  for (const [tag, attrs] of ICONS[name]) {
    const part = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) part.setAttribute(k, String(v));
    svg.append(part);
  }
  return svg;
}

/** An icon-only button with an accessible name and a matching tooltip. */
export function iconButton(name, label, onclick, extra = {}) {
  return h('button', { type: 'button', class: 'icon-btn', 'aria-label': label, title: label, onclick, ...extra },
    icon(name));
}

/** Random id from crypto.getRandomValues, which (unlike randomUUID) works on plain-http LAN origins too. */
export function randomId(prefix = '') {
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return prefix + Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
}

/** Copies text to the clipboard; falls back to a hidden textarea where the async API is unavailable. */
export async function copyText(text) {
  try {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
      return true;
    }
  } catch { /* fall through to the legacy path */ }
  const area = h('textarea', { class: 'clipboard-proxy', 'aria-hidden': 'true', tabindex: '-1' });
  area.value = text;
  document.body.append(area);
  area.select();
  let ok = false;
  try { ok = document.execCommand('copy'); } catch { ok = false; }
  area.remove();
  return ok;
}

/** Politely announces a short message to screen readers through the page's status region. */
export function announce(message) {
  const region = document.getElementById('sr-status');
  if (!region) return;
  // Clearing first makes a repeated identical message be read again.
  region.textContent = '';
  requestAnimationFrame(() => { region.textContent = message; });
}
