"""The one base class of every failure infinigen expects and can explain.

Each error the package raises on purpose (a bad setting, an unusable KV directory, a corrupt
skew artifact, a prompt that does not fit, ...) derives from `InfiniGenError` as well as from
the built-in class it has always been (ValueError, OSError, ...). Its message is one sentence
that names the thing and what to do, so the command line prints it as one line; anything else
that escapes is a bug, and only then is a traceback worth showing.
"""

from __future__ import annotations

import errno

# An OSError-kind InfiniGenError with one of these names what the user gave (a folder that does
# not exist or is a file, a device this machine lacks), not what the machine refused.
INPUT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ENODEV})


class InfiniGenError(Exception):
    """An expected failure whose message, one sentence, is all the user needs."""


class InputError(InfiniGenError, ValueError):
    """Text handed in that cannot be used: an empty prompt, a file that is not UTF-8 text, ..."""


def is_input_error(exc: BaseException) -> bool:
    """Whether `exc` (an expected failure) is about what the user handed in (the command line's
    exit status 2) rather than what the machine refused (disk, I/O: 1)."""
    if isinstance(exc, InputError) or not isinstance(exc, OSError):
        return True
    return isinstance(exc, InfiniGenError) and exc.errno in INPUT_ERRNOS
