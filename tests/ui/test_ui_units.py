"""Unit oracles for the Web UI's pure modules (SSE parser, Markdown renderer, highlighter, session
fit), run inside Chromium on the page the server serves, so they test the very files it embeds."""

from __future__ import annotations

import pytest

try:
    from playwright.sync_api import Page
except ImportError:  # the conftest skips every test here
    pass

IMPORT = "async (name) => import(new URL(`js/${name}`, location.href).href)"


def run(page: Page, module: str, body: str, arg: object = None) -> object:
    """Evaluates `body` (a JS function body with `m` = the module and `arg`) in the page."""
    return page.evaluate(
        f"async ([name, arg]) => {{ const m = await import(new URL(`js/${{name}}`, location.href).href); {body} }}",
        [module, arg])


def test_sse_parser_handles_any_split(ui_page: Page) -> None:
    """Events come out whole whatever the chunking: split inside "\\r\\n", inside a UTF-8
    character, between data lines; comments are skipped; multi-line data is joined with \\n."""
    stream = 'data: {"a":"é€"}\r\n\r\n: keep-alive\n\ndata: x\ndata: y\n\nevent: z\ndata: [DONE]\n\n'
    results = run(ui_page, "sse.js", """
      const bytes = new TextEncoder().encode(arg);
      const out = [];
      for (let size = 1; size <= bytes.length; size += 1) {
        const parser = new m.SseParser();
        const events = [];
        for (let k = 0; k < bytes.length; k += size) events.push(...parser.push(bytes.slice(k, k + size)));
        events.push(...parser.end());
        out.push(JSON.stringify(events));
      }
      return [...new Set(out)];
    """, stream)
    assert results == ['["{\\"a\\":\\"é€\\"}","x\\ny","[DONE]"]']


def test_sse_parser_flushes_an_unterminated_last_event(ui_page: Page) -> None:
    assert run(ui_page, "sse.js", "const p = new m.SseParser(); return [p.push('data: 1\\n\\ndata: 2'), p.end()];") \
        == [["1"], ["2"]]


MARKDOWN_CASES = [
    ("**b** *i* `c` ~~d~~ __u__", "<p><strong>b</strong> <em>i</em> <code>c</code> <del>d</del> <strong>u</strong></p>"),
    ("snake_case_name and 2*3*4", "<p>snake_case_name and 2<em>3</em>4</p>"),
    ("***both***", "<p><strong><em>both</em></strong></p>"),
    ("*a **b** c*", "<p><em>a <strong>b</strong> c</em></p>"),
    ("# Title\ntext\nmore", "<h1>Title</h1><p>text<br>more</p>"),
    ("- a\n  - b\n- c", '<ul class="tight"><li><p>a</p><ul class="tight"><li><p>b</p></li></ul></li><li><p>c</p></li></ul>'),
    ("3. x\n4. y", '<ol start="3" class="tight"><li><p>x</p></li><li><p>y</p></li></ol>'),
    ("- [x] done\n- [ ] todo", '<ul class="tight"><li class="task"><input type="checkbox" disabled="" checked="" '
     'aria-label="done"><p>done</p></li><li class="task"><input type="checkbox" disabled="" aria-label="not done">'
     "<p>todo</p></li></ul>"),
    ("> quoted\n> more", "<blockquote><p>quoted<br>more</p></blockquote>"),
    ("a\n\n---\n\nb", "<p>a</p><hr><p>b</p>"),
    ("<script>alert(1)</script>", "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>"),
    ("[x](javascript:alert(1)) [y](https://a.b/c?d=1&e=2)",
     '<p><span class="unsafe-link" title="link removed">x</span> '
     '<a href="https://a.b/c?d=1&amp;e=2" target="_blank" rel="noopener noreferrer nofollow">y</a></p>'),
    ("![alt](https://img.example/x.png)",
     '<p><a href="https://img.example/x.png" target="_blank" rel="noopener noreferrer nofollow">🖼 alt</a></p>'),
    ("see https://example.com/a_b. ok", '<p>see <a href="https://example.com/a_b" target="_blank" '
     'rel="noopener noreferrer nofollow">https://example.com/a_b</a>. ok</p>'),
    ("\\*not em\\* and `` a`b ``", "<p>*not em* and <code>a`b</code></p>"),
    ("| a | b |\n|:--|--:|\n| `x|y` | 2 |",
     '<div class="table-wrap" tabindex="0" role="region" aria-label="Table"><table><thead><tr>'
     '<th style="text-align:left">a</th><th style="text-align:right">b</th></tr></thead><tbody><tr>'
     '<td style="text-align:left"><code>x|y</code></td><td style="text-align:right">2</td></tr></tbody></table></div>'),
]


@pytest.mark.parametrize(("source", "html"), MARKDOWN_CASES, ids=[c[0][:24] for c in MARKDOWN_CASES])
def test_markdown_renders(ui_page: Page, source: str, html: str) -> None:
    got = run(ui_page, "markdown.js", "const d = document.createElement('div'); d.append(m.renderMarkdown(arg)); "
              "return d.innerHTML;", source)
    assert got == html


def test_markdown_code_fence_closed_and_streaming(ui_page: Page) -> None:
    """A fence renders as code even before its closing line arrives (mid-stream)."""
    for source in ("```rust\nfn main() {}\n```", "```rust\nfn main() {}"):
        got = run(ui_page, "markdown.js", """
          const d = document.createElement('div'); d.append(m.renderMarkdown(arg));
          return [d.querySelector('.code-lang').textContent, d.querySelector('pre').textContent,
                  d.querySelector('.tok-kw').textContent, d.querySelectorAll('p').length];
        """, source)
        assert got == ["rust", "fn main() {}", "fn", 0]


CODE_SAMPLES = {
    "python": 'def f(x: int) -> str:\n    """doc"""\n    return f"{x}"  # c\n@dec\nclass A: pass\n',
    "js": "const a = `t ${b}`; // c\n/* d */ function g() { return 0x1F + 1.5e3; }\n",
    "rust": "#[derive(Debug)]\nfn f<'a>(s: &'a str) -> Option<char> { println!(\"{}\", s); s.chars().next() }\n",
    "bash": "#!/bin/sh\necho \"$HOME\" ${X:-1} # c\nfor i in 1 2; do ls; done\n",
    "json": '{"k": [1, 2.5, true, null], "s": "a\\"b"}',
    "c": "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); /* x */ }\n",
    "sql": "SELECT a, 'x' FROM t WHERE b = 1 -- c\n",
    "html": '<!-- c --><a href="x">t &amp; u</a>',
    "css": ".a #b { color: #fff; margin: 0 1px; } @media x {}",
    "yaml": "key: value # c\nlist:\n  - 1\n",
    "diff": "@@ -1 +1 @@\n-old\n+new\n",
    "unknown-lang": "<b>as is</b>",
    "go": "func main() { x := []int{1}; fmt.Println(x) }",
    "toml": '[a]\nb = "c" # d\n',
}


def test_highlighter_keeps_every_character(ui_page: Page) -> None:
    """Highlighting only wraps text: for every language, the text out equals the text in, and
    the known languages produce at least one coloured token."""
    got = run(ui_page, "highlight.js", """
      const out = {};
      for (const [lang, code] of Object.entries(arg)) {
        const d = document.createElement('div'); d.append(m.highlight(code, lang));
        out[lang] = [d.textContent === code, d.querySelectorAll('span[class^="tok-"]').length];
      }
      return out;
    """, CODE_SAMPLES)
    for lang, (same, tokens) in got.items():
        assert same, f"{lang}: highlighted text differs from the source"
        assert (tokens > 0) == (lang != "unknown-lang"), f"{lang}: {tokens} tokens"


def test_highlighter_classifies(ui_page: Page) -> None:
    got = run(ui_page, "highlight.js", """
      const d = document.createElement('div'); d.append(m.highlight(arg, 'python'));
      return [...d.querySelectorAll('span')].map((s) => [s.className, s.textContent]);
    """, 'def f(): return "s"  # c')
    assert got == [["tok-kw", "def"], ["tok-fn", "f"], ["tok-kw", "return"], ["tok-str", '"s"'], ["tok-com", "# c"]]


def test_session_fit_mirrors_the_server_merge_rule(ui_page: Page) -> None:
    """A turn that extends the stored conversation keeps the session; an edit, a regenerate, a
    changed system prompt or another model does not."""
    got = run(ui_page, "chat.js", """
      const u = (c) => ({role: 'user', content: c}), a = (c) => ({role: 'assistant', content: c});
      const record = {id: 's1', model: null, count: 0, hash: null};
      const first = {model: 'm', messages: [u('q1')]};
      const out = [m.sessionFits(record, first)];
      m.rememberTurn(record, first, {content: 'r1', finishReason: 'stop'});
      out.push(m.sessionFits(record, {model: 'm', messages: [u('q1'), a('r1'), u('q2')]}));   // next turn
      out.push(m.sessionFits(record, {model: 'm', messages: [u('q1')]}));                      // regenerate
      out.push(m.sessionFits(record, {model: 'm', messages: [u('edited')]}));                  // edit
      out.push(m.sessionFits(record, {model: 'm', messages: [{role: 'system', content: 's'}, u('q1'), a('r1'), u('q2')]}));
      out.push(m.sessionFits(record, {model: 'other', messages: [u('q1'), a('r1'), u('q2')]}));
      const before = JSON.stringify(record);
      m.rememberTurn(record, first, {content: 'partial', stopped: true});                      // not stored
      m.rememberTurn(record, first, {content: '', error: {message: 'x'}});
      out.push(JSON.stringify(record) === before);
      return out;
    """)
    assert got == [True, True, False, False, False, False, True]


def test_each_branch_keeps_its_own_session(ui_page: Page) -> None:
    """pickSession: a turn continuing branch A gets A's session back after branch B was used; a
    turn that fits no stored session gets a fresh one; an unused fresh one is reused."""
    got = run(ui_page, "chat.js", """
      const u = (c) => ({role: 'user', content: c}), a = (c) => ({role: 'assistant', content: c});
      let n = 0; const make = () => `s${++n}`;
      const conv = {sessions: []};
      const A = {model: 'm', messages: [u('qA')]};
      const sa = m.pickSession(conv, A, make); m.rememberTurn(sa, A, {content: 'rA', finishReason: 'stop'});
      const B = {model: 'm', messages: [u('qB')]};
      const sb = m.pickSession(conv, B, make); m.rememberTurn(sb, B, {content: 'rB', finishReason: 'stop'});
      const again = m.pickSession(conv, {model: 'm', messages: [u('qA'), a('rA'), u('more')]}, make);
      const other = m.pickSession(conv, {model: 'm', messages: [u('qC')]}, make);
      const reused = m.pickSession(conv, {model: 'm', messages: [u('qD')]}, make);
      return [sa.id, sb.id, again.id, other.id, reused.id];
    """)
    assert got == ["s1", "s2", "s1", "s3", "s3"]


def test_telemetry_rates_and_counts(ui_page: Page) -> None:
    """Decode rate after the first token when the reply is spread out; the whole request's rate
    when it came in a burst; counts from the usage chunk, else estimated from pieces (≈)."""
    spread, burst, stopped = run(ui_page, "chat.js", """
      const usage = {prompt_tokens: 100, completion_tokens: 11, prompt_tokens_details: {cached_tokens: 64}};
      return [
        m.telemetry({start: 0, first: 200, last: 1200, end: 1250, pieces: 9}, usage, 'stop'),
        m.telemetry({start: 0, first: 200, last: 201, end: 250, pieces: 9}, usage, 'length'),
        m.telemetry({start: 0, first: 100, last: 600, end: 700, pieces: 6}, null, null),
      ];
    """)
    assert spread == {"ttftMs": 200, "tokensPerSec": 10, "rateOver": "decode", "completionTokens": 11,
                      "promptTokens": 100, "cachedTokens": 64, "totalMs": 1250, "approx": False,
                      "finishReason": "stop", "speculative": None}
    assert (burst["tokensPerSec"], burst["rateOver"], burst["finishReason"]) == (44, "request", "length")
    assert (stopped["completionTokens"], stopped["approx"], stopped["tokensPerSec"], stopped["cachedTokens"]) \
        == (6, True, 10, None)


SERIALIZE = """
  const ser = (n) => n.nodeType === 3 ? JSON.stringify(n.data)
    : n.localName + (n.getAttribute('mathvariant') ? `[${n.getAttribute('mathvariant')}]` : '')
      + (n.childNodes.length ? `(${[...n.childNodes].map(ser).join(',')})` : '');
"""

TEX_CASES = [
    ("x^2", False, 'msup(mi("x"),mn("2"))'),
    ("a_i^{n+1}", False, 'msubsup(mi("a"),mi("i"),mrow(mi("n"),mo("+"),mn("1")))'),
    ("\\frac{a}{b}", False, 'mfrac(mi("a"),mi("b"))'),
    ("\\frac12", False, 'mfrac(mn("1"),mn("2"))'),
    ("\\sqrt[3]{x}", False, 'mroot(mi("x"),mn("3"))'),
    ("\\sqrt{2}", False, 'msqrt(mn("2"))'),
    ("\\alpha \\le \\Omega", False, 'mi("α"),mo("≤"),mi[normal]("Ω")'),
    ("\\sum_{i=1}^n i", True, 'munderover(mo("∑"),mrow(mi("i"),mo("="),mn("1")),mi("n")),mi("i")'),
    ("\\sum_{i=1}^n i", False, 'msubsup(mo("∑"),mrow(mi("i"),mo("="),mn("1")),mi("n")),mi("i")'),
    ("\\int_0^1 f", True, 'msubsup(mo("∫"),mn("0"),mn("1")),mi("f")'),
    ("\\lim_{x \\to 0}", True, 'munder(mi("lim"),mrow(mi("x"),mo("→"),mn("0")))'),
    ("\\sin x", False, 'mi("sin"),mi("x")'),
    ("\\mathbb{R}^n", False, 'msup(mi[normal]("ℝ"),mi("n"))'),
    ("\\mathcal{L}", False, 'mi[normal]("ℒ")'),
    ("\\text{if } x>0", False, 'mtext("if "),mi("x"),mo(">"),mn("0")'),
    ("\\hat{x}", False, 'mover(mi("x"),mo("^"))'),
    ("\\left( x \\right]", False, 'mrow(mo("("),mi("x"),mo("]"))'),
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", False,
     'mrow(mo("("),mtable(mtr(mtd(mn("1")),mtd(mn("2"))),mtr(mtd(mn("3")),mtd(mn("4")))),mo(")"))'),
    ("f(x) = \\begin{cases} 1 & x > 0 \\\\ 0 & \\text{else} \\end{cases}", False,
     'mi("f"),mo("("),mi("x"),mo(")"),mo("="),mrow(mo("{"),mtable(mtr(mtd(mn("1")),mtd(mrow(mi("x"),mo(">"),mn("0")))),'
     'mtr(mtd(mn("0")),mtd(mtext("else")))))'),
    ("\\binom{n}{k}", False, 'mrow(mo("("),mfrac(mi("n"),mi("k")),mo(")"))'),
    ("a - b * c'", False, 'mi("a"),mo("−"),mi("b"),mo("∗"),msup(mi("c"),mo("′"))'),
    ("\\unknowncmd", False, 'mtext("\\\\unknowncmd")'),
    ("<script>", False, 'mo("<"),mi("s"),mi("c"),mi("r"),mi("i"),mi("p"),mi("t"),mo(">")'),
]


@pytest.mark.parametrize(("tex", "display", "tree"), TEX_CASES, ids=[c[0][:24] for c in TEX_CASES])
def test_tex_to_mathml(ui_page: Page, tex: str, display: bool, tree: str) -> None:
    got = run(ui_page, "math.js", SERIALIZE + """
      const math = m.renderTex(arg[0], {display: arg[1]});
      if (math.getAttribute('display') !== (arg[1] ? 'block' : 'inline')) return 'bad display';
      if (math.querySelector('annotation').textContent !== arg[0]) return 'bad annotation';
      return [...math.querySelector('semantics > mrow').childNodes].map(ser).join(',');
    """, [tex, display])
    assert got == tree


def test_tex_errors_are_typed(ui_page: Page) -> None:
    """Source that cannot be parsed throws TexError (the caller then shows the source)."""
    got = run(ui_page, "math.js", """
      return arg.map((src) => { try { m.renderTex(src); return 'ok'; } catch (e) { return e instanceof m.TexError ? 'TexError' : String(e); } });
    """, ["\\frac{a", "x}", "\\left( x", "\\begin{matrix} a", "a^b^c", "\\begin{nope}x\\end{nope}", "\\"])
    assert got == ["TexError"] * 7


MATH_MARKDOWN = [
    ("costs $5 and $10.", "costs $5 and $10.", 0),
    ("inline $x^2$ here", "inline  here", 1),
    ("\\(a+b\\) and \\[c\\]", " and ", 2),
    ("$$\n\\frac{1}{2}\n$$", "", 1),
    ("\\$x\\$ escaped", "$x$ escaped", 0),
    ("`$x$` in code", "$x$ in code", 0),
]


@pytest.mark.parametrize(("source", "text", "formulas"), MATH_MARKDOWN, ids=[c[0][:20] for c in MATH_MARKDOWN])
def test_markdown_math_delimiters(ui_page: Page, source: str, text: str, formulas: int) -> None:
    """Which dollars make math (pandoc's rule for $…$) and which stay text; text outside formulas is kept."""
    got = run(ui_page, "markdown.js", """
      const d = document.createElement('div'); d.append(m.renderMarkdown(arg));
      const n = d.querySelectorAll('math').length;
      d.querySelectorAll('math').forEach((x) => x.remove());
      return [d.textContent, n];
    """, source)
    assert got == [text, formulas]


def test_math_block_streaming_shows_source_until_closed(ui_page: Page) -> None:
    got = run(ui_page, "markdown.js", """
      const d = document.createElement('div'); d.append(m.renderMarkdown('$$\\n\\\\frac{1}{'));
      return [d.querySelectorAll('math').length, d.querySelector('.math-pending')?.textContent];
    """)
    assert got == [0, "\\frac{1}{"]


TREE_SCRIPT = """
  const msg = (id, role) => ({id, role, content: id});
  const conv = {messages: [], active: {}};
  const ids = () => m.pathOf(conv).map((x) => x.id);
  const out = {};
  const q1 = m.addChild(conv, null, msg('q1', 'user'));
  const r1 = m.addChild(conv, 'q1', msg('r1', 'assistant'));
  const q2 = m.addChild(conv, 'r1', msg('q2', 'user'));
  m.addChild(conv, 'q2', msg('r2', 'assistant'));
  out.linear = ids();
  const e1 = m.addSibling(conv, q1, msg('e1', 'user'));              // edit q1
  m.addChild(conv, 'e1', msg('s1', 'assistant'));
  out.edited = ids();
  m.select(conv, q1);                                                  // back to version 1
  out.back = ids();
  out.siblings = m.siblingsOf(conv, q1).map((x) => x.id);
  m.addSibling(conv, r1, msg('r1b', 'assistant'));                     // regenerate r1
  out.regenerated = ids();
  m.select(conv, r1);
  out.oldReply = ids();                                                // r1's own branch comes back
  m.removeMessage(conv, r1);                                           // delete one message
  out.deleted = ids();
  m.select(conv, e1);
  m.removeSubtree(conv, e1);
  out.subtree = [ids(), conv.messages.map((x) => x.id)];
  const flat = {messages: [msg('a', 'user'), msg('b', 'assistant'), msg('c', 'user')]};
  m.migrate(flat);
  out.migrated = [m.pathOf(flat).map((x) => x.id), flat.messages.map((x) => x.parentId)];
  return out;
"""


def test_conversation_tree(ui_page: Page) -> None:
    """Versions sit beside each other; the path follows the chosen version and, below it, the
    branch last shown there; deleting one message keeps its children; old flat lists migrate."""
    got = run(ui_page, "tree.js", TREE_SCRIPT)
    assert got["linear"] == ["q1", "r1", "q2", "r2"]
    assert got["edited"] == ["e1", "s1"]
    assert got["back"] == ["q1", "r1", "q2", "r2"]
    assert got["siblings"] == ["q1", "e1"]
    assert got["regenerated"] == ["q1", "r1b"]
    assert got["oldReply"] == ["q1", "r1", "q2", "r2"]
    assert got["deleted"] == ["q1", "q2", "r2"]
    assert got["subtree"] == [["q1", "q2", "r2"], ["q1", "q2", "r2", "r1b"]]
    assert got["migrated"] == [["a", "b", "c"], [None, "a", "b"]]


def test_tool_call_fragments_merge(ui_page: Page) -> None:
    """delta.tool_calls fragments fold into whole calls by index (OpenAI's streaming shape)."""
    got = run(ui_page, "chat.js", """
      let calls = [];
      for (const f of arg) calls = m.mergeToolCallDeltas(calls, f);
      return calls;
    """, [[{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}],
          [{"index": 0, "function": {"arguments": '{"a":'}}, {"index": 1, "id": "c2", "function": {"name": "g"}}],
          [{"index": 0, "function": {"arguments": "1}"}}, {"index": 1, "function": {"arguments": "{}"}}]])
    assert got == [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
                   {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
