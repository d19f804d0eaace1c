"""The apps: the command line, ``fedray compare``, the progress display and the UI launcher."""
