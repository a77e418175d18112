"""One module per subcommand; `main` is a thin dispatcher."""
