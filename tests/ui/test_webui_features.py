"""The Web UI's features from issue 17, driven in headless Chromium against a real novainfer-server
(the tiny random model, or the wider one where a reply must last long enough to act mid-stream).

Branches, continue, delete, every sampling setting, model info, the context meter, import/export,
the storage-full path and reload mid-stream run against the real server; what the server does not
do yet (tool calls, speculative decoding) or the random model cannot say (TeX) is served to the page
by Playwright route interception of `/v1/chat/completions` with a recorded OpenAI-style SSE stream,
and each such test says so.
"""

from __future__ import annotations

import json
import re

from harness import MODEL_NAME, Server

from test_webui import (  # noqa: F401 - _nothing_left_running is an autouse fixture, applied here too
    _nothing_left_running, assistant, chat_bodies, chunk, open_settings, prompt_tokens, save_settings, send, sse,
    wait_idle,
)

try:
    from playwright.sync_api import Page, Route, expect
except ImportError:  # the conftest skips every test here
    pass

RUNNING = "novainfer:num_requests_running"


def stored_conversation(page: Page) -> dict:
    """The open conversation as localStorage holds it."""
    return page.evaluate("JSON.parse(localStorage.getItem('novainfer.conv.' + localStorage.getItem('novainfer.current')))")


def path_messages(page: Page) -> list[dict]:
    """The messages on screen (their articles' ids, in order) with their stored texts, as API
    messages: what the next request must start with."""
    ids = [a.get_attribute("data-id") for a in page.locator("article.msg").all()]
    stored = {m["id"]: m for m in stored_conversation(page)["messages"]}
    return [{"role": stored[i]["role"], "content": stored[i]["content"]} for i in ids]


def tokenize(server: Server, messages: list[dict], add_generation_prompt: bool = True) -> dict:
    import urllib.request

    req = urllib.request.Request(server.url + "/tokenize", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"messages": messages, "add_generation_prompt": add_generation_prompt}).encode())
    with urllib.request.urlopen(req, timeout=10) as response:
        return json.loads(response.read())


# ------------------------------------------------------------------ branches


def test_branches_navigate_and_the_server_sees_the_path_shown(ui_page: Page, server: Server, shot) -> None:
    """Editing a question and regenerating a reply add versions beside the old ones (nothing is
    deleted); ‹ › switches versions; every request carries exactly the path shown; a turn on a
    branch uses that branch's server session, whose KV the prefix cache serves again."""
    page = ui_page
    bodies = chat_bodies(page)
    send(page, "first question")
    wait_idle(page)
    send(page, "second question")
    wait_idle(page)
    branch_a = path_messages(page)
    assert [m["role"] for m in branch_a] == ["user", "assistant", "user", "assistant"]
    session_a = bodies[1]["session_id"]

    # Edit the first question: a second version of it with its own reply; the old turns stay stored.
    first = page.locator("article.msg-user").first
    first.hover()
    first.get_by_role("button", name="Edit message").click()
    page.get_by_role("textbox", name="Edit your message").fill("edited question")
    page.get_by_role("button", name="Save & regenerate").click()
    wait_idle(page)
    expect(page.locator("article.msg")).to_have_count(2)
    expect(page.locator("article.msg-user .version-count")).to_have_text("2/2")
    assert bodies[-1]["messages"] == [{"role": "user", "content": "edited question"}]
    session_b = bodies[-1]["session_id"]
    assert session_b != session_a
    assert len(stored_conversation(page)["messages"]) == 6
    shot(page, "branch-b")

    # Back to the first version: the whole old branch is shown again, and a turn there sends it.
    page.locator("article.msg-user").first.get_by_role("button", name="Previous version").click()
    expect(page.locator("article.msg")).to_have_count(4)
    expect(page.locator("article.msg-user .version-count").first).to_have_text("1/2")
    assert path_messages(page) == branch_a
    send(page, "third question")
    wait_idle(page)
    body = bodies[-1]
    assert body["messages"] == branch_a + [{"role": "user", "content": "third question"}]
    assert body["messages"] == path_messages(page)[:5]
    assert body["session_id"] == session_a, "the branch did not get its own session back"
    cached, prompt = prompt_tokens(assistant(page))
    assert 0 < cached <= prompt

    # Regenerate: a second version of the reply; ‹ brings the first one back, text and all.
    reply_1 = assistant(page).get_attribute("data-id")
    page.get_by_role("button", name="Regenerate reply").last.click()
    wait_idle(page)
    expect(assistant(page).locator(".version-count")).to_have_text("2/2")
    assert bodies[-1]["messages"] == body["messages"]
    assistant(page).get_by_role("button", name="Previous version").click()
    expect(assistant(page)).to_have_attribute("data-id", reply_1)
    shot(page, "versions")

    # Over to the edited branch and on from there: its path, its session.
    page.locator("article.msg-user").first.get_by_role("button", name="Next version").click()
    expect(page.locator("article.msg")).to_have_count(2)
    send(page, "follow-up on the edit")
    wait_idle(page)
    assert [m["content"] for m in bodies[-1]["messages"]][::2] == ["edited question", "follow-up on the edit"]
    assert bodies[-1]["session_id"] == session_b

    # The tree and the version shown survive a reload.
    before = path_messages(page)
    page.reload()
    page.wait_for_selector("article.msg")
    assert path_messages(page) == before
    expect(page.locator("article.msg-user .version-count").first).to_have_text("2/2")


def test_delete_one_message_keeps_the_rest(ui_page: Page, server: Server) -> None:
    """Deleting one message removes only it: the turns after it stay, and the next request is the
    path without it."""
    page = ui_page
    bodies = chat_bodies(page)
    send(page, "q1")
    wait_idle(page)
    send(page, "q2")
    wait_idle(page)
    before = path_messages(page)
    page.locator("article.msg-assistant").first.get_by_role("button", name="Delete message").click()
    expect(page.locator("article.msg")).to_have_count(3)
    assert path_messages(page) == [before[0], before[2], before[3]]
    send(page, "q3")
    wait_idle(page)
    assert bodies[-1]["messages"] == [before[0], before[2], before[3], {"role": "user", "content": "q3"}]


def test_continue_a_cut_off_reply(ui_page: Page, server: Server, shot) -> None:
    """A reply cut by max tokens offers Continue; it asks the server to continue the final
    message (continue_final_message, no generation prompt) and appends to the same reply."""
    page = ui_page
    bodies = chat_bodies(page)
    save_settings(page, **{"set-max-tokens": "6"})
    send(page, "tell me more")
    wait_idle(page)
    reply = assistant(page)
    expect(reply.locator(".tele-finish")).to_have_text("max tokens reached")
    partial = stored_conversation(page)["messages"][-1]["content"]
    assert partial
    reply.get_by_role("button", name="Continue").click()
    wait_idle(page)
    body = bodies[-1]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["messages"][-1] == {"role": "assistant", "content": partial}
    assert "session_id" not in body
    continued = stored_conversation(page)["messages"][-1]["content"]
    assert continued.startswith(partial) and len(continued) > len(partial)
    expect(page.locator("article.msg-assistant")).to_have_count(1)
    shot(page, "continued")


# ------------------------------------------------------------------ settings


def test_every_sampling_setting_reaches_the_request(ui_page: Page, server: Server, shot) -> None:
    """Each sampling parameter of the form is sent under its API name, and the real server accepts
    them together (JSON mode included); values the server refuses are refused by the form first,
    with the server's limit on the field."""
    page = ui_page
    bodies = chat_bodies(page)
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    open_settings(page)
    for label, value in [("Temperature", "0.7"), ("Top-p", "0.9"), ("Top-k", "40"), ("Min-p", "0.05"),
                         ("Max tokens", "12"), ("Seed", "1234"), ("Repetition penalty", "1.1"),
                         ("Presence penalty", "0.5"), ("Frequency penalty", "-0.5")]:
        page.get_by_label(label, exact=True).fill(value)
    page.get_by_label("Stop strings").fill("END\\n\n###")
    page.get_by_label("JSON output").check()
    page.get_by_label("JSON Schema").fill(schema)
    shot(page, "all-settings")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#settings-dialog")).to_be_hidden()
    send(page, "give me json")
    wait_idle(page)
    body = bodies[-1]
    assert {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed",
                                 "repetition_penalty", "presence_penalty", "frequency_penalty", "stop")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "max_tokens": 12, "seed": 1234,
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "stop": ["END\n", "###"]}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "ui_schema", "schema": json.loads(schema), "strict": True}}
    expect(assistant(page).locator(".msg-error")).to_have_count(0)
    assert assistant(page).locator(".msg-body").inner_text().startswith("{")

    # What the server refuses, the form refuses, naming the limit.
    refused = [("Top-p", "0", "greater than 0"), ("Top-k", "-2", ""), ("Presence penalty", "2.5", ""),
               ("Repetition penalty", "0", "greater than 0"), ("Max tokens", "600", ""), ("Seed", "-1", "")]
    for label, value, words in refused:
        open_settings(page)
        field = page.get_by_label(label, exact=True)
        field.fill(value)
        page.get_by_role("button", name="Save").click()
        expect(page.locator("#settings-dialog")).to_be_visible()
        message = field.evaluate("el => el.validationMessage")
        assert message and words in message, (label, message)
        page.get_by_role("button", name="Cancel").click()
    open_settings(page)
    page.get_by_label("Stop strings").fill("\n".join(f"s{i}" for i in range(17)))
    page.get_by_role("button", name="Save").click()
    assert "At most 16" in page.get_by_label("Stop strings").evaluate("el => el.validationMessage")
    page.get_by_label("Stop strings").fill("")
    page.get_by_label("JSON Schema").fill("{not json")
    page.get_by_role("button", name="Save").click()
    assert "not valid JSON" in page.get_by_label("JSON Schema").evaluate("el => el.validationMessage")
    page.get_by_role("button", name="Cancel").click()
    assert len(bodies) == 1


def test_defaults_for_new_chats_and_reset(ui_page: Page, server: Server) -> None:
    """"Use for new chats" makes the form the defaults of later conversations (not of existing
    ones); "Reset to defaults" fills a conversation's form with them."""
    page = ui_page
    bodies = chat_bodies(page)
    open_settings(page)
    page.get_by_label("Top-k", exact=True).fill("7")
    page.get_by_label("Max tokens", exact=True).fill("9")
    page.get_by_role("button", name="Use for new chats").click()
    expect(page.locator("#settings-note")).to_contain_text("New chats will start")
    page.get_by_label("Top-k", exact=True).fill("3")
    page.get_by_role("button", name="Save").click()
    send(page, "one")
    wait_idle(page)
    assert (bodies[-1]["top_k"], bodies[-1]["max_tokens"]) == (3, 9)
    page.get_by_role("button", name="New chat").click()
    send(page, "two")
    wait_idle(page)
    assert (bodies[-1]["top_k"], bodies[-1]["max_tokens"]) == (7, 9)
    # Back in the first chat: its own top-k, until reset to the defaults.
    page.locator("#conv-list .conv-select", has_text="one").click()
    open_settings(page)
    expect(page.get_by_label("Top-k", exact=True)).to_have_value("3")
    page.get_by_role("button", name="Reset to defaults").click()
    expect(page.get_by_label("Top-k", exact=True)).to_have_value("7")
    page.get_by_role("button", name="Save").click()
    send(page, "three")
    wait_idle(page)
    assert bodies[-1]["top_k"] == 7


def test_ctrl_enter_option(ui_page: Page, server: Server) -> None:
    """With "Send with Ctrl+Enter" on, Enter is a newline and Ctrl+Enter sends."""
    page = ui_page
    open_settings(page)
    page.get_by_label("Send with Ctrl+Enter").check()
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#composer-hint")).to_contain_text("Ctrl+Enter to send")
    page.fill("#prompt", "line one")
    page.press("#prompt", "Enter")
    page.keyboard.type("line two")
    expect(page.locator("article.msg")).to_have_count(0)
    page.press("#prompt", "Control+Enter")
    expect(page.locator("article.msg-user .msg-body")).to_have_text("line one\nline two")
    wait_idle(page)


# ------------------------------------------------------------------ model and context


def test_model_info_and_context_meter(ui_page: Page, server: Server, shot) -> None:
    """The model dialog shows what /server_info says (max_model_len, device, KV layout); the meter
    counts the conversation's tokens as the server does (the reply's usage, or /tokenize of the
    path), and warns before max_model_len with what happens there."""
    page = ui_page
    info = json.loads(server.get("/server_info"))["models"][0]
    assert info["id"] == server.model and info["max_model_len"] == 512
    assert info["kv_cache"]["layout"] == "block" and info["kv_cache"]["block_size"] == 16
    assert info["kv_cache"]["dtype"] == "f16" and info["device"] == "cpu"
    cards = json.loads(server.get("/v1/models"))["data"]
    assert cards[0]["max_model_len"] == 512

    bodies = chat_bodies(page)
    send(page, "how long is this context?")
    wait_idle(page)
    meter = page.locator("#context-meter")
    completion = int(assistant(page).locator(".tele-tokens").inner_text().split()[0])
    expected = tokenize(server, bodies[-1]["messages"])["count"] + completion
    expect(meter).to_have_attribute("data-used", str(expected))
    expect(meter).to_have_attribute("data-max", "512")
    expect(page.locator("#context-text")).to_contain_text(f"{expected} / 512 tokens")
    expect(meter).to_have_attribute("data-level", "ok")

    # Without a reply at the end of the path, the meter is the server's count of the path.
    assistant(page).get_by_role("button", name="Delete message").click()
    expect(meter).to_have_attribute("data-used", str(tokenize(server, [{"role": "user", "content": "how long is this context?"}])["count"]))

    # Near the limit: the warning says what happens at it.
    base = tokenize(server, [{"role": "user", "content": "x"}])["count"]
    per_word = tokenize(server, [{"role": "user", "content": "x" + " hello" * 100}])["count"] - base
    words = int((440 - base) * 100 / per_word)
    page.get_by_role("button", name="New chat").click()
    send(page, "x" + " hello" * words)
    wait_idle(page)
    expect(meter).to_have_attribute("data-level", "warn")
    warning = page.locator("#context-warning")
    expect(warning).to_be_visible()
    expect(warning).to_contain_text("cannot exceed 512 tokens")
    expect(warning).to_contain_text("refused by the server")
    shot(page, "context-warning")

    page.get_by_role("button", name=re.compile(r"^Model .*details$")).click()
    dialog = page.locator("#info-dialog")
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text("512 tokens")
    expect(dialog).to_contain_text("block layout, 16-token blocks, f16")
    expect(dialog).to_contain_text("cpu")
    expect(dialog).to_contain_text("Prefix-cache hit rate")
    shot(page, "model-info")
    dialog.get_by_role("button", name="Close").click()


# ------------------------------------------------------------------ import / export


def test_export_import_round_trip_and_markdown(ui_page: Page, server: Server, shot) -> None:
    """All conversations export to the documented JSON format and import back equal (branches,
    the version shown, settings, telemetry); one conversation exports as Markdown; a file that is
    not an export is refused with the reason."""
    page = ui_page
    send(page, "alpha")
    wait_idle(page)
    page.get_by_role("button", name="Regenerate reply").click()
    wait_idle(page)
    save_settings(page, **{"set-top-k": "5"})
    page.get_by_role("button", name="New chat").click()
    send(page, "beta with `code`")
    wait_idle(page)

    with page.expect_download() as dl:
        page.get_by_role("button", name="Export all").click()
    exported = json.loads(open(dl.value.path()).read())
    assert dl.value.suggested_filename.endswith(".json")
    assert exported["format"] == "novainfer.conversations" and exported["version"] == 1
    assert len(exported["conversations"]) == 2
    alpha = next(c for c in exported["conversations"] if c["settings"]["topK"] == 5)
    assert len(alpha["messages"]) == 3 and all("parentId" in m for m in alpha["messages"])
    assert "sessions" not in alpha

    with page.expect_download() as md:
        page.get_by_role("button", name="Export this conversation (Markdown)").click()
    markdown = open(md.value.path()).read()
    assert markdown.startswith("# beta with `code`\n")
    assert "## You\n\nbeta with `code`\n" in markdown
    assert f"## Assistant ({MODEL_NAME})" in markdown

    # Start from an empty browser, import the file, export again: the same conversations.
    page.evaluate("localStorage.clear()")
    page.reload()
    expect(page.locator("article.msg")).to_have_count(0)
    page.locator("#import-file").set_input_files(dl.value.path())
    expect(page.locator("#storage-banner")).to_contain_text("Imported 2 conversations")
    assert {"beta with `code`", "alpha"} <= set(page.locator("#conv-list .conv-title").all_inner_texts())
    with page.expect_download() as again:
        page.get_by_role("button", name="Export all").click()
    reexported = json.loads(open(again.value.path()).read())
    ids = {c["id"] for c in exported["conversations"]}
    by_id = lambda convs: sorted((c for c in convs if c["id"] in ids), key=lambda c: c["id"])  # noqa: E731
    assert by_id(reexported["conversations"]) == by_id(exported["conversations"])
    page.locator("#conv-list .conv-select", has_text="alpha").click()
    expect(page.locator("article.msg-assistant .version-count")).to_have_text("2/2")
    shot(page, "imported")

    # A file that is not an export: refused whole, with the reason.
    page.locator("#import-file").set_input_files(files=[{"name": "x.json", "mimeType": "application/json",
                                                         "buffer": b'{"conversations": []}'}])
    expect(page.locator("#storage-banner")).to_contain_text("not a NovaInfer conversations export")
    assert len(page.locator("#conv-list .conv").all()) == 3  # the two imported + the empty start one


# ------------------------------------------------------------------ storage


FILL_STORAGE = """() => {
  // Fills this origin's localStorage to the brim with junk, in halving chunks.
  let size = 1 << 20, n = 0;
  while (size >= 1) {
    try { localStorage.setItem('junk.' + (n++), 'x'.repeat(size)); } catch { size = Math.floor(size / 2); }
  }
  return n;
}"""


def test_storage_full_is_shown_with_a_way_out(ui_page: Page, server: Server, shot) -> None:
    """When localStorage is full, the conversation that cannot be saved stays on screen, a banner
    says so and offers Export all and Free up space; deleting an old conversation there saves it,
    and it survives a reload."""
    page = ui_page
    send(page, "big old conversation " + "lorem ipsum " * 3000)  # too long for the model: a 400, kept
    expect(assistant(page).locator(".msg-error")).to_be_visible()
    page.get_by_role("button", name="New chat").click()
    page.evaluate(FILL_STORAGE)
    send(page, "new question while full")
    wait_idle(page)
    banner = page.locator("#storage-banner")
    expect(banner).to_be_visible()
    expect(banner).to_contain_text("storage is full")
    expect(banner).to_contain_text("new question while full")
    shot(page, "storage-full")
    # Nothing is lost: Export all has the unsaved turn.
    with page.expect_download() as dl:
        banner.get_by_role("button", name="Export all").click()
    exported = json.loads(open(dl.value.path()).read())
    texts = [m["content"] for c in exported["conversations"] for m in c["messages"]]
    assert "new question while full" in texts
    # Free up space: delete the big old conversation; the new one gets saved.
    banner.get_by_role("button", name="Free up space…").click()
    dialog = page.locator("#storage-dialog")
    expect(dialog).to_be_visible()
    shot(page, "storage-dialog")
    dialog.get_by_role("button", name=re.compile("Delete “big old conversation")).click()
    expect(banner).to_be_hidden()
    dialog.get_by_role("button", name="Close").click()
    page.reload()
    expect(page.locator("article.msg-user .msg-body")).to_have_text(["new question while full"])
    expect(page.locator("#conv-list .conv")).to_have_count(1)


def test_reload_mid_stream_keeps_the_partial_reply(slow_page: Page, slow_server: Server, shot) -> None:
    """Reloading while a reply streams keeps what had arrived, marked as interrupted, with
    Continue; the server's request ends (wider model, so the reply is still streaming)."""
    page, server = slow_page, slow_server
    save_settings(page, **{"set-max-tokens": "400"})
    send(page, "a long story")
    body = assistant(page).locator(".msg-body")
    expect(body).not_to_have_text("", timeout=30_000)
    page.wait_for_function("document.querySelector('article.msg-assistant .msg-body').textContent.length > 40")
    page.reload()
    page.wait_for_selector("article.msg-assistant")
    reply = assistant(page)
    expect(reply.locator(".msg-interrupted")).to_contain_text("Interrupted")
    assert len(reply.locator(".msg-body").inner_text()) > 40
    expect(reply.get_by_role("button", name="Continue")).to_be_visible()
    expect(page.locator("#send-btn")).to_be_visible()
    assert server.wait_metric(RUNNING, 0) == 0
    shot(page, "interrupted")


def test_scroll_to_bottom_button_while_streaming(ui_browser, slow_server: Server, shot) -> None:
    """Scrolled up while a reply streams, a button brings the reader back to the end, and goes
    away there (wider model; a short window so the reply overflows)."""
    from harness import new_context

    ctx = new_context(ui_browser, viewport={"width": 900, "height": 420})
    page = ctx.new_page()
    try:
        page.goto(slow_server.url + "/")
        save_settings(page, **{"set-max-tokens": "400"})
        send(page, "a long story")
        messages = page.locator("#messages")
        page.wait_for_function("(() => { const m = document.getElementById('messages'); return m.scrollHeight > m.clientHeight + 200; })()",
                               timeout=30_000)
        button = page.get_by_role("button", name="Scroll to the latest message")
        expect(button).to_be_hidden()
        messages.evaluate("el => { el.scrollTop = 0; el.dispatchEvent(new Event('scroll')); }")
        expect(button).to_be_visible()
        shot(page, "scrolled-up")
        button.click()
        assert messages.evaluate("el => el.scrollHeight - el.scrollTop - el.clientHeight") < 80
        expect(button).to_be_hidden()
        page.get_by_role("button", name="Stop").click()
        wait_idle(page)
    finally:
        ctx.close()


# ------------------------------------------------------------------ tools, speculation, math (stubbed)


def test_tool_calls_are_cards_and_results_are_messages(ui_page: Page, shot) -> None:
    """Streamed delta.tool_calls fragments become collapsible cards (name, id, arguments pretty-
    printed); results typed in become tool messages, sent back with the call. Stubbed with
    page.route serving recorded OpenAI-style streams: the server's tool calling is being built."""
    page = ui_page
    calls = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Par'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'is", "unit": "C"}'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                               "function": {"name": "get_time", "arguments": '{"tz":"CET"}'}}]}),
        chunk({}, "tool_calls"),
        {"id": "chatcmpl-stub", "choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 20,
                                                         "prompt_tokens_details": {"cached_tokens": 0}}},
    ]
    answer = [chunk({"role": "assistant", "content": ""}), chunk({"content": "It is 21 °C in Paris."}), chunk({}, "stop")]
    bodies: list[dict] = []

    def handle(route: Route) -> None:
        bodies.append(json.loads(route.request.post_data or "{}"))
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"},
                      body=sse(*(calls if len(bodies) == 1 else answer)))

    page.route("**/v1/chat/completions", handle)
    send(page, "weather and time in Paris?")
    wait_idle(page)
    cards = assistant(page).locator("details.tool-call")
    expect(cards).to_have_count(2)
    expect(cards.nth(0).locator(".tool-name")).to_have_text("get_weather")
    expect(cards.nth(0).locator(".tool-id")).to_have_text("call_1")
    expect(cards.nth(0).locator(".tool-args")).to_have_text('{\n  "city": "Paris",\n  "unit": "C"\n}')
    expect(cards.nth(1).locator(".tool-args")).to_have_text('{\n  "tz": "CET"\n}')
    expect(assistant(page).locator(".tele-finish")).to_have_text("tool calls")
    shot(page, "tool-cards")
    cards.nth(0).locator("summary").click()
    expect(cards.nth(0).locator(".tool-args")).to_be_hidden()
    cards.nth(0).locator("summary").click()

    page.get_by_role("textbox", name="Result of get_weather").fill('{"temp": 21}')
    cards.nth(0).get_by_role("button", name="Add result").click()
    expect(page.locator("article.msg-tool")).to_have_count(1)
    assert len(bodies) == 1  # waits for the second result
    page.get_by_role("textbox", name="Result of get_time").fill("14:05")
    page.locator("details.tool-call").nth(1).get_by_role("button", name="Add result").click()
    wait_idle(page)
    expect(page.locator("article.msg-tool")).to_have_count(2)
    expect(page.locator("article.msg-tool").first.locator(".tool-result")).to_have_text('{\n  "temp": 21\n}')
    expect(assistant(page).locator(".msg-body")).to_have_text("It is 21 °C in Paris.")
    sent = bodies[1]["messages"]
    assert sent[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz":"CET"}'}}]}
    assert sent[2:] == [{"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
                        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"}]
    assert "tools" not in bodies[1]  # no tools defined in this conversation's settings: none sent
    shot(page, "tool-results")


def test_a_real_tool_call_round_trip(long_page: Page, long_server: Server, shot) -> None:
    """Against the real server: the tools defined in the settings are sent with the chosen tool_choice;
    with `required` the server's grammar makes even the tiny random model call the tool, streamed as
    delta.tool_calls into a card whose arguments are valid JSON; the result typed in goes back as a tool
    message with the call, and the model's next turn arrives."""
    page = long_page
    bodies = chat_bodies(page)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False}}}]
    open_settings(page)
    expect(page.locator("#tools-field")).to_be_visible()
    page.fill("#set-tools", json.dumps(tools))
    page.select_option("#set-tool-choice", "required")
    page.fill("#set-max-tokens", "160")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#settings-dialog")).to_be_hidden()
    send(page, "weather in Paris?")
    wait_idle(page)
    assert bodies[0]["tools"] == tools and bodies[0]["tool_choice"] == "required"
    card = assistant(page).locator("details.tool-call")
    expect(card).to_have_count(1)
    expect(card.locator(".tool-name")).to_have_text("get_weather")
    args = json.loads(card.locator(".tool-args").inner_text())
    assert set(args) == {"city"} and isinstance(args["city"], str)
    expect(assistant(page).locator(".tele-finish")).to_have_text("tool calls")
    shot(page, "real-tool-call")
    call_id = card.locator(".tool-id").inner_text()
    page.get_by_role("textbox", name="Result of get_weather").fill('{"temp": 21}')
    card.get_by_role("button", name="Add result").click()
    wait_idle(page)
    expect(page.locator("article.msg-tool")).to_have_count(1)
    expect(page.locator("article.msg-assistant")).to_have_count(2)
    assert len(bodies) == 2
    sent = bodies[1]["messages"]
    assert sent[-2]["role"] == "assistant" and sent[-2]["tool_calls"][0]["id"] == call_id
    assert sent[-1] == {"role": "tool", "tool_call_id": call_id, "content": '{"temp": 21}'}


def test_speculative_acceptance_only_when_reported(ui_page: Page) -> None:
    """usage.speculative_decoding shows the acceptance rate; a reply without it shows nothing about
    speculation (stubbed; the real server's field is checked in tests/test_speculative.py)."""
    page = ui_page
    usage = {"prompt_tokens": 10, "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0},
             "speculative_decoding": {"num_draft_tokens": 8, "num_accepted_tokens": 6}}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"},
        body=sse(chunk({"role": "assistant", "content": ""}), chunk({"content": "fast"}), chunk({}, "stop"),
                 {"id": "chatcmpl-stub", "choices": [], "usage": usage})))
    send(page, "go")
    wait_idle(page)
    expect(assistant(page).locator(".tele-spec")).to_have_text("75% drafts accepted (6/8)")
    page.unroute("**/v1/chat/completions")
    send(page, "again, for real")
    wait_idle(page)
    expect(assistant(page).locator(".tele-cache")).to_be_visible()
    expect(assistant(page).locator(".tele-spec")).to_have_count(0)


def test_speculative_acceptance_from_a_speculating_server(long_page: Page, long_server: Server) -> None:
    """A server started with --speculative-config reports each reply's drafts in its usage, and the
    telemetry shows the acceptance the server counted (the tiny model's greedy loops repeat its prompt)."""
    page = long_page
    save_settings(page, **{"set-max-tokens": "64"})
    send(page, "la la la la la la la la la la")
    wait_idle(page)
    spec = assistant(page).locator(".tele-spec")
    expect(spec).to_have_count(1)
    accepted, drafted = map(int, re.search(r"\((\d+)/(\d+)\)", spec.inner_text()).groups())
    assert 0 < accepted <= drafted
    assert long_server.metric("vllm:spec_decode_num_draft_tokens_total") >= drafted


def test_math_renders_as_mathml(ui_page: Page, shot) -> None:
    """$…$ and $$…$$ in a reply become MathML (no CDN, no HTML parsing), dollars in prose stay text,
    and a formula that does not parse is shown as its source. Stubbed: the random model writes no TeX."""
    page = ui_page
    text = ("Euler: $e^{i\\pi} + 1 = 0$, and it costs $5 and $10.\n\n"
            "$$\n\\sum_{k=1}^{n} k = \\frac{n(n+1)}{2}\n$$\n\n"
            "Matrix $\\begin{pmatrix} a & b \\\\ c & d \\end{pmatrix}$ and broken $\\frac{1$.")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"},
        body=sse(chunk({"role": "assistant", "content": ""}), chunk({"content": text[:30]}),
                 chunk({"content": text[30:]}), chunk({}, "stop"))))
    send(page, "math please")
    wait_idle(page)
    body = assistant(page).locator(".msg-body")
    expect(body.locator("math")).to_have_count(3)
    expect(body.locator("math[display='block'] munderover")).to_have_count(1)
    expect(body.locator("math[display='block'] mfrac")).to_have_count(1)
    expect(body.locator("math mtable mtr")).to_have_count(2)
    expect(body).to_contain_text("it costs $5 and $10.")
    expect(body.locator(".math-error")).to_have_text("$\\frac{1$")
    # MathML is laid out by the browser: the fraction is taller than a line of text.
    assert body.locator("math[display='block']").bounding_box()["height"] > 30
    shot(page, "math")


# ------------------------------------------------------------------ LoRA adapters


def test_the_model_picker_offers_lora_adapters(ui_context, tiny_models, tmp_path) -> None:
    """A served LoRA adapter is in the model list, marked as an adapter of its model; choosing it sends its name
    as `model` and the reply streams like any other."""
    from harness import start_server
    from tiny_lora import write_peft_adapter

    adapter, _ = write_peft_adapter(tmp_path / "tune", seed=7)
    srv = start_server(tiny_models["f32"], tmp_path / "server.log", extra_args=("--lora-modules", f"tune={adapter}"))
    try:
        page = ui_context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.goto(srv.url + "/")
        page.wait_for_selector("#prompt")
        bodies = chat_bodies(page)
        open_settings(page)
        expect(page.locator("#set-model option")).to_have_text([srv.model, f"tune (LoRA adapter of {srv.model})"])
        page.select_option("#set-model", "tune")
        page.get_by_role("button", name="Save").click()
        send(page, "hi")
        wait_idle(page)
        assert bodies[-1]["model"] == "tune"
        expect(assistant(page)).not_to_be_empty()
        assert not errors, errors
    finally:
        srv.stop()
