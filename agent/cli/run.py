"""``gpu-agent run`` without the command-line library: the agent's own process never loads typer.

typer, with the click it runs on, costs about 1.2 MiB of resident memory (``docs/performance.md``,
Memory) in a process that reads its arguments once and then serves for weeks. So
``agent/__main__.py`` hands ``run`` straight to :func:`run_command` when :func:`parse_run_args`
understands every argument: the options of :data:`RUN_OPTIONS`, as ``--name VALUE``,
``--name=VALUE`` or ``-c VALUE``. Anything else (``--help``, an unknown option, a missing value,
a value that looks like an option) goes to the typer command line, which prints the help or its
one-line error exactly as for every other command. The typer ``run`` command calls
:func:`run_command` too, so there is one way to run the agent; ``tests/test_cli_run.py`` checks
that both take the same options.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

PROG = "gpu-agent"

log = structlog.get_logger("agent.cli")


def error_line(message: str) -> str:
    return f"{PROG}: error: {message}"


@dataclass(frozen=True, slots=True)
class RunOption:
    """One option of ``gpu-agent run``: its names, and the keyword :func:`collect_overrides` takes."""

    names: tuple[str, ...]
    dest: str
    is_flag: bool = False
    path: bool = False
    envvar: str | None = None


#: the options of ``gpu-agent run`` (help texts: ``agent/cli/main.py``, where typer shows them)
RUN_OPTIONS: tuple[RunOption, ...] = (
    RunOption(("--config", "-c"), "config", path=True, envvar="GPU_AGENT_CONFIG"),
    RunOption(("--backend",), "backend"),
    RunOption(("--simulated",), "simulated", is_flag=True),
    RunOption(("--preset",), "preset"),
    RunOption(("--node-name",), "node_name"),
    RunOption(("--kubelet-root",), "paths__kubelet_root", path=True),
    RunOption(("--device-plugins-dir",), "paths__device_plugins_dir", path=True),
    RunOption(("--cdi-root",), "paths__cdi_root", path=True),
    RunOption(("--state-dir",), "paths__state_dir", path=True),
    RunOption(("--driver-root",), "paths__driver_root", path=True),
    RunOption(("--host-driver-root",), "paths__host_driver_root", path=True),
    RunOption(("--debug-addr",), "debug_addr"),
    RunOption(("--kubeconfig",), "kubeconfig"),
    RunOption(("--log-level",), "log_level"),
)
_BY_NAME = {name: option for option in RUN_OPTIONS for name in option.names}


def parse_run_args(args: Sequence[str], env: Mapping[str, str]) -> dict[str, Any] | None:
    """The values of ``gpu-agent run ARGS``, keyed by :attr:`RunOption.dest`; None when anything is
    not plainly one of :data:`RUN_OPTIONS` (the typer command line then answers it)."""
    values: dict[str, Any] = {}
    i = 0
    while i < len(args):
        name, eq, inline = args[i].partition("=") if args[i].startswith("--") else (args[i], "", "")
        option = _BY_NAME.get(name)
        if option is None:
            return None
        if option.is_flag:
            if eq:
                return None
            values[option.dest] = True
        else:
            if not eq:
                i += 1
                if i == len(args):
                    return None
                inline = args[i]
            if inline.startswith("-"):  # click's reading of such a value is its own
                return None
            values[option.dest] = Path(inline) if option.path else inline
        i += 1  # a repeated option: the last one counts, as with click
    for option in RUN_OPTIONS:
        if option.envvar is not None and option.dest not in values and option.envvar in env:
            if not env[option.envvar]:
                return None
            values[option.dest] = Path(env[option.envvar]) if option.path else env[option.envvar]
    return values


def collect_overrides(**flags: Any) -> dict[str, Any]:
    """Environment overrides, then flags over them (flags win). ``None`` means "not given"."""
    from agent.core.config.loader import env_overrides

    overrides: dict[str, Any] = env_overrides()
    if flags.pop("simulated", False):
        overrides["backend"] = "simulated"
    for dotted, value in flags.items():
        if value is not None:
            overrides[dotted.replace("__", ".")] = str(value) if isinstance(value, Path) else value
    return overrides


def run_command(values: Mapping[str, Any]) -> int:
    """Run the agent until SIGTERM or SIGINT; the exit code (a user's error: one line on stderr)."""
    from agent.base.errors import AgentError, ConfigError
    from agent.base.logs import configure_logging
    from agent.core.config.check import check_preset_flag
    from agent.core.config.loader import load_config
    from agent.runtime import eventloop
    from agent.runtime.phase1 import RunOptions

    flags = dict(values)
    config: Path | None = flags.pop("config", None)
    overrides = collect_overrides(**flags)
    configure_logging(str(overrides.get("log_level", "info")))
    options = RunOptions(config_path=config, overrides=overrides)
    try:
        if flags.get("preset") is not None:
            check_preset_flag(flags["preset"], load_config(config, overrides).config)
        loop = eventloop.chosen()  # before the coroutine exists: choosing may be interrupted
        return eventloop.run(_run(options), loop=loop)
    except ConfigError as exc:
        print(error_line(str(exc)), file=sys.stderr, flush=True)
        return 2
    except AgentError as exc:
        print(error_line(str(exc)), file=sys.stderr, flush=True)
        return 1


async def _run(options: Any) -> int:
    """Run the agent under signal handling; 0 after a requested stop.

    A signal during start-up (NVML initialising, the first CDI spec, the API server) cancels the
    start-up, which unwinds what was built so far; once the agent runs, a signal sets ``stop``
    and the supervisor shuts down in order.
    """
    from agent.runtime.app import SHUTDOWN_TIMEOUT_S, run_agent

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals_seen: list[str] = []
    running = False
    deadline: list[asyncio.TimerHandle] = []

    def on_running(_agent: object) -> None:
        nonlocal running
        running = True

    agent_task = asyncio.create_task(run_agent(options, stop=stop, on_agent=on_running), name="agent")

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        signals_seen.append(name)
        if len(signals_seen) > 1:
            log.warning("second signal, exiting at once", signal=name)
            os._exit(1)
        log.info("signal received, shutting down", signal=name)
        stop.set()
        if not running:
            agent_task.cancel()
        # the ultimate deadline: a component that ignores cancellation cannot keep us alive
        deadline.append(loop.call_later(SHUTDOWN_TIMEOUT_S + 0.8, _hard_exit))

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await agent_task
    except asyncio.CancelledError:
        if not signals_seen:
            raise
        log.info("stopped during start-up")
    finally:
        for handle in deadline:
            handle.cancel()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    return 0


def _hard_exit() -> None:
    # name what held the shutdown up: the one line an operator (or a developer) needs
    stuck = []
    for task in asyncio.all_tasks():
        if task.done() or task is asyncio.current_task():
            continue
        frames = task.get_stack(limit=1)
        where = f"{frames[0].f_code.co_filename.rsplit('/', 2)[-1]}:{frames[0].f_lineno}" if frames else "?"
        stuck.append(f"{task.get_name()} at {where}")
    log.error("shutdown did not finish in time, exiting", still_running=sorted(stuck)[:20])
    logging.shutdown()
    os._exit(1)
