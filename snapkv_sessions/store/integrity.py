"""What :meth:`SessionStore.integrity` checks without a key: the hash chain over the messages, the session's head
and message count, and the turns against the messages they reference. (Row seals are checked by the store,
which holds the key.)"""

from __future__ import annotations

from dataclasses import dataclass

from .hashing import GENESIS, message_hash


@dataclass(frozen=True)
class Integrity:
    """What :meth:`SessionStore.integrity` found, in two parts: the audit re-executes a session whose messages
    are intact even when a turn record is not, to name the field that differs."""

    messages: list[str]  # the hash chain, the session row and the message rows: what a re-execution reads
    turns: list[str]  # turn records against their seals and the messages they reference

    @property
    def problems(self) -> list[str]:
        return self.messages + self.turns



def chain_problems(session: dict, messages: list[dict]) -> list[str]:
    """Re-hash every message in order: an altered, missing or reordered message shows."""
    problems = []
    prev = GENESIS
    for i, msg in enumerate(messages, start=1):
        if msg["seq"] != i:
            problems.append(f"message seq {msg['seq']}: expected seq {i} (a message is missing)")
        if msg["prev_hash"] != prev:
            problems.append(f"message seq {msg['seq']}: prev_hash does not match the previous message")
        digest = message_hash(msg["prev_hash"], msg["seq"], msg["role"], msg["name"], msg["content"])
        if digest != msg["hash"]:
            problems.append(f"message seq {msg['seq']} ({msg['role']}): content hash mismatch (altered)")
        prev = msg["hash"]
    if session["head_hash"] != prev:
        problems.append("session head_hash does not match the last message (truncated or altered)")
    if session["message_count"] != len(messages):
        problems.append(f"the session records {session['message_count']} messages, the table holds "
                        f"{len(messages)} (a message was deleted or added outside the store)")
    return problems


def turn_problems(session: dict, messages: list[dict], turns: list[dict]) -> list[str]:
    """Turns checked against the messages they reference: a deleted or altered row on either side shows."""
    msgs = {m["seq"]: m for m in messages}
    numbered = {t["turn"] for t in turns}
    problems = [f"message seq {m['seq']} belongs to turn {m['turn']}, which has no record (deleted)"
                for m in messages if m["turn"] is not None and m["turn"] not in numbered]
    problems += [f"turn {n} has no record (deleted)" for n in range(1, max(numbered, default=0))
                 if n not in numbered and all(m["turn"] != n for m in messages)]
    for t in turns:
        problems += _one_turn_problems(t, msgs)
    if any(t["status"] == "pending" for t in turns[:-1]):
        problems.append("a pending turn is not the last turn")
    last_done = max((t["turn"] for t in turns if t["status"] == "done"), default=0)
    if session["turns_done"] != last_done:
        problems.append(f"the session records turn {session['turns_done']} as its last done turn, the turns table "
                        f"{last_done}")
    return problems


def _one_turn_problems(t: dict, msgs: dict[int, dict]) -> list[str]:
    user, reply = msgs.get(t["user_seq"]), msgs.get(t["assistant_seq"])
    where = f"turn {t['turn']}"
    problems = []
    if user is None or user["role"] not in ("user", "tool") or user["turn"] != t["turn"]:
        problems.append(f"{where}: its question (message seq {t['user_seq']}) is missing or not its own")
    elif (user["status"] == "abandoned") != (t["status"] == "abandoned"):
        problems.append(f"{where} is {t['status']} but its question is {user['status']}")
    if t["status"] == "done" and (reply is None or reply["role"] != "assistant"
                                  or t["assistant_seq"] != t["user_seq"] + 1):
        problems.append(f"{where}: its reply (message seq {t['assistant_seq']}) is missing or misplaced")
    return problems
