"""Command-line entry points: `kvtierd` (and later `kvtierctl`)."""
