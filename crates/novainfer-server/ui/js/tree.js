//! A conversation is a tree of messages: editing a question or regenerating a reply adds a
//! sibling (a new version) instead of throwing the later turns away.
//!
//! Representation (what localStorage and the export format hold): `conv.messages` is every
//! message of every branch in creation order, each with `parentId` (null for a first message);
//! `conv.active` maps a parent (its id, or "" for the root) to the child shown under it. The
//! path shown, and the prompt sent, is the walk from the root that takes the active child at each
//! level (the newest child when none is chosen). Pure functions on plain objects, no DOM.

const ROOT = '';

const keyOf = (parentId) => parentId ?? ROOT;

/** The children of `parentId` (null: the first messages), oldest first. */
export function childrenOf(conv, parentId) {
  return conv.messages.filter((m) => (m.parentId ?? null) === (parentId ?? null));
}

/** The messages shown: root to leaf along the active children. */
export function pathOf(conv) {
  const byParent = new Map();
  for (const m of conv.messages) {
    const k = keyOf(m.parentId);
    if (!byParent.has(k)) byParent.set(k, []);
    byParent.get(k).push(m);
  }
  const path = [];
  const seen = new Set();
  let parent = ROOT;
  for (;;) {
    const kids = byParent.get(parent);
    if (!kids || kids.length === 0) break;
    const chosen = kids.find((m) => m.id === conv.active?.[parent]) || kids[kids.length - 1];
    // A corrupt import could hold a cycle; the path never visits a message twice.
    if (seen.has(chosen.id)) break;
    seen.add(chosen.id);
    path.push(chosen);
    parent = chosen.id;
  }
  return path;
}

/** The versions of `msg`'s place in the conversation: itself and its siblings, oldest first. */
export function siblingsOf(conv, msg) {
  return childrenOf(conv, msg.parentId);
}

/** Shows `msg` (and, below it, the branch last shown under it). */
export function select(conv, msg) {
  conv.active = { ...(conv.active || {}), [keyOf(msg.parentId)]: msg.id };
}

/** Adds `msg` under `parentId` (null: as a first message) and shows it. */
export function addChild(conv, parentId, msg) {
  msg.parentId = parentId ?? null;
  conv.messages.push(msg);
  select(conv, msg);
  return msg;
}

/** Adds `msg` as a new version of `of` (same parent) and shows it. */
export function addSibling(conv, of, msg) {
  return addChild(conv, of.parentId, msg);
}

/**
 * Deletes one message. Its children move up to its parent, so the turns after it stay (the
 * conversation reads as if the message had never been there); the branch shown stays shown.
 */
export function removeMessage(conv, msg) {
  const index = conv.messages.indexOf(msg);
  if (index < 0) return;
  const parentKey = keyOf(msg.parentId);
  const kids = childrenOf(conv, msg.id);
  const shownKid = kids.find((m) => m.id === conv.active?.[msg.id]) || kids[kids.length - 1];
  for (const kid of kids) kid.parentId = msg.parentId ?? null;
  conv.messages.splice(index, 1);
  const active = { ...(conv.active || {}) };
  delete active[msg.id];
  if (active[parentKey] === msg.id || !active[parentKey]) {
    if (shownKid) active[parentKey] = shownKid.id; else delete active[parentKey];
  }
  conv.active = active;
}

/** Deletes `msg` and everything below it (used for a failed, empty reply that is replaced). */
export function removeSubtree(conv, msg) {
  const doomed = new Set([msg.id]);
  let grew = true;
  while (grew) {
    grew = false;
    for (const m of conv.messages) {
      if (!doomed.has(m.id) && doomed.has(m.parentId)) { doomed.add(m.id); grew = true; }
    }
  }
  conv.messages = conv.messages.filter((m) => !doomed.has(m.id));
  const active = {};
  for (const [k, v] of Object.entries(conv.active || {})) {
    if (!doomed.has(k) && !doomed.has(v)) active[k] = v;
  }
  conv.active = active;
}

/**
 * Brings a conversation stored before branches existed (a flat list, no `parentId`) to the tree
 * form: each message becomes the child of the one before it. Idempotent.
 */
export function migrate(conv) {
  if (!conv.active || typeof conv.active !== 'object') conv.active = {};
  const ids = new Set(conv.messages.map((m) => m.id));
  let previous = null;
  for (const m of conv.messages) {
    if (!('parentId' in m)) m.parentId = previous;
    else if (m.parentId !== null && !ids.has(m.parentId)) m.parentId = null; // orphan: lift to the root
    previous = m.id;
  }
  return conv;
}
