"""`kdtree-orch`, the package's console entry: Invoke's Program over the package's own task
collection (Invoke's pattern for a distinct program), so it runs from anywhere without the checkout.
It offers only the core options that apply here, exits 2 on any parse error, and its version is the
installed package's."""
from __future__ import annotations

import sys
from importlib import metadata

from invoke import Argument, Program
from invoke.exceptions import ParseError

DISTRIBUTION = "kdtree-orchestrator"
# Invoke's core options that mean something for these tasks; the others (--pty, --echo, --hide,
# --prompt-for-sudo-password, --config, ...) configure Invoke's own `c.run`, which no task uses.
# Added: --inventory before the task (`kdtree-orch --inventory PATH hosts`).
CORE_OPTIONS = {"help", "version", "list", "complete", "print-completion-script"}


def version() -> str:
    """The installed distribution's version (package metadata); `unknown` when not installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


class KdProgram(Program):
    """Invoke's Program with only CORE_OPTIONS and --inventory offered, exit 2 on any parse error."""

    def core_args(self):
        inventory = Argument(names=("inventory",), help="the inventory file, for any task "
                             "(a task's own --inventory wins)")
        return [arg for arg in super().core_args() if arg.name in CORE_OPTIONS] + [inventory]

    def update_config(self, merge: bool = True) -> None:
        super().update_config(merge)
        if self.args.inventory.value:      # the tasks read it (tasks._inventory)
            self.config.update(kdtree={"inventory": self.args.inventory.value})

    def parse_core(self, argv) -> None:
        super().parse_core(argv)
        # Invoke turns bytecode writing off here (--write-pyc): the package's modules imported
        # later would be compiled from source on every run of an editable install. The
        # interpreter's own setting (-B, PYTHONDONTWRITEBYTECODE) still decides.
        sys.dont_write_bytecode = bool(sys.flags.dont_write_bytecode)

    def parse_core_args(self) -> None:
        try:
            super().parse_core_args()
        except ParseError as e:
            _usage_exit(e)
        # Program.run reads every core option's value: the ones not offered sit at their defaults.
        for arg in Program.core_args(self):     # (the unbound call: Invoke's full list)
            if arg.name not in self.args:
                self.core[0].add_arg(arg)

    def parse_tasks(self) -> None:
        try:
            super().parse_tasks()
        except ParseError as e:
            _usage_exit(e)


def _usage_exit(error: Exception) -> None:
    print(error, file=sys.stderr)
    sys.exit(2)


def main() -> None:
    """kdtree-orch: the orchestrator's tasks, from any directory."""
    from .tasks import namespace
    KdProgram(namespace=namespace, version=version(), name="kdtree-orch", binary="kdtree-orch").run()
