"""The one exception type for errors a user can cause; the CLI prints it without a traceback."""


class KilnError(Exception):
    """A user-facing error: bad config, bad data, bad path. The message names what and where."""
