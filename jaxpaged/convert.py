"""`python -m jaxpaged.convert`: the command line lives in :mod:`jaxpaged.cli.convert`."""

if __name__ == "__main__":
    import sys

    from jaxpaged.cli.convert import main

    sys.exit(main())
