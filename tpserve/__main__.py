"""`python -m tpserve ...` runs the tpserve command line (the same as the `tpserve` script)."""
from tpserve.cli.main import main

if __name__ == "__main__":
    main(prog_name="tpserve")
