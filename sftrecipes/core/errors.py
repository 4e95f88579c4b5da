"""The project's one error type for input that cannot run, in a leaf module so that every other module can raise it
without importing a neighbour."""
import sys


class RecipeError(ValueError):
    """A recipe or command line that cannot run. Its message is one line: the key, what is wrong, the fix.

    The entry points (train.py, `python -m sftrecipes ...`) print it as `error: <message>` and exit 2."""


def say_error(message: object) -> None:
    """Print `error: <message>` to stderr as one write of the line with its newline. Every rank of a run that refuses
    says its line to the same pipe at the same moment; print() hands the text and its newline over in two writes, and
    two ranks' lines then came out glued together ("...resumeerror: ...resume" in CI). Python's stderr passes each
    write straight through and flushes at a newline, so the line reaches the pipe in one write(2), and one write of at
    most PIPE_BUF bytes (4096 on Linux) is never interleaved with another's (tests/run/test_lifecycle.py)."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
