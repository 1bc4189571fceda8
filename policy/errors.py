"""`ModelSpecError`: a model the planner cannot describe (its root, `UserError`, is in base/)."""

from base.errors import UserError


class ModelSpecError(UserError, ValueError):
    """A model that cannot be described: unknown name, unreadable or unsupported config."""
