"""CLI verbs: each module has add_arguments(parser) and run(args) -> exit code."""
