"""`UserError`: the root of every error caused by input (a flag, a file, a request), not a bug."""


class UserError(Exception):
    """Bad input from a user, a file or a config. The CLI prints it as one line (exit 2)."""
