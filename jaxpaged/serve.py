"""`python -m jaxpaged.serve`: the command line lives in :mod:`jaxpaged.cli.serve`."""

if __name__ == "__main__":
    import sys

    from jaxpaged.cli.serve import main

    sys.exit(main())
