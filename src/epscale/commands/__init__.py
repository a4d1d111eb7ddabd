"""The ``epscale`` subcommands, one module each: ``configure_parser(parser)`` and
``run(args) -> int``. ``epscale.cli`` imports a command's module only when it runs.

Commands hold the command-line glue (options, tables, plots, exit codes); what they do
lives in the library packages (``training``, ``launch``, ``plan``, ``tune``, ``monitor``, ...).
"""
