"""``serve --record-traffic DIR``: the prompts of the requests a server answered, as training data
for a draft head of its own traffic (``verispec train-head --prompts DIR/traffic-*.jsonl``).

Owns the record's format and the file. One JSON line per answered request, in the format
``train-head --prompts`` and ``bench --prompts`` read: ``{"id", "category": "chat", "turns": [the
user messages' text, in order]}`` for a chat request, ``{"id", "category": "completion",
"prompt": text}`` per prompt of a completion request (token-id prompts decoded). Only prompts are
kept, never the answers (``train-head`` has the target answer them again, greedily: EAGLE-3's
self-distillation) nor system or assistant messages, tools, parameters or client details. A
request is recorded once every choice finished without an error (a client that left, a refusal or
a fault is not). Each server process appends to its own ``traffic-<pid>.jsonl`` (replicas never
share a file); a write that fails (disk full) is logged once and counted, the request still
answered. Knows nothing about HTTP or the engine.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from pathlib import Path

from verispec.errors import InvalidParameterError

log = logging.getLogger("verispec.server")


def check_folder(directory: str | Path) -> Path:
    """``directory`` as a Path. Raises InvalidParameterError unless it is an existing, writable folder."""
    folder = Path(directory)
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise InvalidParameterError(f"--record-traffic {folder}: not a writable folder (create it first)")
    return folder


class TrafficRecorder:
    """Appends records to ``directory/traffic-<pid>.jsonl``.

    Raises:
        InvalidParameterError: ``directory`` is not an existing, writable folder.
    """

    def __init__(self, directory: str | Path) -> None:
        folder = check_folder(directory)
        self.path = folder / f"traffic-{os.getpid()}.jsonl"
        self.recorded = 0
        self.failed = 0
        self._lock = threading.Lock()

    def record(self, items: list[dict]) -> None:
        """Append ``items`` (from :func:`chat_record` / :func:`completion_records`), one line each."""
        lines = "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
        with self._lock:
            try:
                with open(self.path, "a", encoding="utf-8") as out:
                    out.write(lines)
                self.recorded += len(items)
            except OSError as exc:
                self.failed += len(items)
                if self.failed == len(items):  # the first failure only: a full disk must not flood the log
                    log.warning(
                        "--record-traffic: cannot write %s (%s); requests are answered, not recorded", self.path, exc
                    )


def chat_record(messages) -> list[dict]:
    """The record of a chat request (``messages``: :class:`~verispec.server.schemas.ChatMessage`);
    [] when no user message holds text."""
    turns = [m.text() for m in messages if m.role == "user" and m.text().strip()]
    return [{"id": uuid.uuid4().hex, "category": "chat", "turns": turns}] if turns else []


def completion_records(tokenizer, prompts: list[list[int]]) -> list[dict]:
    """One record per prompt of a completion request (token ids, decoded as sent)."""
    texts = [tokenizer.decode(ids) for ids in prompts]
    return [{"id": uuid.uuid4().hex, "category": "completion", "prompt": text} for text in texts if text.strip()]
