//! A small Markdown renderer written for model output: text in, a DocumentFragment out.
//!
//! Safety invariant: the renderer never parses HTML. It builds elements with `document.createElement`
//! from a fixed set of tags and puts every piece of model text in Text nodes, so `<script>`,
//! `<img onerror=…>` and friends are shown literally. Link targets are kept only for http(s) and
//! mailto URLs; images are shown as links (no request leaves the page because a model said so).
//!
//! Supported: ATX headings, paragraphs (single newlines are line breaks, as chat users expect),
//! fenced code (``` or ~~~, an unclosed fence renders while streaming), block quotes, ordered and
//! unordered lists (nested by indentation, task boxes), GFM tables, thematic breaks; inline code,
//! **strong**, *em*, ~~strike~~, [links](url), <autolinks> and bare URLs, backslash escapes;
//! TeX math (`$…$`, `\(…\)` inline, `$$…$$` and `\[…\]` display) through math.js's MathML.

import { h } from './dom.js';
import { highlight } from './highlight.js';
import { renderTex } from './math.js';

const FENCE_RE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)[^`]*$/;
const HEADING_RE = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
const HR_RE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE_RE = /^ {0,3}> ?/;
const LIST_RE = /^( {0,12})([-*+]|\d{1,9}[.)])([ \t]+|$)(.*)$/;
const TABLE_DELIM_RE = /^ {0,3}\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const MATH_BLOCK_RE = /^ {0,3}(\$\$|\\\[)/;

/**
 * Renders Markdown to a fragment. `options.onCopyCode(text, button)` is called by code-block copy
 * buttons; the caller owns the clipboard.
 */
export function renderMarkdown(src, options = {}) {
  const fragment = document.createDocumentFragment();
  for (const block of parseBlocks(String(src).replace(/\r\n?/g, '\n'))) {
    fragment.append(renderBlock(block, options));
  }
  return fragment;
}

// ---------------------------------------------------------------- blocks

/** Splits source into block descriptors (plain objects; rendering is a separate step). */
export function parseBlocks(src) {
  const lines = src.split('\n');
  const blocks = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (isBlank(line)) { i += 1; continue; }
    let m;
    if ((m = FENCE_RE.exec(line))) {
      i = parseFence(lines, i, m, blocks);
    } else if ((m = HEADING_RE.exec(line))) {
      blocks.push({ type: 'heading', level: m[1].length, text: m[2] || '' });
      i += 1;
    } else if (HR_RE.test(line)) {
      blocks.push({ type: 'hr' });
      i += 1;
    } else if ((m = MATH_BLOCK_RE.exec(line)) && isMathBlock(lines, i, m[1])) {
      i = parseMathBlock(lines, i, m[1], blocks);
    } else if (QUOTE_RE.test(line)) {
      const inner = [];
      while (i < lines.length && !isBlank(lines[i]) && QUOTE_RE.test(lines[i])) {
        inner.push(lines[i].replace(QUOTE_RE, ''));
        i += 1;
      }
      blocks.push({ type: 'quote', children: parseBlocks(inner.join('\n')) });
    } else if ((m = LIST_RE.exec(line)) && (m[4].trim() !== '' || isListStartAllowedEmpty(lines, i))) {
      i = parseList(lines, i, blocks);
    } else if (i + 1 < lines.length && line.includes('|') && TABLE_DELIM_RE.test(lines[i + 1])
               && splitRow(lines[i + 1]).length === splitRow(line).length) {
      i = parseTable(lines, i, blocks);
    } else {
      const para = [];
      while (i < lines.length && !isBlank(lines[i]) && (para.length === 0 || !startsBlock(lines, i))) {
        para.push(lines[i].trim() === '' ? '' : lines[i].replace(/^ {1,}/, ''));
        i += 1;
      }
      blocks.push({ type: 'para', text: para.join('\n') });
    }
  }
  return blocks;
}

function isBlank(line) { return /^\s*$/.test(line); }

// An empty bullet ("-" alone) starts a list only when another item follows; otherwise it is text
// (a lone "-" while streaming must not flash a list).
function isListStartAllowedEmpty(lines, i) {
  return i + 1 < lines.length && LIST_RE.test(lines[i + 1]);
}

function closerOf(opener) { return opener === '$$' ? '$$' : '\\]'; }

// `$$` opens a display formula when the line is `$$…$$` alone or the formula goes on below it
// (the closer on a later line, or none yet while the reply streams).
function isMathBlock(lines, i, opener) {
  const rest = lines[i].trim().slice(opener.length);
  const close = rest.indexOf(closerOf(opener));
  return close < 0 || rest.slice(close + 2).trim() === '';
}

function parseMathBlock(lines, start, opener, blocks) {
  const closer = closerOf(opener);
  let rest = lines[start].trim().slice(opener.length);
  const body = [];
  let i = start;
  let closed = false;
  for (;;) {
    const at = rest.indexOf(closer);
    if (at >= 0) { body.push(rest.slice(0, at)); closed = true; i += 1; break; }
    body.push(rest);
    i += 1;
    if (i >= lines.length) break;
    rest = lines[i];
  }
  blocks.push({ type: 'math', text: body.join('\n').trim(), closed });
  return i;
}

function startsBlock(lines, i) {
  const line = lines[i];
  if (FENCE_RE.test(line) || HEADING_RE.test(line) || HR_RE.test(line) || QUOTE_RE.test(line)) return true;
  const math = MATH_BLOCK_RE.exec(line);
  if (math && isMathBlock(lines, i, math[1])) return true;
  const m = LIST_RE.exec(line);
  // Like CommonMark, only "1." may interrupt a paragraph among ordered markers ("in 2019. we…").
  if (m && m[4].trim() !== '' && (/^[-*+]$/.test(m[2]) || /^1[.)]$/.test(m[2]))) return true;
  return false;
}

function indentOf(line) {
  const m = /^[ \t]*/.exec(line);
  return m[0].replace(/\t/g, '    ').length;
}

function parseFence(lines, start, m, blocks) {
  const marker = m[1];
  const closeRe = new RegExp(`^ {0,3}${marker[0] === '`' ? '`' : '~'}{${marker.length},}\\s*$`);
  const indent = indentOf(lines[start]);
  const body = [];
  let i = start + 1;
  let closed = false;
  while (i < lines.length) {
    if (closeRe.test(lines[i])) { closed = true; i += 1; break; }
    // A fence indented by n spaces strips up to n spaces from its content lines.
    body.push(lines[i].replace(new RegExp(`^ {0,${indent}}`), ''));
    i += 1;
  }
  blocks.push({ type: 'code', lang: m[2].toLowerCase(), text: body.join('\n'), closed });
  return i;
}

function parseList(lines, start, blocks) {
  const first = LIST_RE.exec(lines[start]);
  const ordered = /\d/.test(first[2]);
  const baseIndent = first[1].length;
  const list = { type: 'list', ordered, start: ordered ? parseInt(first[2], 10) : 1, items: [] };
  let i = start;
  while (i < lines.length) {
    const m = LIST_RE.exec(lines[i]);
    if (!m || /\d/.test(m[2]) !== ordered || m[1].length > baseIndent + 1 || m[1].length + 1 < baseIndent) break;
    const markerIndent = m[1].length;
    const contentIndent = markerIndent + m[2].length + Math.max(1, Math.min(m[3].length, 4));
    const itemLines = [m[4]];
    i += 1;
    while (i < lines.length) {
      const line = lines[i];
      if (isBlank(line)) {
        let j = i;
        while (j < lines.length && isBlank(lines[j])) j += 1;
        if (j < lines.length && indentOf(lines[j]) >= contentIndent) {
          for (; i < j; i += 1) itemLines.push('');
          continue;
        }
        break;
      }
      const indent = indentOf(line);
      const nested = LIST_RE.exec(line);
      if (indent >= contentIndent || (nested && indent > markerIndent)) {
        itemLines.push(line.replace(/\t/g, '    ').slice(Math.min(indent, contentIndent)));
        i += 1;
        continue;
      }
      if (nested || startsBlock(lines, i)) break;
      itemLines.push(line.trim()); // lazy paragraph continuation
      i += 1;
    }
    const item = { checked: null, children: null };
    const task = /^\[([ xX])\][ \t]+/.exec(itemLines[0]);
    if (task) {
      item.checked = task[1] !== ' ';
      itemLines[0] = itemLines[0].slice(task[0].length);
    }
    item.children = parseBlocks(itemLines.join('\n'));
    list.items.push(item);
    // A blank line followed by a sibling marker keeps the list going.
    while (i < lines.length && isBlank(lines[i])) {
      let j = i;
      while (j < lines.length && isBlank(lines[j])) j += 1;
      const next = j < lines.length ? LIST_RE.exec(lines[j]) : null;
      if (next && /\d/.test(next[2]) === ordered && next[1].length <= baseIndent + 1) { i = j; list.loose = true; } else break;
    }
  }
  blocks.push(list);
  return i;
}

/** Splits a table row on unescaped pipes outside code spans, dropping the outer pipes. */
export function splitRow(line) {
  let s = line.trim();
  if (s.startsWith('|')) s = s.slice(1);
  if (s.endsWith('|') && !s.endsWith('\\|')) s = s.slice(0, -1);
  const cells = [];
  let cell = '';
  let inCode = false;
  for (let k = 0; k < s.length; k += 1) {
    const c = s[k];
    if (c === '\\' && s[k + 1] === '|') { cell += '|'; k += 1; continue; }
    if (c === '`') inCode = !inCode;
    if (c === '|' && !inCode) { cells.push(cell.trim()); cell = ''; continue; }
    cell += c;
  }
  cells.push(cell.trim());
  return cells;
}

function parseTable(lines, start, blocks) {
  const header = splitRow(lines[start]);
  const align = splitRow(lines[start + 1]).map((d) => {
    const left = d.startsWith(':');
    const right = d.endsWith(':');
    if (left && right) return 'center';
    if (right) return 'right';
    if (left) return 'left';
    return null;
  });
  const rows = [];
  let i = start + 2;
  while (i < lines.length && !isBlank(lines[i]) && lines[i].includes('|') && !startsBlock(lines, i)) {
    const cells = splitRow(lines[i]);
    rows.push(header.map((_, k) => cells[k] ?? ''));
    i += 1;
  }
  blocks.push({ type: 'table', header, align, rows });
  return i;
}

function renderBlock(block, options) {
  switch (block.type) {
    case 'heading': return h(`h${block.level}`, {}, parseInline(block.text));
    case 'hr': return h('hr');
    case 'para': return h('p', {}, parseInline(block.text));
    case 'quote': return h('blockquote', {}, block.children.map((b) => renderBlock(b, options)));
    case 'code': return renderCode(block, options);
    case 'list': return renderList(block, options);
    case 'table': return renderTable(block);
    case 'math': return renderMathBlock(block);
    default: throw new Error(`unknown block type ${block.type}: this is a bug`);
  }
}

function renderList(block, options) {
  const attrs = block.ordered && block.start !== 1 ? { start: block.start } : {};
  const list = h(block.ordered ? 'ol' : 'ul', attrs);
  if (!block.loose) list.classList.add('tight');
  for (const item of block.items) {
    const li = h('li');
    if (item.checked !== null) {
      li.classList.add('task');
      li.append(h('input', { type: 'checkbox', disabled: true, checked: item.checked, 'aria-label': item.checked ? 'done' : 'not done' }));
    }
    for (const child of item.children) li.append(renderBlock(child, options));
    list.append(li);
  }
  return list;
}

function renderTable(block) {
  const cell = (tag, text, k) => h(tag, block.align[k] ? { style: `text-align:${block.align[k]}` } : {}, parseInline(text));
  return h('div', { class: 'table-wrap', tabindex: '0', role: 'region', 'aria-label': 'Table' },
    h('table', {},
      h('thead', {}, h('tr', {}, block.header.map((t, k) => cell('th', t, k)))),
      h('tbody', {}, block.rows.map((row) => h('tr', {}, row.map((t, k) => cell('td', t, k)))))));
}

function renderCode(block, options) {
  const label = block.lang || 'text';
  const code = h('code', { class: block.lang ? `language-${block.lang}` : null });
  code.append(highlight(block.text, block.lang));
  const copy = h('button', {
    type: 'button', class: 'code-copy', 'aria-label': `Copy ${label} code`, title: 'Copy code',
    onclick: (event) => options.onCopyCode?.(block.text, event.currentTarget),
  }, 'Copy');
  return h('div', { class: 'code-block' },
    h('div', { class: 'code-head' }, h('span', { class: 'code-lang' }, label), copy),
    h('pre', { tabindex: '0' }, code));
}

function renderMathBlock(block) {
  // An unclosed formula is still streaming: show its source until the closer arrives.
  if (!block.closed) return h('pre', { class: 'math-pending' }, block.text);
  return h('div', { class: 'math-block', tabindex: '0' }, mathOrSource(block.text, true));
}

/** The formula as MathML, or (when it does not parse) its source, marked, with the reason. */
function mathOrSource(tex, display) {
  try {
    return renderTex(tex, { display });
  } catch (err) {
    const delim = display ? '$$' : '$';
    return h('code', { class: 'math-error', title: `Not rendered: ${err.message}` }, `${delim}${tex}${delim}`);
  }
}

/** `$…$` (pandoc's rule: no space inside the dollars, no digit right after the closer, so
 * "$5 and $10" stays text), `$$…$$`, `\(…\)` and `\[…\]`. Returns {node, end} or null. */
function parseInlineMath(text, i) {
  const c = text[i];
  const next = text[i + 1];
  if (c === '\\' && (next === '(' || next === '[')) {
    const closer = next === '(' ? '\\)' : '\\]';
    const end = text.indexOf(closer, i + 2);
    if (end < 0 || end === i + 2) return null;
    return { node: mathOrSource(text.slice(i + 2, end), next === '['), end: end + 2 };
  }
  if (c !== '$') return null;
  if (next === '$') {
    const end = text.indexOf('$$', i + 2);
    if (end < 0 || end === i + 2) return null;
    return { node: mathOrSource(text.slice(i + 2, end), true), end: end + 2 };
  }
  if (next === undefined || /\s/.test(next)) return null;
  for (let k = i + 1; k < text.length; k += 1) {
    if (text[k] === '\\') { k += 1; continue; }
    if (text[k] === '\n' && text[k + 1] === '\n') return null;
    if (text[k] === '$') {
      if (/\s/.test(text[k - 1]) || /[0-9]/.test(text[k + 1] || '')) return null;
      return { node: mathOrSource(text.slice(i + 1, k), false), end: k + 1 };
    }
  }
  return null;
}

// ---------------------------------------------------------------- inlines

const ESCAPABLE = /[!-/:-@[-`{-~]/;
const SAFE_URL_RE = /^(https?:\/\/|mailto:)/i;
const BARE_URL_RE = /^https?:\/\/[^\s<>"'`]*[^\s<>"'`.,:;!?)\]}*_~]/;
const AUTOLINK_RE = /^<((?:https?:\/\/|mailto:)[^\s<>]+)>/i;

/** Whether a link target may become an href: absolute http(s) or mailto, and parseable. */
export function safeUrl(url) {
  const trimmed = url.trim();
  if (!SAFE_URL_RE.test(trimmed)) return null;
  try {
    const parsed = new URL(trimmed);
    return ['http:', 'https:', 'mailto:'].includes(parsed.protocol) ? parsed.href : null;
  } catch {
    return null;
  }
}

function link(url, children) {
  const href = safeUrl(url);
  if (!href) return h('span', { class: 'unsafe-link', title: 'link removed' }, children);
  return h('a', { href, target: '_blank', rel: 'noopener noreferrer nofollow' }, children);
}

/** Parses inline Markdown into an array of DOM nodes. */
export function parseInline(text) {
  const out = [];
  let buf = '';
  const flush = () => { if (buf) { out.push(document.createTextNode(buf)); buf = ''; } };
  let i = 0;
  while (i < text.length) {
    const c = text[i];
    if (c === '$' || (c === '\\' && (text[i + 1] === '(' || text[i + 1] === '['))) {
      const math = parseInlineMath(text, i);
      if (math) { flush(); out.push(math.node); i = math.end; continue; }
    }
    if (c === '\\' && i + 1 < text.length) {
      if (text[i + 1] === '\n') { flush(); out.push(h('br')); i += 2; continue; }
      if (ESCAPABLE.test(text[i + 1])) { buf += text[i + 1]; i += 2; continue; }
    }
    if (c === '\n') { flush(); buf = ''; out.push(h('br')); i += 1; continue; }
    if (c === '`') {
      const run = runLength(text, i, '`');
      const close = findBacktickClose(text, i + run, run);
      if (close >= 0) {
        flush();
        let inner = text.slice(i + run, close).replace(/\n/g, ' ');
        if (/^ .*[^ ].* $/.test(inner)) inner = inner.slice(1, -1);
        out.push(h('code', {}, inner));
        i = close + run;
        continue;
      }
      buf += text.slice(i, i + run);
      i += run;
      continue;
    }
    if ((c === '[' || (c === '!' && text[i + 1] === '['))) {
      const parsed = parseLink(text, c === '!' ? i + 1 : i);
      if (parsed) {
        flush();
        if (c === '!') {
          // Images are never fetched: show the alt text as a link to the image.
          out.push(link(parsed.url, ['🖼 ', parsed.label || parsed.url]));
        } else {
          out.push(link(parsed.url, parseInline(parsed.label)));
        }
        i = parsed.end;
        continue;
      }
    }
    if (c === '<') {
      const m = AUTOLINK_RE.exec(text.slice(i));
      if (m) { flush(); out.push(link(m[1], [m[1].replace(/^mailto:/i, '')])); i += m[0].length; continue; }
    }
    if (c === 'h' && (i === 0 || !/[\w/]/.test(text[i - 1]))) {
      const m = BARE_URL_RE.exec(text.slice(i));
      if (m) { flush(); out.push(link(m[0], [m[0]])); i += m[0].length; continue; }
    }
    if (c === '*' || c === '_' || c === '~') {
      const em = parseEmphasis(text, i);
      if (em) { flush(); out.push(em.node); i = em.end; continue; }
      const run = runLength(text, i, c);
      buf += text.slice(i, i + run);
      i += run;
      continue;
    }
    buf += c;
    i += 1;
  }
  flush();
  return out;
}

function runLength(text, i, ch) {
  let n = 0;
  while (text[i + n] === ch) n += 1;
  return n;
}

function findBacktickClose(text, from, run) {
  let k = text.indexOf('`', from);
  while (k >= 0) {
    const n = runLength(text, k, '`');
    if (n === run) return k;
    k = text.indexOf('`', k + n);
  }
  return -1;
}

// [label](url "title") with nested brackets in the label and balanced parentheses in the url.
function parseLink(text, open) {
  let depth = 0;
  let k = open;
  for (; k < text.length; k += 1) {
    if (text[k] === '\\') { k += 1; continue; }
    if (text[k] === '[') depth += 1;
    else if (text[k] === ']') { depth -= 1; if (depth === 0) break; }
  }
  if (k >= text.length || text[k + 1] !== '(') return null;
  const label = text.slice(open + 1, k);
  let p = k + 2;
  let parens = 1;
  let end = -1;
  for (; p < text.length; p += 1) {
    if (text[p] === '\\') { p += 1; continue; }
    if (text[p] === '\n') return null;
    if (text[p] === '(') parens += 1;
    else if (text[p] === ')') { parens -= 1; if (parens === 0) { end = p; break; } }
  }
  if (end < 0) return null;
  let target = text.slice(k + 2, end).trim();
  target = target.replace(/\s+("[^"]*"|'[^']*')$/, '');
  if (target.startsWith('<') && target.endsWith('>')) target = target.slice(1, -1);
  return { label, url: target, end: end + 1 };
}

function isSpace(ch) { return ch === undefined || /\s/.test(ch); }
function isWordChar(ch) { return ch !== undefined && /[\p{L}\p{N}]/u.test(ch); }

// Emphasis by search rather than CommonMark's delimiter stack: an opener must be followed by a
// non-space, its closer preceded by one; a closer run must match the opener's length (or be a
// run of three, which closes *** nesting); `_` never works inside a word.
function parseEmphasis(text, i) {
  const ch = text[i];
  const run = runLength(text, i, ch);
  const size = ch === '~' ? 2 : Math.min(run, 2);
  if (ch === '~' && run !== 2) return null;
  if (isSpace(text[i + size])) return null;
  if (ch === '_' && isWordChar(text[i - 1])) return null;
  let k = i + size + 1;
  while (k < text.length) {
    if (text[k] === '`') {
      const n = runLength(text, k, '`');
      const close = findBacktickClose(text, k + n, n);
      k = close >= 0 ? close + n : k + n;
      continue;
    }
    if (text[k] !== ch) { k += 1; continue; }
    const n = runLength(text, k, ch);
    const closesHere = !isSpace(text[k - 1]) && (n === size || n === 3)
      && !(ch === '_' && isWordChar(text[k + n]));
    if (closesHere) {
      const closeAt = k + n - size;
      const inner = text.slice(i + size, closeAt);
      if (inner.length === 0) return null;
      const tag = ch === '~' ? 'del' : size === 2 ? 'strong' : 'em';
      return { node: h(tag, {}, parseInline(inner)), end: closeAt + size };
    }
    k += n;
  }
  return null;
}
