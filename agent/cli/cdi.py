"""``gpu-agent cdi generate`` and ``gpu-agent cdi check``.

The command functions only parse flags and print; the work is in :func:`render_device_plugin_spec`
and :func:`check_directory`, which tests call directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, TextIO

import typer

from agent.base.errors import AgentError, ConfigError
from agent.cdi import generate
from agent.cdi import spec as cdi_spec
from agent.cdi.discovery import DriverDiscovery
from agent.cdi.driversource import choose_driver_source
from agent.cdi.errors import CdiError, InvalidSpecError, SpecWriteError
from agent.cdi.hooks import HOOK_CANDIDATES
from agent.cdi.writer import atomic_write, read_spec_file, spec_files
from agent.cli.options import DriverRootOpt, HostDriverRootOpt
from agent.core.config.check import check_preset_flag
from agent.core.config.schema import CdiConfig, Config, PathsConfig
from agent.core.inventory.model import Inventory

DEFAULT_CDI_ROOT = PathsConfig().cdi_root

cdi_app = typer.Typer(
    help="CDI spec files: print this node's device plugin spec, or check a spec directory.",
    no_args_is_help=True,
    add_completion=False,
)


def render_device_plugin_spec(
    inventory: Inventory,
    *,
    driver_root: Path,
    host_driver_root: Path | None = None,
    hook_path: Path | None = None,
    kind: str = CdiConfig().device_plugin_kind,
    hook_candidates: Iterable[Path] = HOOK_CANDIDATES,
) -> str:
    """The device plugin spec of ``inventory`` as JSON text; CdiError when there is nothing to write.

    Files are looked at under ``driver_root``; the spec names them under ``host_driver_root``
    (None: the same), exactly as the agent's own specs do.
    """
    if not len(inventory):
        why = f" ({inventory.reason})" if inventory.reason else ""
        raise CdiError(f"this node has no GPUs{why}: there is no device plugin spec to generate")
    discovery = DriverDiscovery(
        driver_root, host_driver_root=host_driver_root, hook_path=hook_path, hook_candidates=hook_candidates
    )
    source = choose_driver_source(inventory.backend, discovery)
    driver = source.look(inventory)  # the same choice the agent makes: simulated GPUs may get env-only edits
    result = generate.device_plugin_spec(kind, inventory, driver)
    if result.spec is None:
        raise CdiError(f"no GPU of this node has its device nodes: {'; '.join(result.skipped)}")
    for skipped in result.skipped:
        print(f"warning: left out {skipped}", file=sys.stderr)
    return cdi_spec.dumps(result.spec)


def write_output(text: str, output: str, stdout: TextIO | None = None) -> None:
    """``output`` is a file (written atomically, 0644) or ``-`` for stdout."""
    if output == "-":
        (stdout or sys.stdout).write(text)
        return
    path = Path(output)
    if not path.parent.is_dir():
        raise SpecWriteError(f"cannot write {path}: directory {path.parent} does not exist")
    atomic_write(path, text.encode())


def check_directory(directory: Path) -> tuple[list[str], int, int]:
    """(one line per problem, files checked, devices defined) for every spec in ``directory``.

    Each file is parsed strictly and validated; a qualified name defined by two files is
    a conflict (the runtime then drops it from both).
    """
    if not directory.is_dir():
        return [f"{directory}: not a directory"], 0, 0
    problems: list[str] = []
    owners: dict[str, list[str]] = defaultdict(list)
    files = spec_files(directory)
    devices = 0
    for path in files:
        try:
            spec = read_spec_file(path)
        except InvalidSpecError as exc:
            problems.append(f"{path}: {exc}")
            continue
        found = cdi_spec.validate(spec)
        problems += [f"{path}: {p}" for p in found]
        if found:
            continue  # the runtime skips an invalid file, so its names cannot conflict
        devices += len(spec.devices)
        for name in spec.qualified_names():
            owners[name].append(path.name)
    for name, where in sorted(owners.items()):
        if len(where) > 1:
            problems.append(f"{directory}: conflict: {name} is defined in {', '.join(where)} (the runtime drops it)")
    return problems, len(files), devices


async def _load_inventory(config: Config) -> Inventory:
    from agent.backends.factory import open_backend  # type: ignore[import-not-found,unused-ignore]

    backend = await open_backend(config, wait_for_driver=False)
    try:
        inventory: Inventory = await backend.load()
    finally:
        await backend.close()
    return inventory


def _load_config(config_file: Path | None, overrides: dict[str, Any]) -> Config:
    from agent.core.config.loader import env_overrides, load_config

    merged: dict[str, Any] = {**env_overrides(), **overrides}
    return load_config(config_file, merged).config


@cdi_app.command("generate")
def generate_command(
    driver_root: DriverRootOpt = None,
    host_driver_root: HostDriverRootOpt = None,
    output: Annotated[str, typer.Option("--output", "-o", help="file to write atomically, or - for stdout")] = "-",
    config_file: Annotated[Path | None, typer.Option("--config", help="the agent's config file")] = None,
    backend: Annotated[str | None, typer.Option("--backend", help="auto, nvml or simulated")] = None,
    simulated: Annotated[bool, typer.Option("--simulated", help="shorthand for --backend simulated")] = False,
    preset: Annotated[str | None, typer.Option("--preset", help="simulated node: preset name or YAML file")] = None,
) -> None:
    """Print (or write) the device plugin CDI spec for this node."""
    overrides: dict[str, Any] = {}
    if driver_root is not None:
        overrides["paths.driver_root"] = str(driver_root)
    if host_driver_root is not None:
        overrides["paths.host_driver_root"] = str(host_driver_root)
    if simulated:
        overrides["backend"] = "simulated"
    elif backend is not None:
        overrides["backend"] = backend
    if preset is not None:
        overrides["preset"] = preset
    from agent.base.logs import configure_logging

    configure_logging("warning")  # the backend's start-up notes are not this command's output
    stdout = sys.stdout
    try:
        # the spec owns stdout: anything else printed meanwhile (log lines) goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            config = _load_config(config_file, overrides)
            check_preset_flag(preset, config)
            inventory = asyncio.run(_load_inventory(config))
            text = render_device_plugin_spec(
                inventory,
                driver_root=config.paths.driver_root,
                host_driver_root=config.paths.host_driver_root,
                hook_path=config.cdi.hook_path,
                kind=config.cdi.device_plugin_kind,
            )
        write_output(text, output, stdout)
    except AgentError as exc:
        typer.echo(f"gpu-agent: error: {exc}", err=True)
        raise typer.Exit(2 if isinstance(exc, ConfigError) else 1) from None


@cdi_app.command("check")
def check_command(
    directory: Annotated[Path, typer.Argument(help="the CDI spec directory")] = DEFAULT_CDI_ROOT,
) -> None:
    """Validate every spec in DIR (ours and others') and report name conflicts between files."""
    try:
        usable = directory.is_dir()
        reason = "not a directory"
    except OSError as exc:  # e.g. a parent directory this user may not search
        usable, reason = False, exc.strerror or str(exc)
    if not usable:
        typer.echo(f"gpu-agent: error: cannot check {directory}: {reason}", err=True)
        raise typer.Exit(1)
    problems, files, devices = check_directory(directory)
    for line in problems:
        typer.echo(line)
    if problems:
        raise typer.Exit(1)
    typer.echo(f"ok: {files} spec files, {devices} devices in {directory}")
