"""``gpu-agent``: run the agent, look at the node's devices, check config files.

Every user error ends in one line on stderr (``gpu-agent: error: ...``) and a non-zero
exit: 2 for a bad config or flag, 1 for anything else. No tracebacks for user errors, and no
boxed usage messages: :class:`OneLineErrors` turns click's usage errors (an unknown command or
flag, a bad value) into the same one line, with a pointer to ``--help``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import structlog
import typer
from typer.core import TyperGroup

from agent import __version__
from agent.base.errors import AgentError, ConfigError
from agent.base.logs import configure_logging
from agent.cli.cdi import cdi_app
from agent.cli.options import DriverRootOpt, HostDriverRootOpt
from agent.cli.run import PROG, collect_overrides, error_line, run_command
from agent.core.config.check import check_preset_flag
from agent.core.config.loader import build_config, env_overrides, load_config, read_document

if TYPE_CHECKING:
    from agent.core.config.schema import Config
    from agent.core.inventory.model import Inventory

#: the click that typer runs on (recent typer releases vendor their own copy)
_click_errors: Any = importlib.import_module(typer.BadParameter.__module__)


class OneLineErrors(TyperGroup):
    """The top-level command: click's errors become one line on stderr; help stays help."""

    def main(  # type: ignore[override]
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            result = super().main(args, prog_name or PROG, complete_var, standalone_mode=False, **extra)
            code = result if isinstance(result, int) else 0  # an Exit's code, or a command's return
        except _click_errors.NoArgsIsHelpError as exc:
            if exc.message:  # the help text (typer with rich has already printed it)
                typer.echo(exc.message)
            code = exc.exit_code
        except _click_errors.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else PROG
            typer.echo(error_line(f"{exc.format_message()} (see '{where} --help')"), err=True)
            code = exc.exit_code
        except _click_errors.ClickException as exc:
            typer.echo(error_line(exc.format_message()), err=True)
            code = exc.exit_code
        except typer.Abort:
            typer.echo(error_line("aborted"), err=True)
            code = 1
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    name=PROG,
    cls=OneLineErrors,
    help="A Kubernetes node agent serving NVIDIA GPUs through device plugins, DRA and CDI.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Work with config files.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(cdi_app, name="cdi")

log = structlog.get_logger("agent.cli")


def fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(error_line(message), err=True)
    return typer.Exit(code)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    try:
        yield
    except ConfigError as exc:
        raise fail(str(exc), 2) from None
    except AgentError as exc:
        raise fail(str(exc), 1) from None


# --- shared options --------------------------------------------------------------

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", help="Config file (the mounted ConfigMap).", envvar="GPU_AGENT_CONFIG", readable=False
    ),
]
BackendOpt = Annotated[str | None, typer.Option("--backend", help="auto | nvml | simulated (default auto).")]
SimulatedOpt = Annotated[bool, typer.Option("--simulated", help="Shorthand for --backend simulated.")]
PresetOpt = Annotated[str | None, typer.Option("--preset", help="Simulated node: a preset name or a YAML file.")]
NodeNameOpt = Annotated[str | None, typer.Option("--node-name", help="This node's name (default: $NODE_NAME).")]


def _parse_labels(labels: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--label: expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


# --- run ---------------------------------------------------------------------------


@app.command()
def run(
    config: ConfigOpt = None,
    backend: BackendOpt = None,
    simulated: SimulatedOpt = False,
    preset: PresetOpt = None,
    node_name: NodeNameOpt = None,
    kubelet_root: Annotated[
        Path | None,
        typer.Option(help="The kubelet's --root-dir (plugins_registry, plugins, pod-resources).", readable=False),
    ] = None,
    device_plugins_dir: Annotated[
        Path | None,
        typer.Option(
            help="The kubelet's device-plugins directory (default <kubelet-root>/device-plugins).", readable=False
        ),
    ] = None,
    cdi_root: Annotated[Path | None, typer.Option(help="CDI spec directory.", readable=False)] = None,
    state_dir: Annotated[Path | None, typer.Option(help="The agent's state directory.", readable=False)] = None,
    driver_root: DriverRootOpt = None,
    host_driver_root: HostDriverRootOpt = None,
    debug_addr: Annotated[str | None, typer.Option(help="Debug HTTP HOST:PORT (default 127.0.0.1:9477).")] = None,
    kubeconfig: Annotated[str | None, typer.Option(help="Kubeconfig file (default: in-cluster).")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug | info | warning | error.")] = None,
) -> None:
    """Run the agent until SIGTERM or SIGINT."""
    values = {
        "config": config,
        "backend": backend,
        "simulated": simulated,
        "preset": preset,
        "node_name": node_name,
        "paths__kubelet_root": kubelet_root,
        "paths__device_plugins_dir": device_plugins_dir,
        "paths__cdi_root": cdi_root,
        "paths__state_dir": state_dir,
        "paths__driver_root": driver_root,
        "paths__host_driver_root": host_driver_root,
        "debug_addr": debug_addr,
        "kubeconfig": kubeconfig,
        "log_level": log_level,
    }
    raise typer.Exit(run_command(values))


# --- inventory ---------------------------------------------------------------------


@app.command()
def inventory(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    config: ConfigOpt = None,
    backend: BackendOpt = None,
    simulated: SimulatedOpt = False,
    preset: PresetOpt = None,
    node_name: NodeNameOpt = None,
    driver_root: DriverRootOpt = None,
) -> None:
    """Print the devices the backend sees."""
    from agent.core.inventory.render import inventory_json, inventory_table

    configure_logging("warning")
    overrides = collect_overrides(
        backend=backend, simulated=simulated, preset=preset, node_name=node_name, paths__driver_root=driver_root
    )
    with user_errors():
        cfg = load_config(config, overrides).config
        check_preset_flag(preset, cfg)
        inv = asyncio.run(_read_inventory(cfg))
    if as_json:
        typer.echo(json.dumps(inventory_json(inv), indent=2))
    else:
        typer.echo(inventory_table(inv))


async def _read_inventory(cfg: Config) -> Inventory:
    """Open the configured backend, read the inventory once, close it."""
    from agent.backends.factory import open_backend
    from agent.core.config.node import resolve_node_name

    opened = await open_backend(cfg, node_name=resolve_node_name(cfg), wait_for_driver=False)
    try:
        return await opened.load()
    finally:
        await opened.close()


# --- version -----------------------------------------------------------------------


@app.command()
def version() -> None:
    """Print the agent's version."""
    typer.echo(f"gpu-agent {__version__} (python {sys.version.split()[0]})")


# --- config check ------------------------------------------------------------------


@config_app.command("check")
def config_check(
    file: Annotated[Path, typer.Argument(help="Config file to validate.")],
    node_name: Annotated[str, typer.Option("--node-name", help="Node to evaluate ownership for.")] = "",
    label: Annotated[list[str] | None, typer.Option("--label", "-l", help="Node label KEY=VALUE (repeatable).")] = None,
    simulated: SimulatedOpt = False,
    preset: PresetOpt = None,
) -> None:
    """Validate a config file and print the effective ownership for a node.

    The node is found as ``run`` finds it: ``--node-name``, ``GPU_AGENT_NODE_NAME``, the file's
    ``node_name``, ``NODE_NAME``, then the host name. ``--preset`` implies ``--simulated`` here:
    this command only ever simulates.
    """
    from agent.cli.config import describe_ownership
    from agent.core.config.node import resolve_node_name

    with user_errors():
        labels = _parse_labels(label or [])
        overrides: dict[str, Any] = {"node_labels": labels}
        overrides.update({k: v for k, v in env_overrides().items() if k == "node_name"})
        if node_name:
            overrides["node_name"] = node_name
        if simulated or preset:
            overrides["backend"] = "simulated"
            if preset:
                overrides["preset"] = preset
        cfg = build_config(read_document(file), overrides)
        typer.echo(f"{file}: valid")
        node = resolve_node_name(cfg)
        typer.echo(asyncio.run(describe_ownership(cfg, node_name=node, labels=labels)))


@config_app.command("plan")
def config_plan(
    file: Annotated[Path, typer.Argument(help="Config file to plan.")],
    node_name: NodeNameOpt = None,
    label: Annotated[list[str] | None, typer.Option("--label", "-l", help="Node label KEY=VALUE (repeatable).")] = None,
    debug_addr: Annotated[
        str | None, typer.Option(help="A running agent's debug HOST:PORT (default: the config's debug_addr).")
    ] = None,
    backend: BackendOpt = None,
    simulated: SimulatedOpt = False,
    preset: PresetOpt = None,
    driver_root: DriverRootOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show, per GPU, what applying FILE would move and what each move would wait for; applies nothing.

    Asks the agent running on this node (its debug endpoint) for the current owners, holders,
    inventory and labels; without one, plans against the local inventory.
    """
    from agent.core.ownership.plan import plan_against_inventory, plan_against_state
    from agent.observe.debug.client import AgentUnreachable, fetch_agent_state

    configure_logging("warning")
    with user_errors():
        labels = _parse_labels(label or [])
        overrides = collect_overrides(
            backend=backend,
            simulated=simulated,
            preset=preset,
            node_name=node_name,
            debug_addr=debug_addr,
            paths__driver_root=driver_root,
        )
        cfg = build_config(read_document(file), overrides)
        try:
            state = fetch_agent_state(cfg.debug_addr)
        except AgentUnreachable as exc:
            log.info("planning against the local inventory", reason=str(exc))
            from agent.core.config.node import resolve_node_name

            inv = asyncio.run(_read_inventory(cfg))
            plan = plan_against_inventory(cfg, inv, node_name=resolve_node_name(cfg), labels=labels)
        else:
            plan = plan_against_state(cfg, state, labels=labels)
        typer.echo(json.dumps(plan.as_dict(), indent=2) if as_json else plan.render())


@app.command()
def status(
    debug_addr: Annotated[
        str | None, typer.Option(help="The agent's debug HOST:PORT (default: the config's debug_addr).")
    ] = None,
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show the node's GPUs: owner, health, who holds each one and how busy it is (from the running agent)."""
    from agent.cli.status import render, rows_from_state, summary
    from agent.observe.debug.client import fetch_agent_state

    configure_logging("warning")
    with user_errors():
        cfg = load_config(config, collect_overrides(debug_addr=debug_addr)).config
        state = fetch_agent_state(cfg.debug_addr)
    rows = rows_from_state(state)
    if as_json:
        typer.echo(json.dumps(summary(state, rows), indent=2))
    else:
        typer.echo(render(state, rows))


def main() -> None:
    """Console entry point (``gpu-agent`` and ``python -m agent``)."""
    app()
