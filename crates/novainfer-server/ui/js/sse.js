//! Incremental Server-Sent Events parser for `fetch` streams (EventSource cannot POST).
//!
//! Invariants: bytes may arrive split anywhere, even inside a UTF-8 character or a line ending;
//! an event is delivered only once its terminating blank line has arrived; comment lines
//! (`: keep-alive`) and fields other than `data` are ignored; multiple `data:` lines in one event
//! are joined with "\n" as the SSE spec says.

export class SseParser {
  constructor() {
    this.decoder = new TextDecoder();
    this.buffer = '';
    this.data = [];
  }

  /** Feeds a chunk of bytes (Uint8Array) or text; returns the complete events' data strings. */
  push(chunk) {
    this.buffer += typeof chunk === 'string' ? chunk : this.decoder.decode(chunk, { stream: true });
    return this.drain(false);
  }

  /** Flushes at end of stream: a final event without its blank line still counts. */
  end() {
    this.buffer += this.decoder.decode();
    return this.drain(true);
  }

  drain(atEnd) {
    const events = [];
    for (;;) {
      const match = /\r\n|\r|\n/.exec(this.buffer);
      // A lone "\r" at the buffer's end may be the first half of "\r\n": wait for the next byte.
      if (!match || (match[0] === '\r' && match.index === this.buffer.length - 1 && !atEnd)) break;
      const line = this.buffer.slice(0, match.index);
      this.buffer = this.buffer.slice(match.index + match[0].length);
      this.line(line, events);
    }
    if (atEnd) {
      if (this.buffer) this.line(this.buffer, events);
      this.buffer = '';
      this.line('', events);
    }
    return events;
  }

  line(line, events) {
    if (line === '') {
      if (this.data.length) events.push(this.data.join('\n'));
      this.data = [];
      return;
    }
    if (line.startsWith(':')) return;
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'data') this.data.push(value);
  }
}
