"""Secrets hidden from those who may only look: credentials in resource data, job
payloads and results, error messages and tracebacks are masked before any page shows them.

Who sees them as stored is `sees_stored`'s: those who may change the rows. Each admin
declares which of its fields are masked (`leases.ops.adminkit.Masking`), and that one
declaration masks the pages and keeps the fields out of searches, filters and orderings.

Deliberately broad: a harmless value masked now and then costs less than a credential
shown to everyone with view access.
"""
from __future__ import annotations

import inspect
import re
from typing import Any

from django.contrib.auth import get_permission_codename
from django.db.models.options import Options
from django.utils.module_loading import import_string

#: Keys and names holding any of these, in any case and anywhere, are secret ("pass" covers
#: passwd and passphrase, "auth" authorization, "cred" credentials).
SECRET_WORDS = ("pass", "pwd", "secret", "token", "key", "auth", "cookie", "cred", "session", "private", "bearer")
MASK = "••••••"
#: "pw" is secret as a word of a name (pw, db_pw, SMTP-PW), not inside one ("upward").
_PW = r"(?<![a-z])pw(?![a-z])"
_WORDS = "|".join((*SECRET_WORDS, _PW))
_SECRET_WORD = re.compile(_WORDS, re.IGNORECASE)
_NAME = re.compile(r"[\w.-]{1,200}")
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
#: Names that say "a credential follows" on their own, so the next word is its value with
#: neither "=" nor ":" between them: "token abc", "--api-key abc", "Bearer abc",
#: "password 'x y'". Narrower than SECRET_WORDS ("key", "session", "auth" start prose). The
#: name ends in the word; it starts a run and its run is read lazily: linear per run.
_CREDENTIAL = r"token|pass(?:word|wd|phrase)|pwd|(?<![a-z])pw|secret|bearer|(?:api|access|private|secret)[-_]?key"
_CREDENTIAL_NAME = rf"(?<![\w.-]) [\w.-]*? (?:{_CREDENTIAL}) (?![\w.-])"
#: A connective after the name ("token is invalid", "password for bob") is prose, not a value.
_PROSE = r"is|are|was|were|be|been|in|not|of|for|to|from|or|and|the|a|an|with|on|at|by|if|as|has|have|had|must|"\
         r"should|will|can|cannot|may|could|would|does|did|do"
#: Neither is another credential's name ("pw --token abc": abc is the token's). A quoted
#: value is looked for within 200 characters, so each attempt costs a bounded scan.
_SPACED = re.compile(
    rf"""
    (?P<name> {_CREDENTIAL_NAME} )
    (?P<sep> [ \t]+ )
    (?!(?:{_PROSE})\b) (?!{_CREDENTIAL_NAME}[ \t])
    (?P<value>
        (?P<vq>['"]) [^'"\n]{{0,200}} (?P=vq) (?=[\s&,;)\]}}]|$)
      | [^\s=:'"] \S*
    )
    """,
    re.IGNORECASE | re.VERBOSE,
)


def sees_stored(user: Any, opts: Options) -> bool:
    """Whether `user` sees the masked fields of a model as stored: who may change its rows
    (they need the secrets to edit the rows or act on them, and their role reads the
    database anyway). Everyone else sees them masked, and may not search or filter by them."""
    return user.has_perm(f"{opts.app_label}.{get_permission_codename('change', opts)}")


def is_secret(key: Any) -> bool:
    return isinstance(key, str) and _SECRET_WORD.search(key) is not None


def _masked_pair(match: re.Match) -> str:
    quote = match["vq"] or ""
    return f"{match['name']}{match['sep']}{quote}{MASK}{quote}"


def mask_text(text: str) -> str:
    """`text` (a message, a traceback, a string in JSON) with the credentials it may carry
    masked: URL passwords and the values of secret-looking names (see _USERINFO, _PAIR,
    _SPACED).

    Deliberately broad, as mask_secrets: a harmless value masked now and then costs less
    than a credential shown to everyone with view access.
    """
    text = _PAIR.sub(_masked_pair, _USERINFO.sub(rf"\1{MASK}@", text))
    return _SPACED.sub(_masked_pair, text)


def mask_secrets(value: Any) -> Any:
    """`value` with secret-looking keys' values (whole subtrees) masked, and its strings
    through mask_text. Lists hold secrets by position too: the second item of a pair whose
    first is a secret-looking name (headers as ``[["Authorization", "Bearer x"]]``), and
    the item after a secret-looking option (``["--password", "x"]``).

    Deliberately broad ("monkey" contains "key"): showing a harmless value masked costs
    less than showing a credential to everyone with view access.
    """
    if isinstance(value, dict):
        return {k: MASK if is_secret(k) else mask_secrets(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # a tuple comes back a list, as JSON would have it
        if len(value) == 2 and _is_secret_name(value[0]):
            return [value[0], MASK]
        return [MASK if _is_secret_name(before) and before.startswith("-") else mask_secrets(item)
                for before, item in zip((None, *value), value)]
    if isinstance(value, str):
        return mask_text(value)
    return value


def _is_secret_name(item: Any) -> bool:
    """A secret-looking name on its own (a header's, an option's), not text that holds one
    ("user:pw@host" is a value)."""
    return isinstance(item, str) and _NAME.fullmatch(item) is not None and is_secret(item)


def mask_task_call(task_path: str, payload: Any) -> Any:
    """The payload of a Django task's job, ``{"args": [...], "kwargs": {...}}``, masked:
    a positional argument by the name of the task's parameter it is passed as, so
    ``login("bob", "hunter2")`` hides its `password`. When the task cannot be imported
    here to tell, every positional argument is masked."""
    if not isinstance(payload, dict) or not isinstance(payload.get("args"), list):
        return mask_secrets(payload)
    args = payload["args"]
    names = _positional_names(task_path, len(args))
    masked = [MASK if name is None or is_secret(name) else mask_secrets(arg) for name, arg in zip(names, args)]
    return {**mask_secrets({k: v for k, v in payload.items() if k != "args"}), "args": masked}


def _positional_names(task_path: str, count: int) -> list[str | None]:
    """The parameter names `count` positional arguments bind to; None where unknown."""
    try:
        task = import_string(task_path)
        parameters = list(inspect.signature(task.func).parameters.values())
    except Exception:  # noqa: BLE001 - not importable in this process, or not a task
        return [None] * count
    if getattr(task, "takes_context", False):
        parameters = parameters[1:]
    names: list[str | None] = []
    for parameter in parameters:
        if parameter.kind == parameter.VAR_POSITIONAL:
            names += [parameter.name] * (count - len(names))
        elif parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            names.append(parameter.name)
    return (names + [None] * count)[:count]
