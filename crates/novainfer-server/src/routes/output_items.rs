//! Output pieces as the agent APIs lay them out: the chat transforms split a reply into
//! reasoning, text and tool calls ([`ChatPiece`]); the Responses API shows those as output
//! items, Anthropic's Messages API as content blocks, each with its own stream events. The
//! sequencing is the same for both and lives here once: at most the last item is open (being
//! written); a piece of another kind closes it and opens a new one; a call opens an item of
//! its own, and the call's argument text is appended to it. An [`ItemLayout`] supplies the
//! items and the events.

use axum::body::Bytes;

use crate::transform::ChatPiece;

/// The kinds of output piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PieceKind {
    Reasoning,
    Text,
    Call,
}

/// One API's items and events.
pub trait ItemLayout: Default {
    type Item: Clone;

    fn kind(item: &Self::Item) -> PieceKind;

    /// An empty reasoning or text item.
    fn new_item(&mut self, kind: PieceKind) -> Self::Item;

    /// A call item (`call_id` as the chat transforms made it).
    fn new_call(&mut self, call_id: String, name: String) -> Self::Item;

    /// The events announcing `item`, just opened at `index` (which they may fill in).
    fn opened(&mut self, index: usize, item: &mut Self::Item) -> Vec<Bytes>;

    /// Appends `delta` (text, reasoning, or a call's argument text) to `item`; its events.
    fn append(&mut self, index: usize, item: &mut Self::Item, delta: &str) -> Vec<Bytes>;

    /// Ends `item` with `status` (`completed`, or `incomplete` when the output was cut); its
    /// events.
    fn closed(&mut self, index: usize, item: &mut Self::Item, status: &'static str) -> Vec<Bytes>;
}

/// The items of one reply as its pieces arrive, and the stream events that report them.
#[derive(Debug)]
pub struct ItemBuilder<L: ItemLayout> {
    pub layout: L,
    items: Vec<L::Item>,
    open: bool,
}

impl<L: ItemLayout> Default for ItemBuilder<L> {
    fn default() -> Self {
        Self {
            layout: L::default(),
            items: Vec::new(),
            open: false,
        }
    }
}

impl<L: ItemLayout> ItemBuilder<L> {
    pub fn items(&self) -> &[L::Item] {
        &self.items
    }

    /// The events of one piece of output: reasoning, then text, then calls.
    pub fn push(&mut self, piece: ChatPiece) -> Vec<Bytes> {
        let mut events = Vec::new();
        if !piece.reasoning.is_empty() {
            events.extend(self.append(PieceKind::Reasoning, &piece.reasoning));
        }
        if !piece.content.is_empty() {
            events.extend(self.append(PieceKind::Text, &piece.content));
        }
        for call in piece.calls {
            if let (Some(id), Some(name)) = (call.id, call.function.name) {
                let item = self.layout.new_call(id, name);
                events.extend(self.open(item));
            }
            let arguments = call.function.arguments.unwrap_or_default();
            // Arguments without an open call (its start was lost) have nowhere to go.
            if !arguments.is_empty() && self.open_kind() == Some(PieceKind::Call) {
                events.extend(self.append_open(&arguments));
            }
        }
        events
    }

    /// Ends the open item with `status`.
    pub fn close(&mut self, status: &'static str) -> Vec<Bytes> {
        if !self.open {
            return Vec::new();
        }
        self.open = false;
        let index = self.items.len() - 1;
        self.layout.closed(index, &mut self.items[index], status)
    }

    fn open_kind(&self) -> Option<PieceKind> {
        self.items.last().filter(|_| self.open).map(L::kind)
    }

    /// Closes the open item as completed, then opens `item`.
    fn open(&mut self, mut item: L::Item) -> Vec<Bytes> {
        let mut events = self.close("completed");
        let index = self.items.len();
        events.extend(self.layout.opened(index, &mut item));
        self.items.push(item);
        self.open = true;
        events
    }

    /// Appends reasoning or text, in the open item if it is of that kind, else in a new one.
    fn append(&mut self, kind: PieceKind, delta: &str) -> Vec<Bytes> {
        let mut events = Vec::new();
        if self.open_kind() != Some(kind) {
            let item = self.layout.new_item(kind);
            events = self.open(item);
        }
        events.extend(self.append_open(delta));
        events
    }

    fn append_open(&mut self, delta: &str) -> Vec<Bytes> {
        let index = self.items.len() - 1;
        self.layout.append(index, &mut self.items[index], delta)
    }
}
