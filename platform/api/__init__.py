"""The author API: what an algorithm module imports (see :mod:`fedray.platform.api` exports)."""
