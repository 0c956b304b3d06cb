"""The one base class of every failure infinigen expects and can explain.

Each error the package raises on purpose (a bad setting, an unusable KV directory, a corrupt
skew artifact, a prompt that does not fit, ...) derives from `InfiniGenError` as well as from
the built-in class it has always been (ValueError, OSError, ...). Its message is one sentence
that names the thing and what to do, so the command line prints it as one line; anything else
that escapes is a bug, and only then is a traceback worth showing.
"""

from __future__ import annotations


class InfiniGenError(Exception):
    """An expected failure whose message, one sentence, is all the user needs."""


class InputError(InfiniGenError, ValueError):
    """Text handed in that cannot be used: an empty prompt, a file that is not UTF-8 text, ..."""
