"""`python -m jaxpaged COMMAND`: the `jaxpaged` command (see :mod:`jaxpaged.cli.main`)."""

if __name__ == "__main__":
    import sys

    from jaxpaged.cli.main import main

    sys.exit(main())
