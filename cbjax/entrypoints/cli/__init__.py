"""`cbjax`: the command line, one module per command."""
