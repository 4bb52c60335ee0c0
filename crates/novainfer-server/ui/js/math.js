//! TeX math → MathML, for `$…$`, `$$…$$`, `\(…\)` and `\[…\]` in replies. The browser typesets
//! MathML itself (MathML Core), so this is a parser only: no fonts, no CDN, no HTML strings.
//!
//! Covers the TeX that models write: letters, numbers, operators, `^`/`_` scripts, `\frac`,
//! `\dfrac`, `\binom`, `\sqrt[n]{}`, Greek letters, relations, arrows, big operators with limits
//! (`\sum`, `\int`, `\prod`, `\lim`…), function names (`\sin`, `\log`, `\operatorname{}`),
//! `\text{}`, `\mathbf{}`, `\mathbb{}`, `\mathcal{}`, accents (`\hat`, `\bar`, `\vec`,
//! `\overline`…), `\left…\right` fences, spacing, and the environments matrix/pmatrix/bmatrix/
//! vmatrix/cases/aligned/array. An unknown command is shown as its name (highlighted), not an
//! error; unbalanced braces are a `TexError` and the caller shows the source instead.
//!
//! Safety: every element is made with createElementNS from a fixed set of MathML tags and all
//! text goes into Text nodes, like the Markdown renderer.

const NS = 'http://www.w3.org/1998/Math/MathML';

export class TexError extends Error {}

function el(tag, attrs = {}, ...children) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== null && v !== undefined) node.setAttribute(k, String(v));
  for (const c of children.flat()) if (c !== null && c !== undefined) node.append(typeof c === 'string' ? document.createTextNode(c) : c);
  return node;
}

const row = (nodes) => (nodes.length === 1 ? nodes[0] : el('mrow', {}, nodes));

const GREEK = {
  alpha: 'α', beta: 'β', gamma: 'γ', delta: 'δ', epsilon: 'ϵ', varepsilon: 'ε', zeta: 'ζ', eta: 'η', theta: 'θ',
  vartheta: 'ϑ', iota: 'ι', kappa: 'κ', lambda: 'λ', mu: 'μ', nu: 'ν', xi: 'ξ', pi: 'π', varpi: 'ϖ', rho: 'ρ',
  varrho: 'ϱ', sigma: 'σ', varsigma: 'ς', tau: 'τ', upsilon: 'υ', phi: 'ϕ', varphi: 'φ', chi: 'χ', psi: 'ψ',
  omega: 'ω', Gamma: 'Γ', Delta: 'Δ', Theta: 'Θ', Lambda: 'Λ', Xi: 'Ξ', Pi: 'Π', Sigma: 'Σ', Upsilon: 'Υ',
  Phi: 'Φ', Psi: 'Ψ', Omega: 'Ω',
};

// Identifiers that are symbols rather than variables.
const SYMBOL_IDENTIFIERS = {
  infty: '∞', emptyset: '∅', varnothing: '∅', hbar: 'ℏ', ell: 'ℓ', Re: 'ℜ', Im: 'ℑ', aleph: 'ℵ', nabla: '∇',
  partial: '∂', wp: '℘', top: '⊤', bot: '⊥', angle: '∠', triangle: '△', prime: '′', dagger: '†',
};

const OPERATORS = {
  times: '×', cdot: '⋅', pm: '±', mp: '∓', div: '÷', ast: '∗', star: '⋆', circ: '∘', bullet: '∙', oplus: '⊕',
  otimes: '⊗', odot: '⊙', setminus: '∖', cup: '∪', cap: '∩', wedge: '∧', land: '∧', vee: '∨', lor: '∨',
  neg: '¬', lnot: '¬', le: '≤', leq: '≤', ge: '≥', geq: '≥', ne: '≠', neq: '≠', approx: '≈', equiv: '≡',
  sim: '∼', simeq: '≃', cong: '≅', propto: '∝', ll: '≪', gg: '≫', prec: '≺', succ: '≻', in: '∈', notin: '∉',
  ni: '∋', subset: '⊂', subseteq: '⊆', supset: '⊃', supseteq: '⊇', perp: '⊥', parallel: '∥', mid: '∣',
  to: '→', rightarrow: '→', leftarrow: '←', gets: '←', leftrightarrow: '↔', Rightarrow: '⇒', Leftarrow: '⇐',
  Leftrightarrow: '⇔', implies: '⟹', iff: '⟺', mapsto: '↦', longrightarrow: '⟶', longleftarrow: '⟵',
  uparrow: '↑', downarrow: '↓', forall: '∀', exists: '∃', nexists: '∄', therefore: '∴', because: '∵',
  cdots: '⋯', ldots: '…', dots: '…', vdots: '⋮', ddots: '⋱', colon: ':', vert: '|', Vert: '‖',
  langle: '⟨', rangle: '⟩', lfloor: '⌊', rfloor: '⌋', lceil: '⌈', rceil: '⌉', lbrace: '{', rbrace: '}',
  '{': '{', '}': '}', '|': '‖', '#': '#', '%': '%', '&': '&', _: '_', $: '$',
};

// Big operators: limits go under/over in display style (except integrals, whose go beside).
const BIG_OPERATORS = {
  sum: '∑', prod: '∏', coprod: '∐', int: '∫', iint: '∬', iiint: '∭', oint: '∮', bigcup: '⋃', bigcap: '⋂',
  bigoplus: '⨁', bigotimes: '⨂', bigvee: '⋁', bigwedge: '⋀',
};
const INTEGRALS = new Set(['int', 'iint', 'iiint', 'oint']);
// Operators whose scripts go under and over them (display style): \sum_{i=1}^n, \lim_{x\to0}.
const LIMITS = new WeakSet();

const FUNCTIONS = new Set(['sin', 'cos', 'tan', 'cot', 'sec', 'csc', 'arcsin', 'arccos', 'arctan', 'sinh', 'cosh',
  'tanh', 'log', 'ln', 'lg', 'exp', 'det', 'dim', 'ker', 'gcd', 'deg', 'arg', 'hom', 'Pr', 'lim', 'liminf',
  'limsup', 'max', 'min', 'sup', 'inf', 'mod']);
const LIMIT_FUNCTIONS = new Set(['lim', 'liminf', 'limsup', 'max', 'min', 'sup', 'inf', 'Pr', 'det', 'gcd']);

const ACCENTS = {
  hat: '^', widehat: '^', bar: '¯', overline: '¯', vec: '→', overrightarrow: '→', tilde: '~', widetilde: '~',
  dot: '˙', ddot: '¨', check: 'ˇ', breve: '˘', acute: '´', grave: '`',
};

const SPACES = { ',': '0.1667em', ':': '0.2222em', '>': '0.2222em', ';': '0.2778em', ' ': '0.25em', quad: '1em', qquad: '2em', enspace: '0.5em' };

// Letters of the math alphabets Chromium's MathML cannot select with mathvariant: Unicode has them.
const ALPHABET_BASES = {
  bb: { upper: 0x1d538, digit: 0x1d7d8, holes: { C: 'ℂ', H: 'ℍ', N: 'ℕ', P: 'ℙ', Q: 'ℚ', R: 'ℝ', Z: 'ℤ' } },
  cal: { upper: 0x1d49c, holes: { B: 'ℬ', E: 'ℰ', F: 'ℱ', H: 'ℋ', I: 'ℐ', L: 'ℒ', M: 'ℳ', R: 'ℛ' } },
  frak: { upper: 0x1d504, holes: { C: 'ℭ', H: 'ℌ', I: 'ℑ', R: 'ℜ', Z: 'ℨ' } },
};

function mapAlphabet(text, style) {
  const a = ALPHABET_BASES[style];
  return [...text].map((ch) => {
    if (a.holes[ch]) return a.holes[ch];
    if (ch >= 'A' && ch <= 'Z') return String.fromCodePoint(a.upper + ch.charCodeAt(0) - 65);
    if (a.digit && ch >= '0' && ch <= '9') return String.fromCodePoint(a.digit + ch.charCodeAt(0) - 48);
    return ch;
  }).join('');
}

const FENCES = { '(': '(', ')': ')', '[': '[', ']': ']', '|': '|', '.': '', '/': '/', '<': '⟨', '>': '⟩' };

const MATRIX_FENCES = {
  matrix: ['', ''], pmatrix: ['(', ')'], bmatrix: ['[', ']'], Bmatrix: ['{', '}'], vmatrix: ['|', '|'],
  Vmatrix: ['‖', '‖'], smallmatrix: ['', ''], array: ['', ''], aligned: ['', ''], align: ['', ''],
  'align*': ['', ''], gathered: ['', ''], gather: ['', ''], 'gather*': ['', ''], split: ['', ''],
  equation: ['', ''], 'equation*': ['', ''], cases: ['{', ''], rcases: ['', '}'],
};

/** Splits TeX into tokens: {t: 'cmd'|'char'|'num'|'space', v}. */
export function tokenize(src) {
  const tokens = [];
  let i = 0;
  while (i < src.length) {
    const c = src[i];
    if (c === '\\') {
      const m = /^\\([a-zA-Z]+\*?|.)/s.exec(src.slice(i));
      if (!m) throw new TexError('a lone backslash at the end');
      tokens.push({ t: 'cmd', v: m[1] });
      i += m[0].length;
      // A control word swallows the spaces after it, as in TeX.
      if (/^[a-zA-Z]/.test(m[1])) while (/\s/.test(src[i] || '')) i += 1;
    } else if (/\s/.test(c)) {
      while (/\s/.test(src[i] || '')) i += 1;
      tokens.push({ t: 'space', v: ' ' });
    } else if (/[0-9]/.test(c)) {
      const m = /^[0-9]+(?:\.[0-9]+)?/.exec(src.slice(i));
      tokens.push({ t: 'num', v: m[0] });
      i += m[0].length;
    } else {
      const cp = src.codePointAt(i);
      const ch = String.fromCodePoint(cp);
      tokens.push({ t: 'char', v: ch });
      i += ch.length;
    }
  }
  return tokens;
}

class Parser {
  constructor(tokens, display) {
    this.tokens = tokens;
    this.pos = 0;
    this.display = display;
  }

  peek() { return this.tokens[this.pos]; }
  next() { return this.tokens[this.pos++]; }
  skipSpaces() { while (this.peek()?.t === 'space') this.pos += 1; }

  isEnd(stop) {
    const tok = this.peek();
    if (!tok) return true;
    return stop(tok);
  }

  /** Parses atoms until `stop(token)` (not consumed); returns the MathML nodes. */
  parseList(stop = () => false) {
    const nodes = [];
    for (;;) {
      this.skipSpaces();
      if (this.isEnd(stop)) break;
      const tok = this.peek();
      if (tok.t === 'char' && tok.v === '}') throw new TexError('an unmatched }');
      const atom = this.parseAtom();
      if (atom === null) continue;
      nodes.push(this.parseScripts(atom));
    }
    return nodes;
  }

  /** A required argument: `{…}` or a single token. */
  parseArg() {
    this.skipSpaces();
    const tok = this.peek();
    if (!tok) throw new TexError('a command is missing its argument');
    if (tok.t === 'char' && tok.v === '{') return row(this.parseGroup());
    if (tok.t === 'num') { this.next(); return tok.v.length === 1 ? el('mn', {}, tok.v) : this.splitNumber(tok); }
    const atom = this.parseAtom();
    return atom ?? el('mrow');
  }

  // `\frac12`: a bare numeric argument is one digit, the rest goes back to the stream.
  splitNumber(tok) {
    this.tokens.splice(this.pos, 0, { t: 'num', v: tok.v.slice(1) });
    return el('mn', {}, tok.v[0]);
  }

  /** The raw text of a `{…}` argument (for \text, \operatorname, \begin). */
  parseRawArg() {
    this.skipSpaces();
    const open = this.next();
    if (!open || open.t !== 'char' || open.v !== '{') throw new TexError('expected {');
    let depth = 1;
    let text = '';
    for (;;) {
      const tok = this.next();
      if (!tok) throw new TexError('an unclosed {');
      if (tok.t === 'char' && tok.v === '{') depth += 1;
      if (tok.t === 'char' && tok.v === '}') { depth -= 1; if (depth === 0) break; }
      text += tok.t === 'cmd' ? (OPERATORS[tok.v] && tok.v.length === 1 ? tok.v : `\\${tok.v}`) : tok.v;
    }
    return text;
  }

  parseGroup() {
    this.next(); // {
    const nodes = this.parseList((t) => t.t === 'char' && t.v === '}');
    const close = this.next();
    if (!close) throw new TexError('an unclosed {');
    return nodes;
  }

  parseOptional() {
    this.skipSpaces();
    const tok = this.peek();
    if (!(tok && tok.t === 'char' && tok.v === '[')) return null;
    this.next();
    const nodes = this.parseList((t) => t.t === 'char' && t.v === ']');
    if (!this.next()) throw new TexError('an unclosed [');
    return row(nodes);
  }

  parseScripts(base) {
    let sub = null;
    let sup = null;
    let primes = '';
    for (;;) {
      this.skipSpaces();
      const tok = this.peek();
      if (!tok || tok.t !== 'char') break;
      if (tok.v === "'") { this.next(); primes += '′'; continue; }
      if (tok.v !== '^' && tok.v !== '_') break;
      this.next();
      const arg = this.parseArg();
      if (tok.v === '^') { if (sup) throw new TexError('a double superscript'); sup = arg; } else {
        if (sub) throw new TexError('a double subscript');
        sub = arg;
      }
    }
    if (primes) sup = sup ? row([el('mo', {}, primes), sup]) : el('mo', {}, primes);
    if (!sub && !sup) return base;
    const under = LIMITS.has(base);
    if (under) {
      if (sub && sup) return el('munderover', {}, base, sub, sup);
      return sub ? el('munder', {}, base, sub) : el('mover', {}, base, sup);
    }
    if (sub && sup) return el('msubsup', {}, base, sub, sup);
    return sub ? el('msub', {}, base, sub) : el('msup', {}, base, sup);
  }

  parseAtom() {
    const tok = this.next();
    if (tok.t === 'num') return el('mn', {}, tok.v);
    if (tok.t === 'char') {
      if (tok.v === '{') { this.pos -= 1; return row(this.parseGroup()); }
      if (tok.v === '^' || tok.v === '_') { this.pos -= 1; return this.parseScripts(el('mrow')); }
      if (tok.v === '&') throw new TexError('& outside a table');
      if (tok.v === '~') return el('mspace', { width: SPACES[' '] });
      if (/[\p{L}]/u.test(tok.v)) return el('mi', {}, tok.v);
      if (tok.v === "'") return el('mo', {}, '′');
      return el('mo', {}, tok.v === '-' ? '−' : tok.v === '*' ? '∗' : tok.v);
    }
    return this.command(tok.v);
  }

  command(name) {
    if (GREEK[name]) return el('mi', /^[A-Z]/.test(name) ? { mathvariant: 'normal' } : {}, GREEK[name]);
    if (SYMBOL_IDENTIFIERS[name]) return el('mi', { mathvariant: 'normal' }, SYMBOL_IDENTIFIERS[name]);
    if (name in SPACES) return el('mspace', { width: SPACES[name] });
    if (name === '!') return el('mspace', { width: '-0.1667em' });
    if (BIG_OPERATORS[name]) {
      const op = el('mo', { largeop: this.display ? 'true' : null, movablelimits: 'true' }, BIG_OPERATORS[name]);
      if (this.display && !INTEGRALS.has(name)) LIMITS.add(op);
      return op;
    }
    if (OPERATORS[name]) return el('mo', {}, OPERATORS[name]);
    if (FUNCTIONS.has(name)) {
      const fn = el('mi', { mathvariant: name.length === 1 ? 'normal' : null }, name);
      if (this.display && LIMIT_FUNCTIONS.has(name)) LIMITS.add(fn);
      return fn;
    }
    if (ACCENTS[name]) {
      const base = this.parseArg();
      return el('mover', { accent: 'true' }, base, el('mo', { stretchy: name.startsWith('wide') || name.startsWith('over') ? 'true' : 'false' }, ACCENTS[name]));
    }
    switch (name) {
      case 'frac': case 'dfrac': case 'tfrac': case 'cfrac': return el('mfrac', {}, this.parseArg(), this.parseArg());
      case 'binom': case 'dbinom': case 'tbinom': {
        return el('mrow', {}, el('mo', {}, '('), el('mfrac', { linethickness: '0' }, this.parseArg(), this.parseArg()), el('mo', {}, ')'));
      }
      case 'sqrt': {
        const index = this.parseOptional();
        const radicand = this.parseArg();
        return index ? el('mroot', {}, radicand, index) : el('msqrt', {}, radicand);
      }
      case 'text': case 'textrm': case 'textit': case 'textbf': case 'mbox': case 'textsf': case 'texttt':
        return el('mtext', {}, this.parseRawArg().replace(/\\([{}$%&_#])/g, '$1'));
      case 'operatorname': case 'operatorname*':
        return el('mi', { mathvariant: 'normal' }, this.parseRawArg());
      case 'mathrm': case 'mathsf': case 'mathtt': case 'mathit': case 'mathnormal': {
        const text = this.parseRawArg();
        return el('mi', { mathvariant: name === 'mathit' ? 'italic' : 'normal' }, text);
      }
      case 'mathbf': case 'boldsymbol': case 'bm': {
        const inner = this.parseArg();
        inner.classList.add('tex-bold');
        for (const mi of inner.querySelectorAll('mi')) mi.classList.add('tex-bold');
        return inner;
      }
      case 'mathbb': return el('mi', { mathvariant: 'normal' }, mapAlphabet(this.parseRawArg(), 'bb'));
      case 'mathcal': case 'mathscr': return el('mi', { mathvariant: 'normal' }, mapAlphabet(this.parseRawArg(), 'cal'));
      case 'mathfrak': return el('mi', { mathvariant: 'normal' }, mapAlphabet(this.parseRawArg(), 'frak'));
      case 'underline': return el('munder', { accentunder: 'true' }, this.parseArg(), el('mo', { stretchy: 'true' }, '_'));
      case 'overset': case 'stackrel': { const over = this.parseArg(); return el('mover', {}, this.parseArg(), over); }
      case 'underset': { const under = this.parseArg(); return el('munder', {}, this.parseArg(), under); }
      case 'left': return this.fenced();
      case 'right': throw new TexError('\\right without \\left');
      case 'big': case 'Big': case 'bigg': case 'Bigg': case 'bigl': case 'bigr': case 'Bigl': case 'Bigr':
      case 'biggl': case 'biggr': case 'Biggl': case 'Biggr': case 'middle':
        return this.delimiter(true);
      case 'displaystyle': case 'textstyle': case 'scriptstyle': case 'limits': case 'nolimits': case 'nonumber':
      case 'notag':
        return null;
      case 'begin': return this.environment();
      case '\\': return null; // a line break outside a table: ignored
      case 'not': { const next = this.parseArg(); return el('mrow', {}, next, el('mo', {}, '̸')); }
      default:
        return el('mtext', { class: 'tex-unknown' }, `\\${name}`);
    }
  }

  delimiter(stretchy) {
    this.skipSpaces();
    const tok = this.next();
    if (!tok) throw new TexError('a missing delimiter');
    let text;
    if (tok.t === 'cmd') text = OPERATORS[tok.v] ?? (tok.v === '|' ? '‖' : null);
    else text = FENCES[tok.v] ?? tok.v;
    if (text === null || text === undefined) throw new TexError(`a bad delimiter \\${tok.v}`);
    return text === '' ? null : el('mo', { stretchy: stretchy ? 'true' : 'false', fence: 'true' }, text);
  }

  fenced() {
    const open = this.delimiter(true);
    const inner = this.parseList((t) => t.t === 'cmd' && t.v === 'right');
    if (!this.next()) throw new TexError('\\left without \\right');
    const close = this.delimiter(true);
    return el('mrow', {}, open, inner, close);
  }

  environment() {
    const name = this.parseRawArg();
    if (!(name in MATRIX_FENCES)) throw new TexError(`unknown environment ${name}`);
    if (name === 'array') this.parseRawArg(); // column spec: alignment ignored
    const isEnd = (t) => t.t === 'cmd' && t.v === 'end';
    const rows = [];
    let cells = [];
    for (;;) {
      const cell = this.parseList((t) => isEnd(t) || (t.t === 'char' && t.v === '&') || (t.t === 'cmd' && t.v === '\\'));
      cells.push(el('mtd', {}, row(cell)));
      const tok = this.next();
      if (!tok) throw new TexError(`\\begin{${name}} without \\end`);
      if (tok.t === 'char') continue; // &
      rows.push(el('mtr', {}, cells));
      cells = [];
      if (tok.v === 'end') break;
    }
    const endName = this.parseRawArg();
    if (endName !== name) throw new TexError(`\\begin{${name}} ended by \\end{${endName}}`);
    // A trailing \\ leaves an empty last row.
    const last = rows[rows.length - 1];
    if (rows.length > 1 && last.textContent === '' && last.children.length === 1) rows.pop();
    const left = ['cases', 'aligned', 'align', 'align*', 'split'].includes(name);
    const table = el('mtable', { columnalign: left ? 'left' : null, class: left ? 'tex-left' : null }, rows);
    const [open, close] = MATRIX_FENCES[name];
    return el('mrow', {}, open ? el('mo', { stretchy: 'true', fence: 'true' }, open) : null, table,
      close ? el('mo', { stretchy: 'true', fence: 'true' }, close) : null);
  }
}

/**
 * Renders TeX source as a `<math>` element (`display`: a block formula). Throws TexError on
 * source that cannot be parsed (unbalanced braces, \left without \right, …).
 */
export function renderTex(src, { display = false } = {}) {
  const parser = new Parser(tokenize(src), display);
  const nodes = parser.parseList();
  if (parser.pos < parser.tokens.length) throw new TexError('unexpected input');
  const math = el('math', { display: display ? 'block' : 'inline' },
    el('semantics', {}, el('mrow', {}, nodes), el('annotation', { encoding: 'application/x-tex' }, src)));
  return math;
}
