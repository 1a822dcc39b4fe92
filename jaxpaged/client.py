"""`python -m jaxpaged.client`: the command line lives in :mod:`jaxpaged.cli.client`."""

if __name__ == "__main__":
    import sys

    from jaxpaged.cli.client import main

    sys.exit(main())
