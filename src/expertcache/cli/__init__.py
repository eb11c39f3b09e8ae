"""The ``expertcache`` command-line tool. Each sub-command lives in its own module of this package."""
