"""A separate worker process for the session tests: reopen a session and chat, or die mid-turn."""

from __future__ import annotations

import json
import os
import sys

from snapkv_sessions import Session
from snapkv_sessions.session import Session as _S


def main() -> None:
    mode, url, sid = sys.argv[1], sys.argv[2], sys.argv[3]
    redis_url = os.environ.get("WORKER_REDIS_URL") or None
    if mode == "die-mid-turn":
        def die(self, *args, **kwargs):
            os._exit(17)  # killed after the user message was committed, before any reply
        _S._live = die
    session = Session.open(sid, model="smollm2-135m-instruct", store=url, redis_url=redis_url)
    out = []
    for question in sys.argv[4:]:
        reply = session.chat(question, max_new_tokens=10)
        out.append({"turn": reply.turn, "text": reply.text, "tokens": reply.token_ids})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
