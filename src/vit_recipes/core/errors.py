"""The one exception type a user sees as a single line (see run_image_classification.py)."""


class RecipeError(Exception):
    """A problem with the user's input: the message names the problem and the fix."""


def first_line(err: BaseException, limit: int = 300) -> str:
    """An exception's first non-empty line (its type's name when it has none), for a one-line message."""
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)[:limit]
