"""The `tpserve` command line (main.py) and its engine options (options.py)."""
