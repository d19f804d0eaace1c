"""The error a user fixes in their config. Its own module so every part of fedray can raise it
without importing the config machinery."""


class ConfigError(ValueError):
    """A config value a user has to fix. The message is one line."""
