"""graphpipe placeholder; the real package docstring comes with the public API."""
