"""Text from a host, made safe for each place it is shown: one module, so that every output format
(terminal, log files, HTML, Markdown, XML/JUnit) gets the same treatment.

    visible(s)          control characters escaped into visible text (`\\x1b`, `\\r`, `\\u202e`):
                        the terminal, the log files, and the first stage of every other format
    markdown(s)         visible(s) for a Markdown line or table cell: no markup, HTML, links,
                        images, @mentions or #references survive (GitHub renders report.md)
    markdown_code(s)    visible(s) as an inline code span; markdown_block(s): the body of a code
                        block, whose fence markdown_fence(s) is longer than any backtick run of s

HTML is escaped by Jinja2's autoescape and XML by ElementTree, over visible() text: what remains
to be escaped there is markup, which those escape completely.
"""
from __future__ import annotations

import re

# Escaped: C0 controls but tab and newline, DEL, C1 controls, Unicode line/paragraph separators,
# bidirectional overrides and isolates (they reorder what a reader sees), the BOM and the
# noncharacters XML cannot hold. A carriage return is escaped too unless it ends a line (\r\n).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ufeff\ufffe\uffff]"
                      "|\r(?!\n)")
_SURROGATE = re.compile("[\ud800-\udfff]")
ZWSP = "\u200b"     # breaks GitHub's mention, reference and autolink patterns without showing


def visible(s: str) -> str:
    """`s` with every control character (see _CONTROL) written as a visible escape (`\\x1b`,
    `\\r`, `\\u2028`), `\\r\\n` as `\\n`, and lone surrogates as U+FFFD."""
    s = _SURROGATE.sub("\ufffd", s).replace("\r\n", "\n")
    return _CONTROL.sub(_escape, s)


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return {0x0D: "\\r"}.get(code) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


_MD_SPECIAL = re.compile(r"([\\`\[\]|])")       # code, links and images, table cells (emphasis is harmless)
_MD_NEUTRAL = [
    (re.compile(r"@(?=\w)"), "@" + ZWSP),                       # @user, @org/team: no mention
    (re.compile(r"#(?=\d)"), "#" + ZWSP),                       # #123: no issue reference
    (re.compile(r"(?i)([a-z][a-z0-9+.-]*):(?=//)"), r"\1:" + ZWSP),   # scheme://: no autolink
    (re.compile(r"(?i)\bwww\."), "www" + ZWSP + "."),           # www.example: no autolink
]


def markdown(value) -> str:
    """`value` as text in a Markdown line or table cell: one line; backslash, backtick, `[`, `]`
    and `|` escaped (no code span, link, image or cell break), `<`, `>` and `&` as entities (no
    raw HTML, no entity tricks); mentions, #references and autolinks broken."""
    s = " ".join(visible(str(value)).split())
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _neutral(_MD_SPECIAL.sub(r"\\\1", s))


def markdown_block(value) -> str:
    """`value` as the body of a fenced code block (markdown_fence): visible, lines kept, mentions,
    #references and autolinks broken as in markdown()."""
    return _neutral(visible(str(value)))


def _neutral(s: str) -> str:
    for pattern, replacement in _MD_NEUTRAL:
        s = pattern.sub(replacement, s)
    return s


def markdown_code(value) -> str:
    """`value` as inline Markdown code, safe in a table cell (`|` escaped), on one line, mentions,
    #references and autolinks broken as in markdown()."""
    s = " ".join(visible(str(value)).replace("|", "\\|").split())
    s = _neutral(s)         # GitHub ignores them in code; other renderers may not
    if not s:
        return ""
    ticks = "`" * (max((len(m) for m in re.findall(r"`+", s)), default=0) + 1)
    return f"{ticks} {s} {ticks}" if "`" in s else f"{ticks}{s}{ticks}"


def markdown_fence(body: str) -> str:
    """A Markdown code fence longer than any backtick run in `body`."""
    longest = max((len(m) for m in re.findall(r"`+", body)), default=0)
    return "`" * max(3, longest + 1)
