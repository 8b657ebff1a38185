"""
The repo's own checks. A mistake a user can fix (a setting, a missing or damaged file, a checkpoint from another
run) is raised as a Mistake, whose message names the mistake and the way on; the scripts print it as `error: ...`
lines instead of a traceback (print_mistakes). Everything else is a bug, here or in a library, and keeps its
traceback: a ValueError you raise while hacking model.py included. No torch here: prepare_fineweb.py's workers
import this through tokenizer.py.
"""
import sys


class Mistake(Exception):
    """A user's mistake, reported in one line (or one per problem); it is also a ValueError or a FileNotFoundError
    (InvalidValue, Missing), so that callers may catch it as either."""


class InvalidValue(Mistake, ValueError):
    pass


class Missing(Mistake, FileNotFoundError):
    pass


def is_number(v):
    """An int or a float, not a bool (which Python counts as an int)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_count(v):
    """An int >= 0, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_settings(settings, expected):
    """settings: a script's globals; expected: {setting: (holds?, what is expected)} -> one InvalidValue listing every
    setting that does not hold, one line each, so that a run fails before any work and with all its problems at once."""
    problems = [f"{k}={settings[k]!r}: expected {what}" for k, (ok, what) in expected.items() if not ok]
    if problems:
        raise InvalidValue('\n'.join(problems))


def print_mistakes():
    """For a script run as a program: an uncaught Mistake prints as `error: ...` lines (exit status 1, as for any
    uncaught exception); every other exception keeps its traceback."""
    def hook(kind, e, tb):
        if issubclass(kind, Mistake) or getattr(kind, 'one_line', False):   # (model.FastRoutingMismatch too)
            print('\n'.join(f"error: {line}" for line in str(e).splitlines()), file=sys.stderr)
        else:
            sys.__excepthook__(kind, e, tb)
    sys.excepthook = hook
