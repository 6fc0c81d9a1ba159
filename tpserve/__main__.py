"""`python -m tpserve ...` runs the tpserve command line (the same as the `tpserve` script)."""
from tpserve.daemon.cli import main

if __name__ == "__main__":
    main(prog_name="tpserve")
