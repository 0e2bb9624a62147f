"""kdtree orchestrator tasks: `invoke --list`, `invoke --help deploy`.

Every task takes --inventory (default: hosts.yaml beside this file); host tasks take --host NAME
(repeatable), --group NAME or --all; no selection means the host `local`.
Exit codes: 0 ok, 1 a host failed, 2 usage or inventory error.
"""
from invoke import Exit, task

from orchestrator import cli
from orchestrator.console import Console

SELECT_HELP = {"host": "a host of the inventory (repeatable)", "group": "every host of a group",
               "all": "every host", "inventory": "the inventory file (default: hosts.yaml here)"}


@task(help={"inventory": SELECT_HELP["inventory"]})
def hosts(c, inventory=None):
    """List the inventory's hosts and groups."""
    with cli.exit_codes():
        inv, _ = cli.load_selection(inventory)
        raise Exit(code=cli.hosts_table(inv, Console()))


@task(iterable=["host"], help=SELECT_HELP)
def doctor(c, host=None, group=None, all=False, inventory=None):
    """Check the selected hosts: reachable, auth, rsync, nvcc, GPU and arch, disk, python+numpy."""
    with cli.exit_codes():
        _, selected = cli.load_selection(inventory, host, group, all)
        raise Exit(code=cli.doctor(selected, Console()))


@task(iterable=["fingerprint"], help={"host": "the host whose key to pin", "inventory": SELECT_HELP["inventory"],
                                      "fingerprint": "the SHA256:... fingerprint you expect (repeatable)"})
def trust(c, host, fingerprint=None, inventory=None):
    """Show a host's SSH key fingerprint and pin it in the project known_hosts file."""
    with cli.exit_codes():
        _, (selected,) = cli.load_selection(inventory, [host])
        raise Exit(code=cli.trust(selected, fingerprint or [], Console()))


@task(iterable=["host"], help={**SELECT_HELP, "dry_run": "print the commands that would run; change nothing"})
def deploy(c, host=None, group=None, all=False, inventory=None, dry_run=False):
    """Sync the engine source to the selected hosts (rsync --delete, verified by tree hash)."""
    with cli.exit_codes():
        inv, selected = cli.load_selection(inventory, host, group, all)
        raise Exit(code=cli.deploy(inv, selected, Console(), dry_run))
