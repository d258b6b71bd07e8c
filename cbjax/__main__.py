"""`python -m cbjax ...`: the same as the `cbjax` command."""

from cbjax.entrypoints.cli.main import main

if __name__ == "__main__":
    main()
