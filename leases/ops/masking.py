"""Secrets hidden from those who may only look: credentials in resource data, job
payloads and results, error messages and tracebacks are masked before any page shows them.

Deliberately broad: a harmless value masked now and then costs less than a credential
shown to everyone with view access.
"""
from __future__ import annotations

import re
from typing import Any

#: Keys and names holding any of these, in any case and anywhere, are secret ("pass" covers
#: passwd and passphrase, "auth" authorization, "cred" credentials).
SECRET_WORDS = ("pass", "pwd", "secret", "token", "key", "auth", "cookie", "cred", "session", "private")
MASK = "••••••"
_WORDS = "|".join(SECRET_WORDS)
_SECRET_WORD = re.compile(_WORDS, re.IGNORECASE)
#: The password of "[scheme://]user:password@host", as proxy and database URLs carry it,
#: with or without a scheme. It is often unescaped ("p@ss", "pa/ss"), so it runs to the last
#: "@" of the whitespace-delimited token. A first colon followed by "//" is the scheme's,
#: and the user then ends at the next colon, whatever follows it.
_USERINFO = re.compile(r"(?<!\S)([^\s:]*://[^\s:]*:|[^\s:]*:(?!//))\S*@")
#: A secret-looking name, bare (api_key, X-Auth-Token) or quoted as a dict's repr or JSON
#: quotes keys, and its value: after "=" up to whitespace or "&" (the next query parameter),
#: after ":" the rest of the line (a header: "Authorization: Basic dXNl..."). A quoted value
#: keeps its quotes if it ends there ("'a'b" is masked whole). A bare name ending in Error,
#: Exception or Warning is the exception of a traceback's last line ("KeyError: 'token'").
#: Names are matched as whole runs (lookbehind, then a lookahead for the word) to keep the
#: search linear on long runs.
_PAIR = re.compile(
    rf"""
    (?P<name>
        (?<![\w.-]) (?=[\w.-]*(?:{_WORDS})) [\w.-]+
        (?<!(?-i:Error)) (?<!(?-i:Exception)) (?<!(?-i:Warning))
      | (?P<q>['"]) (?=[^'"\n]*(?:{_WORDS})) [^'"\n]+ (?P=q)
    )
    (?P<sep> [ \t]* (?:(?P<eq>=+)|:) [ \t]* )
    (?P<value>
        (?P<vq>['"]) (?:(?!(?P=vq))[^\\\n] | \\.)* (?P=vq) (?=[\s&,;)\]}}]|$)
      | (?(eq) (?:(?:bearer|basic|digest)[ \t]+)?[^\s&]+ | \S[^\n]* )
    )
    """,
    re.IGNORECASE | re.VERBOSE,
)


def is_secret(key: Any) -> bool:
    return isinstance(key, str) and _SECRET_WORD.search(key) is not None


def _masked_pair(match: re.Match) -> str:
    quote = match["vq"] or ""
    return f"{match['name']}{match['sep']}{quote}{MASK}{quote}"


def mask_text(text: str) -> str:
    """`text` (a message, a traceback, a string in JSON) with the credentials it may carry
    masked: URL passwords and the values of secret-looking names (see _USERINFO, _PAIR).

    Deliberately broad, as mask_secrets: a harmless value masked now and then costs less
    than a credential shown to everyone with view access.
    """
    return _PAIR.sub(_masked_pair, _USERINFO.sub(rf"\1{MASK}@", text))


def mask_secrets(value: Any) -> Any:
    """`value` with secret-looking keys' values (whole subtrees) masked, and its strings
    through mask_text.

    Deliberately broad ("monkey" contains "key"): showing a harmless value masked costs
    less than showing a credential to everyone with view access.
    """
    if isinstance(value, dict):
        return {k: MASK if is_secret(k) else mask_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_secrets(v) for v in value]
    if isinstance(value, str):
        return mask_text(value)
    return value
