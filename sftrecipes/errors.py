"""The project's one error type for input that cannot run, in a leaf module so that every other module can raise it
without importing a neighbour."""


class RecipeError(ValueError):
    """A recipe or command line that cannot run. Its message is one line: the key, what is wrong, the fix.

    The entry points (train.py, `python -m sftrecipes ...`) print it as `error: <message>` and exit 2."""
