"""`python -m jaxpaged.serve`: the command line lives in :mod:`jaxpaged.cli.serve`."""

if __name__ == "__main__":
    import os
    import sys

    import jaxpaged
    from jaxpaged.cli.checkout_path import drop_checkout_root

    drop_checkout_root(os.path.dirname(os.path.dirname(jaxpaged.__file__)))
    from jaxpaged.cli.serve import main

    sys.exit(main())
