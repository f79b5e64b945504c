"""The one exception type a user sees as a single line (see run_image_classification.py)."""


class RecipeError(Exception):
    """A problem with the user's input: the message names the problem and the fix."""
