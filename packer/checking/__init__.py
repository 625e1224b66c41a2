"""Checking: reading a finished build and judging it: `verify` (and its steps), `inspect_` and the views
it returns. Reads only: re-runs the build's own functions where it must (`verify --source`), never writes."""
