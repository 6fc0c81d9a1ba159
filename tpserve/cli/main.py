"""`tpserve` command line: start/serve/stop/status the daemon, generate through it, profile it, make keys.

Every option can also come from the environment as ``TPSERVE_<OPTION>`` (e.g. TPSERVE_MODEL,
TPSERVE_RUNTIME_DIR, TPSERVE_ADDRESS). Bad values exit with status 2 and name the option;
operational failures (no daemon, daemon refused a request) exit with status 1.

The commands live by concept, and a command's module is imported only when it runs (or its own
--help is asked for): daemon_cmds.py (start, serve: the engine, the server and the fronts),
control_cmds.py (stop, status) and client_cmds.py (generate, profile, keys). So `tpserve --help`,
`status`, `stop` and `generate` load no engine, torch or server module; tests/test_cli_light.py
runs them with those packages blocked.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple

import click

from tpserve.cli.common import CONTEXT


class CommandRef(NamedTuple):
    module: str
    summary: str  # the first paragraph of the command's docstring (a test keeps them equal)


COMMANDS = {
    "start": CommandRef("tpserve.cli.daemon_cmds",
                        "Start the daemon in the background and wait until it is ready."),
    "serve": CommandRef("tpserve.cli.daemon_cmds",
                        "Run the daemon in the foreground (for torchrun and service managers)."),
    "stop": CommandRef("tpserve.cli.control_cmds",
                       "Stop the daemon: SIGTERM (a drain: requests in flight finish for up to its "
                       "--shutdown-grace, new ones are refused), then SIGKILL of its whole process tree "
                       "when it does not exit."),
    "status": CommandRef("tpserve.cli.control_cmds",
                         "Show the running daemon's model, load and KV-cache use (asks the daemon itself)."),
    "generate": CommandRef("tpserve.cli.client_cmds",
                           "Send PROMPT ('-' reads standard input) to the daemon and print the completion "
                           "as it streams."),
    "profile": CommandRef("tpserve.cli.client_cmds",
                          "Record a torch profiler trace of every rank while the daemon serves."),
    "keys": CommandRef("tpserve.cli.client_cmds", "Generate a CurveZMQ key pair into DIRECTORY."),
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use; its help lists them from COMMANDS."""

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, cmd_name):
        ref = COMMANDS.get(cmd_name)
        if ref is None:
            return None
        return getattr(importlib.import_module(ref.module), cmd_name)

    def format_commands(self, ctx, formatter):
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = [(n, click.Command(n, help=COMMANDS[n].summary).get_short_help_str(limit)) for n in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings=CONTEXT)
def main():
    """tpserve: a tensor-parallel LLM serving daemon.

    Start a daemon with `tpserve start --model DIR`, send it prompts with
    `tpserve generate "..."` (or the Python `tpserve.Client`), watch it with `tpserve status`
    and stop it with `tpserve stop`. By default the daemon listens on an ipc socket in the
    runtime dir ($TPSERVE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/tpserve, else ~/.tpserve).
    """


if __name__ == "__main__":  # pragma: no cover
    main()
