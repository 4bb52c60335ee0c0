//! Syntax highlighting for code blocks: a single-pass tokenizer driven by small per-language tables.
//!
//! Invariant: output is a DocumentFragment of Text nodes and `<span class="tok-*">` elements whose
//! concatenated text equals the input exactly (highlighting never adds, drops or reorders a
//! character). Unknown languages come back as one Text node. Good enough to read code at a glance;
//! not a parser, so rare constructs may be coloured plainly.

const words = (s) => new Set(s.split(/\s+/).filter(Boolean));

const C_COMMENTS = { lineComment: ['//'], blockComment: [['/*', '*/']] };
const JS_KEYWORDS = 'async await break case catch class const continue debugger default delete do else export extends '
  + 'finally for from function get if import in instanceof let new of return set static super switch throw try typeof '
  + 'var void while with yield as interface type enum implements private protected public readonly declare namespace '
  + 'abstract keyof satisfies';
const C_KEYWORDS = 'auto break case char const continue default do double else enum extern float for goto if inline int '
  + 'long register restrict return short signed sizeof static struct switch typedef union unsigned void volatile while '
  + 'bool class namespace template typename public private protected virtual override final new delete this throw try '
  + 'catch using operator friend constexpr noexcept nullptr static_cast dynamic_cast reinterpret_cast const_cast '
  + 'explicit mutable decltype concept requires co_await co_return co_yield __global__ __device__ __host__ __shared__';
const GO_KEYWORDS = 'break case chan const continue default defer else fallthrough for func go goto if import interface '
  + 'map package range return select struct switch type var';
const JAVA_KEYWORDS = 'abstract assert boolean break byte case catch char class const continue default do double else '
  + 'enum extends final finally float for goto if implements import instanceof int interface long native new package '
  + 'private protected public return short static strictfp super switch synchronized this throw throws transient try '
  + 'void volatile while var record sealed permits yield fun val when object companion data override open internal '
  + 'lateinit suspend let func guard struct protocol extension init deinit self Self where in is as';

const LANGS = {};
function define(names, spec) {
  const full = {
    lineComment: [], blockComment: [], strings: ['"', "'"], keywords: new Set(), literals: new Set(),
    types: new Set(), extra: [], ident: /[A-Za-z_$][\w$]*/y, capsAreTypes: false, caseInsensitive: false,
    rawStrings: [], keyStrings: false, ...spec,
  };
  for (const name of names) LANGS[name] = full;
}

define(['js', 'javascript', 'jsx', 'mjs', 'cjs', 'ts', 'typescript', 'tsx'], {
  ...C_COMMENTS, strings: ['`', '"', "'"], keywords: words(JS_KEYWORDS), capsAreTypes: true,
  literals: words('true false null undefined NaN Infinity this'),
  types: words('string number boolean any unknown never object symbol bigint'),
});
define(['python', 'py', 'python3', 'pycon'], {
  lineComment: ['#'], strings: ['"""', "'''", '"', "'"], capsAreTypes: true,
  keywords: words('and as assert async await break class continue def del elif else except finally for from global if '
    + 'import in is lambda nonlocal not or pass raise return try while with yield match case print'),
  literals: words('True False None self cls'),
  types: words('int float str bool list dict set tuple bytes object type Exception'),
  extra: [[/@[\w.]+/y, 'meta']],
});
define(['rust', 'rs'], {
  ...C_COMMENTS, strings: ['"'], capsAreTypes: true,
  keywords: words('as async await break const continue crate dyn else enum extern fn for if impl in let loop match mod '
    + 'move mut pub ref return static struct super trait type unsafe use where while'),
  literals: words('true false self Self None Some Ok Err'),
  types: words('i8 i16 i32 i64 i128 isize u8 u16 u32 u64 u128 usize f32 f64 bool char str String Vec Option Result Box'),
  extra: [
    [/#!?\[[^\]\n]*\]/y, 'meta'], [/[A-Za-z_]\w*!/y, 'fn'], [/b?'(?:\\.|[^\\'\n])'/y, 'str'], [/'[A-Za-z_]\w*/y, 'type'],
    [/r#*"/y, 'rawstr'],
  ],
});
define(['c', 'h', 'cpp', 'c++', 'cc', 'hpp', 'cxx', 'cu', 'cuda', 'cuh', 'objc'], {
  ...C_COMMENTS, keywords: words(C_KEYWORDS), literals: words('true false NULL nullptr'),
  types: words('size_t int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t uint64_t float4 half std string vector'),
  extra: [[/#[ \t]*[a-z]+/y, 'meta']],
});
define(['go', 'golang'], {
  ...C_COMMENTS, strings: ['`', '"', "'"], keywords: words(GO_KEYWORDS), literals: words('true false nil iota'),
  types: words('int int8 int16 int32 int64 uint uint8 uint16 uint32 uint64 float32 float64 string bool byte rune error any'),
});
define(['java', 'kotlin', 'kt', 'swift', 'cs', 'csharp', 'scala', 'dart'], {
  ...C_COMMENTS, keywords: words(JAVA_KEYWORDS), literals: words('true false null nil this'), capsAreTypes: true,
  extra: [[/@[\w.]+/y, 'meta']],
});
define(['bash', 'sh', 'shell', 'zsh', 'console', 'shellsession'], {
  strings: ['"', "'"], ident: /[A-Za-z_][\w-]*/y,
  keywords: words('if then else elif fi for in do done case esac while until function return export local set unset '
    + 'source alias sudo echo cd exit'),
  extra: [[/(?<=^|[\s;])#.*/y, 'com'], [/\$\{[^}\n]*\}|\$\(|\$[\w@#?$!*-]/y, 'var']],
});
define(['json', 'jsonc', 'json5'], { ...C_COMMENTS, strings: ['"'], literals: words('true false null'), keyStrings: true });
define(['yaml', 'yml'], {
  lineComment: ['#'], literals: words('true false null yes no on off'), extra: [[/[\w.-]+(?=:(\s|$))/y, 'attr']],
});
define(['toml', 'ini', 'cfg', 'conf'], {
  lineComment: ['#', ';'], strings: ['"""', '"', "'"], literals: words('true false'),
  extra: [[/\[[^\]\n]*\]/y, 'meta'], [/[\w.-]+(?=\s*=)/y, 'attr']],
});
define(['sql', 'postgres', 'sqlite', 'mysql'], {
  lineComment: ['--'], blockComment: [['/*', '*/']], strings: ["'", '"'], caseInsensitive: true,
  keywords: words('select from where and or not insert into values update set delete create table drop alter add '
    + 'index on join left right inner outer full group by order having limit offset as distinct union all case when '
    + 'then else end primary key foreign references default is in like between exists returning with'),
  literals: words('null true false'), types: words('int integer bigint text varchar char boolean real float date timestamp'),
});
define(['css', 'scss', 'less'], {
  blockComment: [['/*', '*/']], lineComment: [], ident: /[A-Za-z_-][\w-]*/y,
  extra: [[/#[\da-fA-F]{3,8}\b/y, 'num'], [/[\w-]+(?=\s*:[^:])/y, 'attr'], [/@[\w-]+/y, 'kw'], [/[.#][\w-]+/y, 'type']],
});
define(['html', 'xml', 'svg', 'vue', 'xhtml'], {
  strings: ['"'], ident: /[^\s<>"=&]+/y,
  extra: [[/<!--[\s\S]*?(?:-->|$)/y, 'com'], [/<\/?[\w:-]+/y, 'kw'], [/\/?>/y, 'kw'], [/[\w:-]+(?==)/y, 'attr'],
    [/&[#\w]+;/y, 'lit']],
});

const NUMBER_RE = /(?:0[xX][\da-fA-F_]+|0[bB][01_]+|0[oO][0-7_]+|(?:\d[\d_]*(?:\.\d[\d_]*)?|\.\d[\d_]*)(?:[eE][+-]?\d+)?)[a-zA-Z\d]*/y;

/** Highlights `code` written in `lang` (a fence info word, any case). */
export function highlight(code, lang) {
  const fragment = document.createDocumentFragment();
  const key = String(lang || '').toLowerCase();
  if (key === 'diff' || key === 'patch') return highlightDiff(code, fragment);
  const spec = LANGS[key];
  if (!spec) {
    fragment.append(document.createTextNode(code));
    return fragment;
  }
  for (const [text, kind] of tokenize(code, spec)) {
    if (!kind) fragment.append(document.createTextNode(text));
    else {
      const span = document.createElement('span');
      span.className = `tok-${kind}`;
      span.textContent = text;
      fragment.append(span);
    }
  }
  return fragment;
}

/** Languages the highlighter knows (fence info words). */
export function knownLanguages() {
  return Object.keys(LANGS).concat(['diff', 'patch']);
}

function highlightDiff(code, fragment) {
  for (const line of code.split(/(?<=\n)/)) {
    const kind = line.startsWith('+') ? 'ins' : line.startsWith('-') ? 'del' : line.startsWith('@@') ? 'meta' : null;
    if (!kind) { fragment.append(document.createTextNode(line)); continue; }
    const span = document.createElement('span');
    span.className = `tok-${kind}`;
    span.textContent = line;
    fragment.append(span);
  }
  return fragment;
}

function matchAt(re, text, i) {
  re.lastIndex = i;
  const m = re.exec(text);
  return m && m.index === i ? m[0] : null;
}

/** Yields [text, kind|null] pieces covering `code` exactly. */
export function* tokenize(code, spec) {
  let plain = '';
  let i = 0;
  const emit = function* (text, kind) {
    if (plain) { yield [plain, null]; plain = ''; }
    yield [text, kind];
  };
  outer: while (i < code.length) {
    for (const [re, kind] of spec.extra) {
      const m = matchAt(re, code, i);
      if (!m) continue;
      if (kind === 'rawstr') {
        const hashes = m.slice(1, -1);
        const close = code.indexOf(`"${hashes}`, i + m.length);
        const end = close < 0 ? code.length : close + 1 + hashes.length;
        yield* emit(code.slice(i, end), 'str');
        i = end;
      } else {
        yield* emit(m, kind);
        i += m.length;
      }
      continue outer;
    }
    for (const prefix of spec.lineComment) {
      if (code.startsWith(prefix, i)) {
        const nl = code.indexOf('\n', i);
        const end = nl < 0 ? code.length : nl;
        yield* emit(code.slice(i, end), 'com');
        i = end;
        continue outer;
      }
    }
    for (const [open, close] of spec.blockComment) {
      if (code.startsWith(open, i)) {
        const at = code.indexOf(close, i + open.length);
        const end = at < 0 ? code.length : at + close.length;
        yield* emit(code.slice(i, end), 'com');
        i = end;
        continue outer;
      }
    }
    for (const delim of spec.strings) {
      if (code.startsWith(delim, i)) {
        const end = stringEnd(code, i, delim);
        const kind = spec.keyStrings && /^\s*:/.test(code.slice(end, end + 8)) ? 'attr' : 'str';
        yield* emit(code.slice(i, end), kind);
        i = end;
        continue outer;
      }
    }
    const prev = code[i - 1];
    const identChar = prev !== undefined && /[\w$]/.test(prev);
    if (!identChar && /[\d.]/.test(code[i])) {
      const m = matchAt(NUMBER_RE, code, i);
      if (m && /\d/.test(m)) { yield* emit(m, 'num'); i += m.length; continue; }
    }
    const ident = identChar ? null : matchAt(spec.ident, code, i);
    if (ident) {
      const kind = classify(ident, code, i + ident.length, spec);
      if (kind) yield* emit(ident, kind);
      else plain += ident;
      i += ident.length;
      continue;
    }
    plain += code[i];
    i += 1;
  }
  if (plain) yield [plain, null];
}

function classify(word, code, after, spec) {
  const key = spec.caseInsensitive ? word.toLowerCase() : word;
  if (spec.keywords.has(key)) return 'kw';
  if (spec.literals.has(key)) return 'lit';
  if (spec.types.has(key)) return 'type';
  if (/^\s*\(/.test(code.slice(after, after + 4))) return 'fn';
  if (spec.capsAreTypes && /^[A-Z][a-z\d]/.test(word)) return 'type';
  return null;
}

// Index just past the string that opens at `start` with `delim`; single-character quotes stop at a
// newline (an unterminated string must not colour the rest of the block).
function stringEnd(code, start, delim) {
  const multiline = delim.length === 3 || delim === '`';
  let k = start + delim.length;
  while (k < code.length) {
    if (code[k] === '\\') { k += 2; continue; }
    if (code.startsWith(delim, k)) return k + delim.length;
    if (code[k] === '\n' && !multiline) return k;
    k += 1;
  }
  return code.length;
}
