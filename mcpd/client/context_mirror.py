"""A client-side mirror of one context: read and write it like a dict, and sync by deltas.

The mirror keeps two copies: `synced`, the state at `version` as the daemon has it, and
`local`, what the application sees. `sync()` sends the difference between them as deltas based
on `version`; if another client got there first (CONFLICT) it fetches what it missed, keeps the
application's own unsynced changes on top, and tries again.
"""
from __future__ import annotations

import numpy as np

from mcpd.client.replies import result_of
from mcpd.protocol import codes
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.delta import DeltaLimits
from mcpd.protocol.results import GenerateResult

TOKENS = "tokens"
SYNC_ATTEMPTS = 4


class ContextMirror:
    def __init__(self, client, context_id: str, create: bool = True, limits: DeltaLimits = DeltaLimits()):
        self.client, self.id, self.limits = client, context_id, limits
        self.version = 0
        self.synced: dict = {TOKENS: np.zeros(0, np.int32)}
        self.local: dict = dict(self.synced)
        self.client.call("context.open", {"id": context_id, "create": create})
        self.refresh()

    # -- the state, as the application sees it --------------------------------------------------

    @property
    def tokens(self) -> np.ndarray:
        return self.local[TOKENS]

    def __getitem__(self, name: str):
        return self.local[name]

    def __setitem__(self, name: str, value) -> None:
        self.local[name] = value

    def __delitem__(self, name: str) -> None:
        del self.local[name]

    def __contains__(self, name: str) -> bool:
        return name in self.local

    def keys(self):
        return [n for n in self.local if n != TOKENS]

    @property
    def dirty(self) -> bool:
        return bool(self._pending())

    # -- syncing --------------------------------------------------------------------------------

    def sync(self) -> int:
        """Send local changes; returns the new version (unchanged if there was nothing to send)."""
        for _ in range(SYNC_ATTEMPTS):
            changes = self._pending()
            if not changes:
                return self.version
            try:
                self.version = self._send_update(changes)["version"]
            except MCPDError as e:
                if e.code != codes.CONFLICT:
                    raise
                self.refresh()   # someone else moved it on: rebase our changes and retry
                continue
            return self.version
        raise MCPDError(codes.CONFLICT, f"context {self.id!r} kept changing; gave up after {SYNC_ATTEMPTS} tries")

    def _send_update(self, changes: list) -> dict:
        """Send the deltas and wait for the daemon to commit them. The XORed fields are copied into
        their synced snapshots during the wait, which is otherwise idle (a big field's copy is a
        fair share of its sync); if the update is refused, XORing the same delta back restores them."""
        entries, frames = codec.to_wire(changes)
        request_id = self.client.send("context.update", {"id": self.id, "base": self.version, "changes": entries},
                                      frames)
        early = [change for change in changes if change.kind == "xor"]
        for change in early:
            self._mark_synced(change.name)
        try:
            result = result_of(self.client.receive(request_id))
        except BaseException:
            for change in early:
                snapshot = self.synced[change.name]
                codec.apply_in_place(snapshot, change, DeltaLimits(max_field_bytes=snapshot.nbytes))
            raise
        for change in changes:
            if change.kind != "xor":
                self._mark_synced(change.name)
        return result

    def refresh(self) -> int:
        """Fetch what changed on the daemon since our version; local unsynced changes stay on top."""
        result, frames = self.client.call_with_payload("context.get", {"id": self.id, "since": self.version})
        mine = {c.name for c in self._pending()}
        for change in codec.from_wire(result["changes"], frames, self.limits):
            if change.kind == "delete":
                self.synced.pop(change.name, None)
            else:
                self.synced[change.name] = codec.apply(self.synced.get(change.name), change, self.limits)
            if change.name not in mine:   # the application's own unsynced change stays on top
                self._adopt_synced(change.name)
        self.version = result["version"]
        return self.version

    def _mark_synced(self, name: str) -> None:
        # A snapshot, never the application's object: writes into a local array in place must
        # still show up as a difference at the next sync. An array of the same layout is copied
        # into the old snapshot's memory: a fresh 64 MB one would cost page faults on every sync.
        if name not in self.local:
            self.synced.pop(name, None)
        elif _same_layout(self.synced.get(name), self.local[name]):
            np.copyto(self.synced[name], self.local[name])
        else:
            self.synced[name] = _snapshot(self.local[name])

    def _adopt_synced(self, name: str) -> None:
        if name in self.synced:
            self.local[name] = _snapshot(self.synced[name])
        else:
            self.local.pop(name, None)

    def _pending(self) -> list:
        changes = [codec.diff(name, self.synced.get(name), value) for name, value in self.local.items()]
        changes += [codec.delete(name) for name in self.synced if name not in self.local]
        return [c for c in changes if c is not None]

    # -- model turns ----------------------------------------------------------------------------

    def generate(self, prompt: str | None = None, **params) -> GenerateResult:
        """Run the model on the context's tokens (plus this prompt) and append the turn to it.
        Local changes are synced first, so the model sees them."""
        self.sync()
        result = self.client.generate(prompt, context=self.id, base=self.version, **params)
        appended = np.asarray(result.context.appended_token_ids, np.int32)
        kept = result.context.kept_tokens   # a chat turn that replaced the tail (contexts/chat.py)
        for state in (self.synced, self.local):
            state[TOKENS] = np.concatenate([state[TOKENS][:kept], appended])
        self.version = result.context.version
        return result

    def chat(self, role: str, content: str, **params) -> GenerateResult:
        """One chat turn: the message rendered with the model's chat template, then the reply."""
        return self.generate(messages=[{"role": role, "content": content}], **params)

    def drop(self) -> bool:
        return self.client.call("context.drop", {"id": self.id})["dropped"]


def _same_layout(old, new) -> bool:
    return (isinstance(old, np.ndarray) and isinstance(new, np.ndarray) and old is not new
            and old.dtype == new.dtype and old.shape == new.shape and old.flags.writeable)


def _snapshot(value):
    return value.copy() if isinstance(value, np.ndarray) else value   # other values are immutable
