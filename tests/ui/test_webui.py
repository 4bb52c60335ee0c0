"""The built-in Web UI, driven in headless Chromium against a real novainfer-server (tiny model).

Each test names the behaviour from issue 5 it shows. Where the tiny random model cannot produce
what a test needs (a reply containing `<script>`, DeepSeek-R1 reasoning, a Markdown code block, a
429, a dropped connection), that test alone stubs `/v1/chat/completions` with Playwright's
`page.route` and says so in its docstring; everything else talks to the real server.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from harness import MODEL_NAME, Server, new_context

try:
    from playwright.sync_api import Page, Request, Route, expect
except ImportError:  # the conftest skips every test here
    pass

RUNNING = "novainfer:num_requests_running"
ABORTED = "novainfer:request_success_total"


# ------------------------------------------------------------------ helpers


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def assistant(page: Page, index: int = -1):  # noqa: ANN201 - a Locator
    replies = page.locator("article.msg-assistant")
    return replies.nth(index) if index >= 0 else replies.last


def wait_idle(page: Page, timeout: float = 60_000) -> None:
    """Waits until no reply of the open conversation is streaming."""
    expect(page.locator("#send-btn")).to_be_visible(timeout=timeout)
    expect(page.locator("article.msg-assistant.streaming")).to_have_count(0, timeout=timeout)


def chat_bodies(page: Page) -> list[dict]:
    """Records the JSON body of every chat-completions request the page sends from now on."""
    bodies: list[dict] = []

    def on_request(request: Request) -> None:
        if request.url.endswith("/v1/chat/completions") and request.method == "POST":
            bodies.append(json.loads(request.post_data or "{}"))

    page.on("request", on_request)
    return bodies


def prompt_tokens(reply) -> tuple[int, int]:  # noqa: ANN001 - a Locator
    """(cached, prompt) tokens from a reply's telemetry."""
    cached, prompt = reply.locator(".tele-cache").inner_text().split()[0].split("/")
    return int(cached), int(prompt)


def open_settings(page: Page) -> None:
    page.get_by_role("button", name="Conversation settings").click()
    expect(page.locator("#settings-dialog")).to_be_visible()


def save_settings(page: Page, **fields: str) -> None:
    """Opens the settings dialog, fills the given fields (by input id) and saves."""
    open_settings(page)
    for field_id, value in fields.items():
        page.fill(f"#{field_id}", value)
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#settings-dialog")).to_be_hidden()


def wait_aborted(server: Server, count: float) -> float:
    """The server's count of aborted requests once it reaches `count` (or after 5 s)."""
    deadline = time.monotonic() + 5
    while server.metric(ABORTED, finished_reason="abort") < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.metric(ABORTED, finished_reason="abort")


def sse(*chunks: dict) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def chunk(delta: dict, finish: str | None = None, rid: str = "chatcmpl-stub") -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": 0, "model": MODEL_NAME,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def stub_chat(page: Page, body: str, status: int = 200, headers: dict | None = None) -> None:
    def handle(route: Route) -> None:
        route.fulfill(status=status, body=body, headers={
            "Content-Type": "text/event-stream" if status == 200 else "application/json", **(headers or {})})

    page.route("**/v1/chat/completions", handle)


# ------------------------------------------------------------------ chat


def test_enter_sends_and_reply_streams_with_telemetry(slow_page: Page, slow_server: Server, shot) -> None:
    """Enter sends, Shift+Enter makes a newline; the reply streams in over SSE piece by piece;
    the reply shows tokens/s, TTFT and cached prompt tokens; a follow-up turn reuses the KV cache
    of the first one through the conversation's session_id. (On the wider model, whose ~180
    tokens/s spread a reply over many frames; the tiny one can deliver it in one.)"""
    page, server = slow_page, slow_server
    bodies = chat_bodies(page)
    page.fill("#prompt", "first line")
    page.press("#prompt", "Shift+Enter")
    page.keyboard.type("second line")
    assert page.input_value("#prompt") == "first line\nsecond line"
    expect(page.locator("article.msg-user")).to_have_count(0)

    # Record how the reply's text grows, to see it arrive in pieces rather than at once.
    page.evaluate("""() => {
      window.__lengths = [];
      new MutationObserver(() => {
        const body = document.querySelector('article.msg-assistant:last-of-type .msg-body');
        if (body) window.__lengths.push(body.textContent.length);
      }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    page.press("#prompt", "Enter")
    expect(page.locator("article.msg-user .msg-body")).to_have_text("first line\nsecond line")
    wait_idle(page)
    assert page.input_value("#prompt") == ""

    reply = assistant(page)
    text = reply.locator(".msg-body").inner_text()
    assert text.strip(), "the reply is empty"
    lengths = [n for n in page.evaluate("window.__lengths") if n > 0]
    assert len(set(lengths)) >= 2, f"the reply appeared at once, not streamed: {lengths}"

    assert len(bodies) == 1
    body = bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == server.model
    assert body["messages"] == [{"role": "user", "content": "first line\nsecond line"}]
    session = body["session_id"]
    assert session

    expect(reply.locator(".tele-speed")).to_contain_text("tok/s")
    expect(reply.locator(".tele-ttft")).to_contain_text("TTFT")
    expect(reply.locator(".tele-cache")).to_contain_text("prompt tokens cached")

    send(page, "and a follow-up question")
    wait_idle(page)
    assert len(bodies) == 2
    assert bodies[1]["session_id"] == session
    assert [m["role"] for m in bodies[1]["messages"]] == ["user", "assistant", "user"]
    assert bodies[1]["messages"][1]["content"], "the first reply was not sent back as history"
    expect(assistant(page).locator(".tele-cache")).to_have_class("tele tele-cache hit")
    cached, prompt = prompt_tokens(assistant(page))
    assert 0 < cached <= prompt
    expect(page.locator("#sr-status")).to_have_text("Reply finished")
    shot(page, "two-turns")


def test_stop_mid_stream_frees_the_request(slow_page: Page, slow_server: Server, shot) -> None:
    """Stop cancels the streaming reply: the partial text stays, marked stopped, and the server's
    running-request gauge drops to 0 right after, the request counted as aborted. (On the wider
    random model: the tiny one finishes a whole reply before a click can land.)"""
    page, server = slow_page, slow_server
    aborted = server.metric(ABORTED, finished_reason="abort")
    # Greedy replies of the random model run to max_tokens: ~2 s here.
    save_settings(page, **{"set-max-tokens": "400", "set-temperature": "0"})
    send(page, "Tell me a very long story.")
    reply = assistant(page)
    expect(reply.locator(".msg-body")).not_to_have_text("", timeout=30_000)
    shot(page, "streaming")
    page.get_by_role("button", name="Stop").click()
    expect(reply.locator(".msg-note")).to_have_text("Stopped.")
    expect(page.locator("#send-btn")).to_be_visible()
    assert server.wait_metric(RUNNING, 0) == 0
    # The server ended the request as aborted (not finished on its own before the click).
    assert wait_aborted(server, aborted + 1) == aborted + 1
    # Stopped means cut short: no usage chunk arrived, so the count is the streamed estimate.
    expect(reply.locator(".tele-tokens")).to_contain_text("≈")
    expect(page.locator("#prompt")).to_be_focused()
    shot(page, "stopped")


def test_escape_in_the_composer_stops(slow_page: Page, slow_server: Server) -> None:
    """Esc in the message box stops the reply, like the Stop button (wider model, as above)."""
    page, server = slow_page, slow_server
    aborted = server.metric(ABORTED, finished_reason="abort")
    save_settings(page, **{"set-max-tokens": "400", "set-temperature": "0"})
    send(page, "Another long story, please.")
    expect(assistant(page).locator(".msg-body")).not_to_have_text("", timeout=30_000)
    page.press("#prompt", "Escape")
    expect(assistant(page).locator(".msg-note")).to_have_text("Stopped.")
    assert server.wait_metric(RUNNING, 0) == 0
    assert wait_aborted(server, aborted + 1) == aborted + 1


def test_server_error_is_inline_with_retry(ui_page: Page, server: Server, shot) -> None:
    """A 400 from the real server (prompt + max_tokens past the model's context: each alone fits, so
    the form lets it through) shows the server's message inline with a Retry button; after fixing
    the setting, Retry produces a reply."""
    page = ui_page
    save_settings(page, **{"set-max-tokens": "500"})
    send(page, "hello")
    error = assistant(page).locator(".msg-error")
    expect(error).to_be_visible()
    expect(error).to_have_attribute("role", "alert")
    expect(error).to_contain_text("400")
    expect(error).to_contain_text("500 max_tokens")
    shot(page, "error-400")
    save_settings(page, **{"set-max-tokens": "16"})
    error.get_by_role("button", name="Retry").click()
    wait_idle(page)
    expect(assistant(page).locator(".msg-error")).to_have_count(0)
    assert assistant(page).locator(".msg-body").inner_text().strip()
    expect(page.locator("article.msg-assistant")).to_have_count(1)


def test_busy_server_429_shows_retry_after(full_page: Page, full_server: Server, shot) -> None:
    """Two conversations stream at once; on a server with room for one request the second gets
    429, shown inline with the server's Retry-After and a Retry that works once the first is done.
    (On a wider-model server started with --max-concurrent-requests 1 --max-queued-requests 0.)"""
    page, server = full_page, full_server
    save_settings(page, **{"set-max-tokens": "400"})
    send(page, "a long first conversation")
    expect(assistant(page).locator(".msg-body")).not_to_have_text("", timeout=30_000)
    page.get_by_role("button", name="New chat").click()
    send(page, "a second conversation at the same time")
    error = assistant(page).locator(".msg-error")
    expect(error).to_contain_text("429:")
    expect(error).to_contain_text(re.compile(r"Try again in \d+ s\."))
    retry = error.get_by_role("button", name="Retry")
    expect(retry).to_be_enabled()
    shot(page, "error-429")
    # Free the slot: stop the first conversation (a no-op if it has just finished by itself).
    page.locator("#conv-list .conv-select", has_text="a long first conversation").click()
    page.evaluate("document.getElementById('stop-btn').click()")
    assert server.wait_metric(RUNNING, 0) == 0
    page.locator("#conv-list .conv-select", has_text="a second conversation").click()
    page.locator(".msg-error").get_by_role("button", name="Retry").click()
    wait_idle(page)
    expect(page.locator(".msg-error")).to_have_count(0)
    assert assistant(page).locator(".msg-body").inner_text().strip()


def test_lost_connection_shows_retry_and_retry_works(ui_page: Page, server: Server) -> None:
    """A connection that drops shows an inline error; Retry (now against the real server) replies.
    The drop is made with page.route(...).abort, the only way to cut one request's connection."""
    page = ui_page
    page.route("**/v1/chat/completions", lambda route: route.abort("connectionreset"))
    send(page, "hello")
    error = assistant(page).locator(".msg-error")
    expect(error).to_contain_text("Could not reach the server")
    page.unroute("**/v1/chat/completions")
    error.get_by_role("button", name="Retry").click()
    wait_idle(page)
    expect(assistant(page).locator(".msg-error")).to_have_count(0)
    assert assistant(page).locator(".msg-body").inner_text().strip()


def test_unreachable_server_is_shown_and_asked_again(ui_context, server: Server) -> None:
    """If /v1/models cannot be reached the page says so, and asks again until the server answers.
    (The outage is made with a route that aborts /v1/models, then removed.)"""
    ui_context.route("**/v1/models", lambda route: route.abort("connectionrefused"))
    page = ui_context.new_page()
    page.goto(server.url + "/")
    expect(page.locator("#server-status")).to_have_text("Server unreachable")
    expect(page.locator(".empty-hint")).to_contain_text("Could not reach the server")
    ui_context.unroute("**/v1/models")
    expect(page.locator("#server-status")).to_have_text(re.compile(r"^\d+ models? served$"), timeout=10_000)
    expect(page.locator("#model-badge")).to_have_text(server.model)
    expect(page.locator(".empty-hint")).to_have_count(0)


# ------------------------------------------------------------------ conversations


def sidebar_titles(page: Page) -> list[str]:
    return page.locator("#conv-list .conv-title").all_inner_texts()


def test_create_switch_rename_delete_conversations(ui_page: Page, server: Server, shot) -> None:
    """The sidebar creates, switches, renames and deletes conversations; each has its own
    session_id; names and deletions survive a reload."""
    page = ui_page
    bodies = chat_bodies(page)
    send(page, "alpha question")
    wait_idle(page)
    page.get_by_role("button", name="New chat").click()
    expect(page.locator("#prompt")).to_be_focused()
    expect(page.locator("article.msg")).to_have_count(0)
    send(page, "beta question")
    wait_idle(page)
    assert sidebar_titles(page) == ["beta question", "alpha question"]
    assert bodies[0]["session_id"] != bodies[1]["session_id"]

    # Switch back: alpha's history is shown, and its next turn uses alpha's session.
    page.locator("#conv-list .conv-select", has_text="alpha question").click()
    expect(page.locator("article.msg-user .msg-body")).to_have_text(["alpha question"])
    expect(page.locator("#conv-title")).to_have_text("alpha question")
    send(page, "alpha again")
    wait_idle(page)
    assert bodies[2]["session_id"] == bodies[0]["session_id"]
    assert sidebar_titles(page) == ["alpha question", "beta question"]  # most recent first

    # Rename with the keyboard; Escape cancels, Enter saves.
    page.get_by_role("button", name="Rename “beta question”").click()
    rename = page.get_by_role("textbox", name="Conversation name")
    expect(rename).to_be_focused()
    rename.fill("never saved")
    rename.press("Escape")
    assert sidebar_titles(page) == ["alpha question", "beta question"]
    page.get_by_role("button", name="Rename “beta question”").click()
    page.get_by_role("textbox", name="Conversation name").fill("Beta renamed")
    page.get_by_role("textbox", name="Conversation name").press("Enter")
    assert sidebar_titles(page) == ["alpha question", "Beta renamed"]
    shot(page, "renamed")

    # Delete asks inline; Cancel keeps it, Delete removes it.
    page.get_by_role("button", name="Delete “alpha question”").click()
    page.get_by_role("group", name="Delete “alpha question”?").get_by_role("button", name="Cancel").click()
    assert sidebar_titles(page) == ["alpha question", "Beta renamed"]
    page.get_by_role("button", name="Delete “alpha question”").click()
    shot(page, "confirm-delete")
    page.get_by_role("group", name="Delete “alpha question”?").get_by_role("button", name="Delete").click()
    assert sidebar_titles(page) == ["Beta renamed"]
    expect(page.locator("#conv-title")).to_have_text("Beta renamed")
    expect(page.locator("article.msg-user .msg-body")).to_have_text(["beta question"])

    page.reload()
    page.wait_for_selector("#conv-list .conv-title")
    assert sidebar_titles(page) == ["Beta renamed"]
    expect(page.locator("article.msg-user .msg-body")).to_have_text(["beta question"])


def test_reload_restores_history(ui_page: Page, server: Server, shot) -> None:
    """History (texts, telemetry, the open conversation, its session) is restored on reload."""
    page = ui_page
    bodies = chat_bodies(page)
    send(page, "first question")
    wait_idle(page)
    send(page, "second question")
    wait_idle(page)
    before = page.locator("article.msg .msg-body").all_inner_texts()
    telemetry = assistant(page).locator(".telemetry").inner_text()
    page.reload()
    page.wait_for_selector("article.msg")
    assert page.locator("article.msg .msg-body").all_inner_texts() == before
    assert assistant(page).locator(".telemetry").inner_text() == telemetry
    send(page, "third question")
    wait_idle(page)
    assert bodies[-1]["session_id"] == bodies[0]["session_id"]
    assert len(bodies[-1]["messages"]) == 5
    shot(page, "restored")


# ------------------------------------------------------------------ edit, regenerate, copy


def test_edit_earlier_message_and_regenerate(ui_page: Page, server: Server, shot) -> None:
    """Editing an earlier user message drops the turns after it and regenerates from there."""
    page = ui_page
    bodies = chat_bodies(page)
    send(page, "original question")
    wait_idle(page)
    send(page, "later question")
    wait_idle(page)
    expect(page.locator("article.msg")).to_have_count(4)
    _, prompt_before = prompt_tokens(assistant(page))

    first = page.locator("article.msg-user").first
    first.hover()
    first.get_by_role("button", name="Edit message").click()
    area = page.get_by_role("textbox", name="Edit your message")
    expect(area).to_be_focused()
    expect(area).to_have_value("original question")
    area.fill("edited question")
    shot(page, "editing")
    page.get_by_role("button", name="Save & regenerate").click()
    wait_idle(page)
    expect(page.locator("article.msg")).to_have_count(2)
    expect(page.locator("article.msg-user .msg-body")).to_have_text(["edited question"])
    assert bodies[-1]["messages"] == [{"role": "user", "content": "edited question"}]
    assert assistant(page).locator(".msg-body").inner_text().strip()
    # The model saw only the edited turn: the server did not merge it into the old session.
    assert bodies[-1]["session_id"] != bodies[0]["session_id"]
    _, prompt_after = prompt_tokens(assistant(page))
    assert prompt_after < prompt_before

    # Escape leaves an edit without changing anything.
    page.locator("article.msg-user").first.get_by_role("button", name="Edit message").click()
    page.get_by_role("textbox", name="Edit your message").fill("discarded")
    page.get_by_role("textbox", name="Edit your message").press("Escape")
    expect(page.locator("article.msg-user .msg-body")).to_have_text(["edited question"])
    assert len(bodies) == 3


def test_regenerate_last_answer_and_copy(ui_page: Page, ui_context, server: Server) -> None:
    """Regenerate re-asks the last turn (same messages) and shows the new reply as a second version
    beside the first (‹ 2/2 ›); Copy puts a message's text on the clipboard."""
    page = ui_page
    ui_context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    bodies = chat_bodies(page)
    send(page, "question to regenerate")
    wait_idle(page)
    first_id = assistant(page).get_attribute("data-id")
    _, prompt_first = prompt_tokens(assistant(page))
    page.get_by_role("button", name="Regenerate reply").click()
    wait_idle(page)
    expect(page.locator("article.msg-assistant")).to_have_count(1)
    assert assistant(page).get_attribute("data-id") != first_id
    expect(assistant(page).locator(".version-count")).to_have_text("2/2")
    assert len(bodies) == 2 and bodies[1]["messages"] == bodies[0]["messages"]
    # Same prompt again, the old reply not appended by the session, and its KV reused.
    cached, prompt_again = prompt_tokens(assistant(page))
    assert prompt_again == prompt_first
    assert cached > 0
    send(page, "another")
    wait_idle(page)

    # The clipboard gets the reply's own text (its Markdown source), as sent back in the history.
    page.locator("article.msg-assistant").first.get_by_role("button", name="Copy reply").click()
    expect(page.locator("#sr-status")).to_have_text("Copied to clipboard")
    assert page.evaluate("navigator.clipboard.readText()") == bodies[-1]["messages"][1]["content"]
    page.locator("article.msg-user").first.hover()
    page.locator("article.msg-user").first.get_by_role("button", name="Copy message").click()
    assert page.evaluate("navigator.clipboard.readText()") == "question to regenerate"


# ------------------------------------------------------------------ rendering


INJECTION = (
    "Here is <script>window.__pwned = 'script'</script> and "
    "<img src=x onerror=\"window.__pwned = 'img'\"> and "
    "[click](javascript:window.__pwned='link') and <b>bold?</b>\n\n"
    "```html\n<script>alert(1)</script>\n```\n"
)


def test_script_in_a_reply_is_shown_as_text(ui_page: Page, shot) -> None:
    """Model text containing <script>, an onerror image, a javascript: link and raw HTML is shown
    literally and runs nothing. Stubbed with page.route: the tiny model cannot be made to say it."""
    page = ui_page
    pieces = [INJECTION[i:i + 7] for i in range(0, len(INJECTION), 7)]  # split mid-tag on purpose
    stub_chat(page, sse(chunk({"role": "assistant", "content": ""}), *(chunk({"content": p}) for p in pieces),
                        chunk({}, "stop")))
    send(page, "say something nasty")
    wait_idle(page)
    body = assistant(page).locator(".msg-body")
    expect(body).to_contain_text("Here is <script>window.__pwned = 'script'</script> and")
    expect(body).to_contain_text("<img src=x onerror=\"window.__pwned = 'img'\">")
    expect(body).to_contain_text("<b>bold?</b>")
    assert body.locator("script, img, b, iframe").count() == 0
    # The code block's <script> is code, shown as text too.
    expect(body.locator("pre code")).to_have_text("<script>alert(1)</script>")
    # The javascript: link keeps its text but loses its target.
    expect(body.locator("a")).to_have_count(0)
    expect(body.locator(".unsafe-link")).to_have_text("click")
    page.wait_for_timeout(200)
    assert page.evaluate("window.__pwned") is None
    shot(page, "injection")


def test_markdown_code_highlighting_and_reasoning_block(ui_page: Page, ui_context, server: Server, shot) -> None:
    """Markdown renders (list, table, bold, link); code blocks are highlighted with a Copy button;
    DeepSeek-R1-style reasoning_content streams into a collapsible block that folds once the
    answer starts. Stubbed with page.route: the tiny model emits neither Markdown nor reasoning."""
    page = ui_page
    ui_context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    answer = ("The **answer**:\n\n- one\n- two\n\n| a | b |\n|---|--:|\n| 1 | 2 |\n\n"
              "```python\ndef add(a, b):\n    return a + b  # sum\n```\nSee [docs](https://example.com/x).")
    stub_chat(page, sse(
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "The user wants "}), chunk({"reasoning_content": "an addition function."}),
        chunk({"content": answer[:20]}), chunk({"content": answer[20:]}), chunk({}, "stop"),
        {"id": "chatcmpl-stub", "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 30,
                                                           "prompt_tokens_details": {"cached_tokens": 32}}}))
    send(page, "write add()")
    wait_idle(page)
    reply = assistant(page)
    reasoning = reply.locator("details.reasoning")
    expect(reasoning).to_be_visible()
    expect(reasoning).not_to_have_attribute("open", "")
    expect(reasoning.locator(".reasoning-body")).to_be_hidden()
    reasoning.locator("summary").click()
    expect(reasoning.locator(".reasoning-body")).to_have_text("The user wants an addition function.")
    # Keyboard: the summary toggles with Enter.
    reasoning.locator("summary").press("Enter")
    expect(reasoning.locator(".reasoning-body")).to_be_hidden()

    body = reply.locator(".msg-body")
    expect(body.locator("strong")).to_have_text("answer")
    expect(body.locator("ul > li")).to_have_text(["one", "two"])
    expect(body.locator("table td")).to_have_text(["1", "2"])
    expect(body.locator("a")).to_have_attribute("href", "https://example.com/x")
    expect(body.locator("a")).to_have_attribute("rel", "noopener noreferrer nofollow")
    code = body.locator(".code-block")
    expect(code.locator(".code-lang")).to_have_text("python")
    expect(code.locator(".tok-kw").first).to_have_text("def")
    expect(code.locator(".tok-com")).to_have_text("# sum")
    expect(code.locator("pre")).to_have_text("def add(a, b):\n    return a + b  # sum")
    code.get_by_role("button", name="Copy python code").click()
    expect(code.get_by_role("button", name="Copy python code")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == "def add(a, b):\n    return a + b  # sum"
    expect(reply.locator(".tele-cache")).to_have_text("32/40 prompt tokens cached (80%)")
    # Reasoning is shown, never sent back: the next turn carries only the answer.
    bodies = chat_bodies(page)
    send(page, "thanks")
    wait_idle(page)
    assert bodies[0]["messages"][1] == {"role": "assistant", "content": answer}
    reply.locator("details.reasoning summary").click()
    shot(page, "markdown-reasoning")


# ------------------------------------------------------------------ settings


def test_settings_are_per_conversation(ui_page: Page, server: Server, shot) -> None:
    """Model (listed from /v1/models), system prompt, temperature, top_p and max tokens are kept
    per conversation and sent with its requests."""
    page = ui_page
    bodies = chat_bodies(page)
    open_settings(page)
    expect(page.locator("#set-model option")).to_contain_text([server.model])
    expect(page.locator("#set-model")).to_have_value(server.model)
    expect(page.get_by_label("System prompt")).to_be_visible()
    page.get_by_label("System prompt").fill("You are terse.")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Top-p").fill("0.9")
    page.get_by_label("Max tokens").fill("5")
    shot(page, "settings")
    page.get_by_role("button", name="Save").click()
    expect(page.get_by_role("button", name="Conversation settings")).to_be_focused()  # focus returns
    send(page, "hi")
    wait_idle(page)
    body = bodies[-1]
    assert body["messages"][0] == {"role": "system", "content": "You are terse."}
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0, 0.9, 5)
    assert body["model"] == server.model
    tele = assistant(page).locator(".telemetry")
    expect(tele.locator(".tele-tokens")).to_have_text("5 tokens")
    expect(tele.locator(".tele-finish")).to_have_text("max tokens reached")

    # Out-of-range values are refused by the form, not sent.
    open_settings(page)
    page.get_by_label("Temperature").fill("5")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#settings-dialog")).to_be_visible()
    page.get_by_role("button", name="Cancel").click()

    # A second conversation changes its own settings without touching the first one's.
    page.get_by_role("button", name="New chat").click()
    save_settings(page, **{"set-system": "You are verbose.", "set-max-tokens": "7", "set-temperature": ""})
    send(page, "hello")
    wait_idle(page)
    assert bodies[-1]["messages"][0]["content"] == "You are verbose."
    assert "temperature" not in bodies[-1] and bodies[-1]["max_tokens"] == 7
    page.locator("#conv-list .conv-select", has_text="hi").click()
    open_settings(page)
    expect(page.get_by_label("System prompt")).to_have_value("You are terse.")
    expect(page.get_by_label("Max tokens")).to_have_value("5")
    page.keyboard.press("Escape")
    send(page, "again")
    wait_idle(page)
    assert bodies[-1]["messages"][0]["content"] == "You are terse." and bodies[-1]["max_tokens"] == 5


# ------------------------------------------------------------------ accessibility and layout


def test_keyboard_and_screen_reader_basics(ui_page: Page, server: Server) -> None:
    """Every control has an accessible name; the message box is labelled and focused on load; the
    streaming reply is an aria-live region that is busy until it ends; statuses are announced."""
    page = ui_page
    expect(page.locator("#prompt")).to_be_focused()
    expect(page.get_by_role("textbox", name="Message")).to_be_visible()
    send(page, "hello")
    wait_idle(page)
    unnamed = page.evaluate("""() => [...document.querySelectorAll('button, a, input, select, textarea')]
      .filter((el) => el.offsetParent !== null)
      .filter((el) => !(el.getAttribute('aria-label') || el.textContent.trim() || el.labels?.length))
      .map((el) => el.outerHTML.slice(0, 120))""")
    assert unnamed == []
    # The live region while streaming: watch attributes as a reply streams.
    page.evaluate("""() => {
      window.__live = [];
      new MutationObserver((records) => {
        for (const r of records) for (const n of r.addedNodes) {
          const body = n.querySelector?.('.msg-body[aria-live]');
          if (body) window.__live.push([body.getAttribute('aria-live'), body.getAttribute('aria-busy')]);
        }
      }).observe(document.getElementById('messages'), {subtree: true, childList: true});
    }""")
    send(page, "again")
    wait_idle(page)
    assert ["polite", "true"] in page.evaluate("window.__live")
    expect(assistant(page).locator(".msg-body")).not_to_have_attribute("aria-busy", "true")
    expect(page.locator("#sr-status")).to_have_text("Reply finished")
    # Tab from the message box reaches the send button (disabled while empty → skipped) and the
    # Shift+Tab path reaches the conversation list: everything is reachable without a mouse.
    page.focus("#conv-list .conv-select")
    page.keyboard.press("Enter")
    expect(page.locator("#prompt")).to_be_focused()


def test_narrow_phone_layout(ui_browser, server: Server, shot) -> None:
    """On a phone-sized window the sidebar is a drawer: hidden until the menu button opens it,
    closed by Escape (focus back on the button), the backdrop or picking a conversation; the chat
    fits the width."""
    ctx = new_context(ui_browser, viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True,
                      device_scale_factor=2)
    page = ctx.new_page()
    try:
        page.goto(server.url + "/")
        sidebar = page.locator("#sidebar")
        menu = page.get_by_role("button", name="Conversations")
        expect(menu).to_be_visible()
        expect(menu).to_have_attribute("aria-expanded", "false")
        assert not sidebar.evaluate("el => { const r = el.getBoundingClientRect(); return r.right > 0; }")
        send(page, "hello from a phone")
        wait_idle(page)
        width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert width[0] <= width[1], f"horizontal overflow: {width}"
        shot(page, "chat")

        menu.click()
        expect(menu).to_have_attribute("aria-expanded", "true")
        page.wait_for_timeout(300)  # the slide-in transition
        assert sidebar.evaluate("el => el.getBoundingClientRect().left") == 0
        expect(page.locator("#conv-list .conv-select").first).to_be_focused()
        assert page.evaluate("document.getElementById('main').inert") is True
        shot(page, "drawer-open")
        page.keyboard.press("Escape")
        expect(menu).to_have_attribute("aria-expanded", "false")
        expect(menu).to_be_focused()

        menu.click()
        page.get_by_role("button", name="New chat").click()
        expect(menu).to_have_attribute("aria-expanded", "false")
        expect(page.locator("#prompt")).to_be_focused()
        send(page, "second chat")
        wait_idle(page)
        menu.click()
        page.locator("#conv-list .conv-select", has_text="hello from a phone").click()
        expect(menu).to_have_attribute("aria-expanded", "false")
        expect(page.locator("article.msg-user .msg-body")).to_have_text(["hello from a phone"])
        menu.click()
        page.locator("#backdrop").click(position={"x": 370, "y": 400})
        expect(menu).to_have_attribute("aria-expanded", "false")
    finally:
        ctx.close()


def test_dark_theme_follows_the_system(ui_browser, server: Server, shot) -> None:
    """prefers-color-scheme: dark gives the dark palette."""
    ctx = new_context(ui_browser, color_scheme="dark")
    page = ctx.new_page()
    try:
        page.goto(server.url + "/")
        send(page, "hello in the dark")
        wait_idle(page)
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(22, 23, 28)"
        shot(page, "dark")
    finally:
        ctx.close()


def test_no_request_leaves_the_server(ui_page: Page, server: Server) -> None:
    """The page loads nothing from any other origin (no CDN): every request goes to the server."""
    page = ui_page
    origins: set[str] = set()
    page.on("request", lambda r: origins.add("/".join(r.url.split("/")[:3])))
    page.reload()
    send(page, "hello")
    wait_idle(page)
    assert origins == {server.url}
    csp = page.locator("meta[http-equiv='Content-Security-Policy']").get_attribute("content")
    assert "default-src 'self'" in csp and "script-src 'self'" in csp


@pytest.fixture(autouse=True)
def _nothing_left_running(request: pytest.FixtureRequest) -> None:
    """After each test that used the server, no request of it is still running there."""
    yield
    for name in ("server", "slow_server", "full_server", "long_server"):
        if name in request.fixturenames:
            srv = request.getfixturevalue(name)
            assert srv.wait_metric(RUNNING, 0) == 0, f"{name} still runs a request after the test"


def test_a_reply_a_screen_long_in_one_delta_leaves_the_view_at_its_end(ui_browser, server: Server) -> None:
    """At the end of the conversation when a reply arrives, the view follows it even when one delta adds far
    more than the "near the end" margin: no scroll-to-latest button, the last line in view. (A stubbed reply
    arrives whole, so this checks the end-of-stream render; the per-frame update mid-stream follows the same
    rule, forced once the reader was at the end, and is exercised by the streaming scroll test.)"""
    ctx = new_context(ui_browser, viewport={"width": 900, "height": 420})
    page = ctx.new_page()
    try:
        page.goto(server.url + "/")
        page.wait_for_selector("#prompt")
        text = "\n\n".join(f"Line {i} of a long reply." for i in range(60))
        stub_chat(page, sse(chunk({"role": "assistant", "content": ""}), chunk({"content": text}),
                            chunk({}, finish="stop")))
        send(page, "a long answer please")
        wait_idle(page)
        expect(page.locator("article.msg-assistant").last).to_contain_text("Line 59 of a long reply.")
        messages = page.locator("#messages")
        assert messages.evaluate("el => el.scrollHeight > el.clientHeight + 400")
        assert messages.evaluate("el => el.scrollHeight - el.scrollTop - el.clientHeight") < 80
        expect(page.get_by_role("button", name="Scroll to the latest message")).to_be_hidden()
    finally:
        ctx.close()
