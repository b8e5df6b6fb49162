"""The one exception type of `models/`: bad input, said in one line."""


class ModelError(ValueError):
    """A model spec, config or folder that cannot be built. The message is one line."""
