"""Secrets kept out of everything a run writes or shows: each secret value the pipeline knows (a
host's secret_env values and their lines: remote.secret_strings) is replaced by ``[REDACTED]`` in
run.json (every string, keys included: run_store.write_run), the step logs, the console and the
reports, and so is a piece of one cut off at the edge of a log tail.
"""

from __future__ import annotations

from typing import Any, Iterable

REDACTED = "[REDACTED]"
MIN_FRAGMENT = 6  # shortest cut-off piece of a secret redacted at the edge of a log tail


def redact(text: Any, secrets: Iterable[str]) -> str:
    """``text`` with every secret value replaced by ``[REDACTED]``.

    Also a piece of a secret cut off at the start or end of ``text`` (a log tail starts or ends
    mid-secret), when that piece is at least a few characters long. Non-strings are str()'d.
    """
    text = text if isinstance(text, str) else str(text)
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
        text = _redact_edges(text, secret)
    return text


def _redact_edges(text: str, secret: str) -> str:
    for n in range(len(secret) - 1, MIN_FRAGMENT - 1, -1):
        if text.startswith(secret[-n:]):
            text = REDACTED + text[n:]
            break
    for n in range(len(secret) - 1, MIN_FRAGMENT - 1, -1):
        if text.endswith(secret[:n]):
            text = text[:-n] + REDACTED
            break
    return text


def redact_tree(value: Any, secrets: Iterable[str]) -> Any:
    """A copy of a JSON-like value with every string in it (dict keys too) redacted."""
    secrets = [s for s in secrets if s]
    if not secrets:
        return value
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {redact_tree(k, secrets) if isinstance(k, str) else k: redact_tree(v, secrets)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_tree(v, secrets) for v in value]
    return value
