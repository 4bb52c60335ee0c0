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
