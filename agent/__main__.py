"""``python -m agent`` and the ``gpu-agent`` command (the console script calls :func:`main`)."""

import sys


def main() -> None:
    """Run the command line; a Ctrl-C before the agent has taken SIGINT over ends it quietly.

    Until ``gpu-agent run`` installs its own signal handlers (after its modules have loaded,
    which takes a few tenths of a second on a busy machine), SIGINT is Python's
    KeyboardInterrupt: exit 130, as a shell expects of an interrupted command, and no
    traceback. ``import agent`` itself (structlog, ~50 ms) comes before this function can run.
    """
    try:
        if sys.argv[1:2] == ["run"]:  # the agent itself: no command-line library (agent/cli/run.py)
            import os

            from agent.cli.run import parse_run_args, run_command

            values = parse_run_args(sys.argv[2:], os.environ)
            if values is not None:
                sys.exit(run_command(values))
        from agent.cli.main import main as cli_main

        cli_main()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
