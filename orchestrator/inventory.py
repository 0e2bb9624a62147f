"""The inventory: hosts.yaml loaded and validated into frozen Host and Project records.

hosts.yaml has four sections (docs/inventory.md): `project` (the engine's source dir,
sync excludes, commands and result files), `defaults` (merged under every host), `hosts` and
`groups`. Every problem is an InventoryError naming the file, the host and the key (exit code 2).
Selection (`--host` repeatable, `--group`, `--all`, or nothing for `local`) is `Inventory.select`.
"""
from __future__ import annotations

import dataclasses
import difflib
import posixpath
import re
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

import yaml

from .errors import InventoryError, UsageError
from .slurm import SLURM_KEYS
from . import steps

if TYPE_CHECKING:         # imported for a `scheduler: slurm` entry alone (Validator.slurm_request)
    from .slurm.entry import SlurmRequest

DEFAULT_HOST = "local"
# The one rule for every relative local path of an inventory (project.source, identity, known_hosts,
# a local host's remote_dir): it is relative to the folder of the inventory file that names it.
RELATIVE_RULE = "relative paths resolve against the inventory file's folder"
TIMEOUT_KEYS = ("connect", "keepalive", "lock") + steps.ORDER
DEFAULT_TIMEOUTS = {"connect": 10, "keepalive": 15, "lock": 30,     # then each step's
                    **{s.name: s.timeout for s in steps.STEPS.values() if s.timeout is not None}}
DEFAULT_PERSIST = 600.0     # seconds an idle warm connection is kept (ControlPersist)
MAX_PERSIST = 86400
TOP_KEYS = ("project", "defaults", "hosts", "groups")
PROJECT_KEYS = ("source", "excludes", "commands", "results", "compiled", "documentation", "bundle_tiers")
OPTIONAL_PROJECT_KEYS = ("compiled", "documentation", "bundle_tiers")
# The tier every host runs unless its `bundles:` (or --bundles) says otherwise: the bundles the
# project's bundles command writes by default. Without project.bundle_tiers it is every config of
# the expected manifest.
DEFAULT_TIER = "default"
# Every step reads one of these (optional: stress, bench_nightly; docs/inventory.md).
REQUIRED_COMMANDS = ("build", "build_key", "bundles", "bundles_key", "generate", "test", "bench", "tree_hash", "version")
GROUP_KEYS = ("description",)

MAX_NAME = 64           # host and group names (they name files and folders of the run)
MAX_VALUE = 1024        # any other string value
MAX_TIMEOUT = 7 * 86400     # seconds; also refuses .nan and .inf (.inf would mean no timeout)
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")
_ADDRESS = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]*|[0-9A-Fa-f:]*:[0-9A-Fa-f:.]+)\Z")
_JUMP_HOP = re.compile(r"(?:([A-Za-z0-9_][A-Za-z0-9_.-]*)@)?([A-Za-z0-9_][A-Za-z0-9_.-]*)(?::(\d{1,5}))?\Z")
_PATH = re.compile(r"[A-Za-z0-9 ._/+,:@=-]+\Z")
_COMMAND_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*\Z")
_ARCH = re.compile(r"(?:auto|sm_\d{2,3}[a-z]?)\Z")
_FINGERPRINT = re.compile(r"SHA256:[A-Za-z0-9+/]{43}\Z")
_SECRET_NAME = re.compile(r"[A-Z_][A-Z0-9_]*\Z")
RESERVED_ENV = frozenset("CUDA_HOME PATH PYTHON KD_BACKEND KD_ARCH KD_REBUILD HOME USER LOGNAME LANG LD_LIBRARY_PATH "
                         "KDTREE_STEP".split())

# remote_dir may never be one of these, nor a direct child of /home, nor shallower than 2 levels.
SYSTEM_DIRS = frozenset("""/ /bin /boot /dev /etc /home /lib /lib32 /lib64 /libx32 /media /mnt
/opt /proc /root /run /sbin /srv /sys /tmp /usr /var /usr/bin /usr/include /usr/lib /usr/lib64
/usr/local /usr/sbin /usr/share /usr/src /var/lib /var/log /var/tmp /var/cache /var/spool
/var/mail /var/www /usr/local/bin /usr/local/lib /usr/local/share""".split())
_UNDER_SYSTEM = ("/proc/", "/sys/", "/dev/", "/boot/", "/etc/", "/bin/", "/sbin/", "/lib/",
                 "/lib64/", "/usr/bin/", "/usr/sbin/", "/usr/lib/")


@dataclasses.dataclass(frozen=True)
class Host:
    """One deploy target, defaults merged. `remote_dir` is absolute (local: resolved)."""

    name: str
    transport: str                      # "ssh" | "local"
    remote_dir: str
    address: str | None = None          # ssh-config alias or hostname
    port: int | None = None
    user: str | None = None
    identity: str | None = None         # private key file (absolute)
    jump: str | None = None             # bastion(s), as ssh's ProxyJump: [user@]host[:port][,...]
    rsync_path: str | None = None       # rsync on the host when not on its PATH
    cuda_home: str | None = None
    python: str = "python3"
    arch: str = "auto"                  # sm_120, sm_90, ... or auto
    backend: str = "auto"               # auto | cpu | cuda
    gpus: int = 0                       # the GPU count doctor expects
    gpu_policy: str | tuple[int, ...] = "idle"   # idle | any | GPU indices (gpus.py)
    gpu_count: int = 1
    gpu_max_used_mib: int = 1024
    gpu_wait: float = 0
    groups: tuple[str, ...] = ()
    timeouts: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: MappingProxyType(dict(DEFAULT_TIMEOUTS)), hash=False)
    known_hosts: str | None = None      # the project known_hosts file (absolute)
    host_key: str | None = None         # a pinned SHA256 fingerprint
    secret_env: tuple[str, ...] = ()    # variables of the orchestrator's environment the steps get (stdin, redacted)
    persist: float = DEFAULT_PERSIST    # seconds a warm connection may stay idle (connectors/openssh.py); 0: none kept
    bundles: tuple[str, ...] = (DEFAULT_TIER,)  # the bundle tiers the host runs (project.bundle_tiers)
    slurm: SlurmRequest | None = None   # a `scheduler: slurm` entry: its request (from SLURM_KEYS and gpus)

    def timeout(self, name: str) -> float:
        """The timeout in seconds for a step (or connect/keepalive/lock)."""
        return self.timeouts[name]

    @property
    def is_local(self) -> bool:
        return self.transport == "local"

    @property
    def label(self) -> str:
        """How the host is shown to people: its name and where it is."""
        if self.is_local:
            return f"{self.name} (local)"
        where = f"{self.user}@{self.address}" if self.user else self.address
        return f"{self.name} ({where}{':' + str(self.port) if self.port else ''})"


@dataclasses.dataclass(frozen=True)
class Project:
    """The engine project: what is synced (source, excludes), what runs (commands), results."""

    root: Path                          # the repo root: the inventory file's folder
    source: Path                        # absolute
    excludes: tuple[str, ...]
    commands: Mapping[str, str]
    results: Mapping[str, str]
    # the source paths (a folder: with a trailing /) that reach test and bench results only through
    # the built executables: an edit there that leaves the executables identical reuses them
    compiled: tuple[str, ...] = ()
    # the paths that no command reads (notes, experiments' records): an edit there reuses every result
    documentation: tuple[str, ...] = ()
    # tier -> the configs of its bundles (a host's `bundles:` names tiers); None: every config of
    # the expected manifest
    bundle_tiers: Mapping[str, tuple[str, ...] | None] = dataclasses.field(
        default_factory=lambda: MappingProxyType({DEFAULT_TIER: None}), hash=False)


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    description: str
    members: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Inventory:
    """A loaded hosts.yaml."""

    path: Path
    project: Project
    hosts: Mapping[str, Host]
    groups: Mapping[str, Group]

    def select(self, hosts=(), group: str | None = None, all: bool = False) -> list[Host]:
        """Hosts chosen by --host (repeatable), --group, --all; no flag means `local`. A flag
        that selects no host is a UsageError naming it (never a silent fall-back to `local`)."""
        if all:
            if not self.hosts:
                raise UsageError(f"--all: {self.path} has no hosts")
            return list(self.hosts.values())
        names = list(hosts)
        if group is not None:
            if group not in self.groups:
                raise InventoryError(self.path, f"unknown group {group!r}{_did_you_mean(group, self.groups)}")
            if not self.groups[group].members:
                raise UsageError(f"--group {group}: no host of {self.path} is in group {group!r} "
                                 "(a host joins it with `groups: [" + group + "]`)")
            names += list(self.groups[group].members)
        elif not names:
            names = [DEFAULT_HOST]
        for name in names:
            if name not in self.hosts:
                raise InventoryError(self.path, f"unknown host {name!r}{_did_you_mean(name, self.hosts)}")
        return [self.hosts[name] for name in dict.fromkeys(names)]


def load(path) -> Inventory:
    """Read and validate hosts.yaml at `path` (a relative `path`: from the current directory)."""
    path = Path(path).absolute()
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except OSError as e:
        raise InventoryError(path, f"cannot read: {e.strerror}") from None
    except _DuplicateKey as e:
        raise InventoryError(path, str(e)) from None
    except yaml.YAMLError as e:
        raise InventoryError(path, f"not valid YAML: {e}") from None
    return parse(data, path)


class _DuplicateKey(yaml.YAMLError):
    """A mapping of the inventory names one key twice (PyYAML would keep the last silently)."""


try:                            # libyaml's parser when PyYAML has it (the inventory is read every run)
    from yaml import CSafeLoader as _SafeLoader
except ImportError:
    from yaml import SafeLoader as _SafeLoader       # type: ignore[assignment]


class _UniqueKeyLoader(_SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:           # an unhashable key: PyYAML's own error follows
                continue
            if first != key_node.start_mark.line + 1:
                raise _DuplicateKey(f"line {key_node.start_mark.line + 1}: key {key!r} given twice "
                                    f"(first on line {first}); remove one")
        return super().construct_mapping(node, deep)


def parse(data: Any, path: Path) -> Inventory:
    """Validate the parsed YAML document `data` of the inventory file `path`."""
    v = _Validator(path)
    data = v.mapping(data, None, None, "the inventory")
    v.known_keys(data, TOP_KEYS, None)
    root = path.parent
    project = v.project(v.mapping(data.get("project"), None, "project", "a mapping"), root)
    v.tiers = tuple(project.bundle_tiers)
    defaults = v.mapping(data.get("defaults", {}), "defaults", None, "a mapping")
    hosts_data = v.mapping(data.get("hosts"), None, "hosts", "a mapping of host names")
    groups_data = v.mapping(data.get("groups", {}), None, "groups", "a mapping")
    for key in SLURM_KEYS:
        if key in defaults:
            v.fail("defaults", key, "is a key of a `scheduler: slurm` host entry, not of defaults")
    v.known_keys(defaults, HOST_KEYS, "defaults")
    hosts = {}
    for name, entry in hosts_data.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise InventoryError(path, "a host name may use letters, digits, '_', '.', '-' and may not start with '-'",
                                 host=str(name))
        if len(name) > MAX_NAME:
            raise InventoryError(path, f"a host name is at most {MAX_NAME} characters, not {len(name)}",
                                 host=name[:MAX_NAME] + "...")
        entry = v.mapping(entry if entry is not None else {}, name, None, "a mapping")
        hosts[name] = v.host(name, {**defaults, **entry, "timeouts": {
            **v.mapping(defaults.get("timeouts", {}), "defaults", "timeouts", "a mapping"),
            **v.mapping(entry.get("timeouts", {}), name, "timeouts", "a mapping")}}, root)
    groups = v.groups(groups_data, hosts)
    return Inventory(path, project, MappingProxyType(hosts), MappingProxyType(groups))


def is_dangerous_dir(path: str) -> str | None:
    """Why `path` may never be a deploy destination (rsync --delete target), or None."""
    norm = posixpath.normpath(path)
    if not path.strip():
        return "is empty"
    if not posixpath.isabs(path):
        return "is not absolute"
    if norm in SYSTEM_DIRS or norm.startswith(_UNDER_SYSTEM):
        return "is a system directory"
    if norm != path.rstrip("/") or "//" in path:
        return f"is not normalized (use {norm!r})"
    if norm.count("/") < 2:
        return "is too shallow (at least two levels, e.g. /srv/kdtree)"
    if posixpath.dirname(norm) == "/home":
        return "is a home directory"
    return None


def path_problem(value: str) -> str | None:
    """Why `value` may not be a path an inventory could hold (also for paths given on the command
    line, such as check-bundle's): empty, a newline, a leading '-', too long, unsafe characters."""
    if not value:
        return "is empty"
    if value.startswith("-"):
        return "must not start with '-'"
    if len(value) > MAX_VALUE:
        return f"must be at most {MAX_VALUE} characters, not {len(value)}"
    if not _PATH.match(value):
        return "is not a safe path (letters, digits, space and ._/+,:@=- only)"
    return None


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(choices)) or 'none'})"


class _Validator:
    """Checks one inventory file; raises InventoryError naming the file, host and key."""

    def __init__(self, file: Path):
        self.file = file
        self.tiers: tuple[str, ...] = (DEFAULT_TIER,)     # the project's bundle tiers, once read

    def fail(self, host, key, problem):
        raise InventoryError(self.file, problem, host=host, key=key)

    def mapping(self, value, host, key, what):
        if not isinstance(value, dict):
            self.fail(host, key, f"must be {what}, not {_type(value)}")
        return value

    def known_keys(self, entry, allowed, host, key=None):
        for k in entry:
            if k not in allowed:
                hint = _did_you_mean(str(k), allowed)
                self.fail(host, f"{key}.{k}" if key else str(k), f"unknown key{hint}")

    def string(self, value, host, key, pattern=None, what="") -> str:
        if not isinstance(value, str):
            self.fail(host, key, f"must be a string, not {_type(value)}")
        if not value:
            self.fail(host, key, "must not be empty")
        if "\n" in value or "\r" in value or "\0" in value:
            self.fail(host, key, "must not contain a newline")
        if value.startswith("-"):
            self.fail(host, key, "must not start with '-'")
        if len(value) > MAX_VALUE:
            self.fail(host, key, f"must be at most {MAX_VALUE} characters, not {len(value)}")
        if pattern is not None and not pattern.match(value):
            self.fail(host, key, f"{value!r} is not {what}")
        return value

    def path(self, value, host, key, base: Path | None = None) -> str:
        """A path value: safe characters; local paths (base given) made absolute."""
        self.string(value, host, key)
        if base is not None:
            value = str((base / Path(value).expanduser()).resolve())
        if not _PATH.match(value):
            self.fail(host, key, f"{value!r} is not a safe path (letters, digits, space and ._/+,:@=- only)")
        return value

    def integer(self, value, host, key, low, high) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(host, key, f"must be an integer, not {_type(value)}")
        if not low <= value <= high:
            self.fail(host, key, f"must be between {low} and {high}, not {value}")
        return value

    def choice(self, value, host, key, choices) -> str:
        if value not in choices:
            self.fail(host, key, f"must be one of {', '.join(choices)}, not {value!r}")
        return value

    def project(self, data, root: Path) -> Project:
        self.known_keys(data, PROJECT_KEYS, None, "project")
        for key in PROJECT_KEYS:
            if key not in data and key not in OPTIONAL_PROJECT_KEYS:
                self.fail(None, f"project.{key}", "is missing")
        given = self.path(data["source"], None, "project.source")
        source = root / given
        if not source.is_dir():
            rule = "" if Path(given).is_absolute() else \
                f" ({given!r} is relative: {RELATIVE_RULE}, {root})"
            self.fail(None, "project.source", f"{source} is not a directory{rule}")
        excludes = data["excludes"]
        if not isinstance(excludes, list):
            self.fail(None, "project.excludes", f"must be a list, not {_type(excludes)}")
        excludes = tuple(self.string(x, None, "project.excludes") for x in excludes)
        commands = self.mapping(data["commands"], None, "project.commands", "a mapping of name to command")
        for name, snippet in commands.items():
            if not isinstance(name, str) or not _COMMAND_NAME.match(name):
                self.fail(None, f"project.commands.{name}", "is not a command name")
            if not isinstance(snippet, str) or not snippet.strip():
                self.fail(None, f"project.commands.{name}", "must be a non-empty string")
        for name in REQUIRED_COMMANDS:
            if name not in commands:
                self.fail(None, f"project.commands.{name}", "is missing")
        results = self.mapping(data["results"], None, "project.results", "a mapping of name to path")
        for name, rel in results.items():
            self.path(rel, None, f"project.results.{name}")
            if posixpath.isabs(rel) or ".." in rel.split("/"):
                self.fail(None, f"project.results.{name}", "must be a path inside the deployed tree")
        left_out = {key: self.tree_paths(data.get(key, []), f"project.{key}") for key in ("compiled", "documentation")}
        return Project(root, source, excludes, MappingProxyType(dict(commands)), MappingProxyType(dict(results)),
                       **left_out, bundle_tiers=self.bundle_tiers(data.get("bundle_tiers")))

    def bundle_tiers(self, data: Any) -> Mapping[str, tuple[str, ...] | None]:
        """project.bundle_tiers: tier name -> list of config names; it must name the default tier."""
        if data is None:
            return MappingProxyType({DEFAULT_TIER: None})
        key = "project.bundle_tiers"
        self.mapping(data, None, key, "a mapping of tier name to a list of config names")
        if DEFAULT_TIER not in data:
            self.fail(None, key, f"must name the tier {DEFAULT_TIER!r} (what a host runs without `bundles:`)")
        tiers = {}
        for tier, configs in data.items():
            self.string(tier, None, key, _NAME, "a tier name (letters, digits, '_', '.', '-')")
            if not isinstance(configs, list) or not configs:
                self.fail(None, f"{key}.{tier}", f"must be a non-empty list of config names, not {_type(configs)}")
            tiers[tier] = tuple(self.string(c, None, f"{key}.{tier}", _NAME, "a config name") for c in configs)
        return MappingProxyType(tiers)

    def tree_paths(self, paths: Any, key: str) -> tuple[str, ...]:
        """A list of paths inside the source tree (`key` names it in errors)."""
        if not isinstance(paths, list):
            self.fail(None, key, f"must be a list, not {_type(paths)}")
        for rel in paths:
            self.path(rel, None, key)
            if posixpath.isabs(rel) or ".." in rel.split("/"):
                self.fail(None, key, f"{rel!r} must be a path inside the source tree")
        return tuple(paths)

    def slurm_request(self, name: str, entry: dict, transport: str) -> tuple[SlurmRequest, int] | None:
        """A `scheduler: slurm` entry's request and GPU count (slurm/entry.py); None for an entry
        without Slurm's keys (most: the module is imported only for one that has some, start-up time)."""
        if not any(key in entry for key in SLURM_KEYS):
            return None
        from .slurm import entry as slurm_entry
        return slurm_entry.request(self, name, entry, transport, MAX_TIMEOUT)

    def host(self, name: str, entry: dict, root: Path) -> Host:
        self.known_keys(entry, HOST_KEYS + SLURM_KEYS, name)
        transport = self.choice(entry.get("transport", "ssh"), name, "transport", ("ssh", "local"))
        slurm = self.slurm_request(name, entry, transport)
        values: dict[str, Any] = {"name": name, "transport": transport}
        if "remote_dir" not in entry:
            self.fail(name, "remote_dir", "is missing")
        remote_dir = self.path(entry["remote_dir"], name, "remote_dir")
        if transport == "local" and not posixpath.isabs(remote_dir):
            remote_dir = str((root / remote_dir).resolve())
        elif not posixpath.isabs(remote_dir):
            self.fail(name, "remote_dir", f"{remote_dir!r} must be absolute on an ssh host")
        danger = is_dangerous_dir(remote_dir)
        if danger:
            self.fail(name, "remote_dir", f"{remote_dir!r} {danger}; refusing to deploy there")
        values["remote_dir"] = remote_dir
        if transport == "ssh":
            if "address" not in entry:
                self.fail(name, "address", "is missing (an ssh-config alias or a hostname)")
            values["address"] = self.string(entry["address"], name, "address", _ADDRESS, "a hostname or ssh-config alias")
        elif "address" in entry:
            values["address"] = self.string(entry["address"], name, "address", _ADDRESS, "a hostname")
        if "port" in entry:
            values["port"] = self.integer(entry["port"], name, "port", 1, 65535)
        if "user" in entry:
            values["user"] = self.string(entry["user"], name, "user", _NAME, "a user name")
        if "identity" in entry:
            values["identity"] = self.path(entry["identity"], name, "identity", root)
        if "jump" in entry:
            jump = self.string(entry["jump"], name, "jump")
            for hop in jump.split(","):
                m = _JUMP_HOP.match(hop)
                if not m or (m.group(3) and not 1 <= int(m.group(3)) <= 65535):
                    self.fail(name, "jump", f"{hop!r} is not [user@]host[:port]")
            values["jump"] = jump
        for key in ("rsync_path", "cuda_home"):
            if key in entry:
                values[key] = self.path(entry[key], name, key)
                if not posixpath.isabs(values[key]):
                    self.fail(name, key, f"{values[key]!r} must be an absolute path")
        if "python" in entry:
            values["python"] = self.path(entry["python"], name, "python")
        if "arch" in entry:
            values["arch"] = self.string(entry["arch"], name, "arch", _ARCH, "auto or sm_NN (e.g. sm_120)")
        if "backend" in entry:
            values["backend"] = self.choice(entry["backend"], name, "backend", ("auto", "cpu", "cuda"))
        if slurm is not None:
            values["slurm"], values["gpus"] = slurm
        elif "gpus" in entry:
            values["gpus"] = self.integer(entry["gpus"], name, "gpus", 0, 1024)
        values.update(self.gpu_selection(name, entry))
        if "groups" in entry:
            groups = entry["groups"]
            if not isinstance(groups, list):
                self.fail(name, "groups", f"must be a list, not {_type(groups)}")
            values["groups"] = tuple(self.string(g, name, "groups", _NAME, "a group name") for g in groups)
            if any(len(g) > MAX_NAME for g in values["groups"]):
                self.fail(name, "groups", f"a group name is at most {MAX_NAME} characters")
        values["timeouts"] = MappingProxyType(self.timeouts(name, entry.get("timeouts", {})))
        values["known_hosts"] = self.path(entry.get("known_hosts", "known_hosts"), name, "known_hosts", root)
        if "secret_env" in entry:
            names = entry["secret_env"]
            if not isinstance(names, list):
                self.fail(name, "secret_env", f"must be a list of environment variable names, not {_type(names)}")
            for var in names:
                self.string(var, name, "secret_env", _SECRET_NAME, "an environment variable name (A-Z, 0-9, _)")
                if var in RESERVED_ENV:
                    self.fail(name, "secret_env", f"{var!r} is set by the orchestrator itself")
            values["secret_env"] = tuple(dict.fromkeys(names))
        if "persist" in entry:
            values["persist"] = self.persist(entry["persist"], name)
        if "bundles" in entry:
            values["bundles"] = self.tier_list(entry["bundles"], name)
        if "host_key" in entry:
            values["host_key"] = self.string(entry["host_key"], name, "host_key", _FINGERPRINT,
                                             "a SHA256 fingerprint (SHA256: and 43 base64 characters)")
        return Host(**values)

    def tier_list(self, value, name) -> tuple[str, ...]:
        """A host's `bundles`: a non-empty list of tiers of project.bundle_tiers, each once."""
        if not isinstance(value, list) or not value:
            self.fail(name, "bundles", f"must be a non-empty list of bundle tiers, not {_type(value)}")
        known = self.tiers
        for tier in value:
            if tier not in known:
                self.fail(name, "bundles", f"unknown bundle tier {tier!r}{_did_you_mean(str(tier), known)} "
                                           "(tiers are declared in project.bundle_tiers)")
        if len(set(value)) != len(value):
            self.fail(name, "bundles", "names a tier twice")
        return tuple(value)

    def persist(self, value, name) -> float:
        """`persist`: false (no warm connection), true (the default idle bound) or seconds."""
        if value is False:
            return 0.0
        if value is True:
            return DEFAULT_PERSIST
        if not isinstance(value, (int, float)) or not 1 <= value <= MAX_PERSIST:
            self.fail(name, "persist", f"must be false, true or a number of idle seconds from 1 to {MAX_PERSIST}, not {value!r}")
        return float(value)

    def gpu_selection(self, name, entry) -> dict:
        """gpu_policy (idle, any or a list of GPU indices), gpu_count, gpu_max_used_mib, gpu_wait."""
        values: dict[str, Any] = {}
        if "gpu_policy" in entry:
            policy = entry["gpu_policy"]
            if isinstance(policy, list):
                for index in policy:
                    self.integer(index, name, "gpu_policy", 0, 1023)
                if not policy or len(set(policy)) != len(policy):
                    self.fail(name, "gpu_policy", "a list of GPU indices must name at least one GPU, each once")
                values["gpu_policy"] = tuple(policy)
            elif policy in ("idle", "any"):
                values["gpu_policy"] = policy
            else:
                self.fail(name, "gpu_policy", f"must be idle, any or a list of GPU indices (e.g. [0, 3]), not {policy!r}")
        if "gpu_count" in entry:
            values["gpu_count"] = self.integer(entry["gpu_count"], name, "gpu_count", 1, 1024)
        if "gpu_max_used_mib" in entry:
            values["gpu_max_used_mib"] = self.integer(entry["gpu_max_used_mib"], name, "gpu_max_used_mib", 0, 1 << 30)
        if "gpu_wait" in entry:
            wait = entry["gpu_wait"]
            if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 86400:
                self.fail(name, "gpu_wait", f"must be a number of seconds from 0 to 86400, not {wait!r}")
            values["gpu_wait"] = wait
        return values

    def timeouts(self, name, data) -> dict:
        self.known_keys(data, TIMEOUT_KEYS, name, "timeouts")
        merged = dict(DEFAULT_TIMEOUTS)
        for key, value in data.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                self.fail(name, f"timeouts.{key}", f"must be a positive number of seconds, not {value!r}")
            if not value <= MAX_TIMEOUT:        # also NaN
                self.fail(name, f"timeouts.{key}", f"must be finite and at most {MAX_TIMEOUT} seconds, not {value!r}")
            merged[key] = value
        return merged

    def groups(self, data, hosts) -> dict:
        for group in data:
            if not isinstance(group, str) or not _NAME.match(group) or len(group) > MAX_NAME:
                self.fail(None, f"groups.{str(group)[:MAX_NAME]}", f"is not a group name (letters, digits, '_', '.', "
                                                                   f"'-', at most {MAX_NAME} characters)")
        for host in hosts.values():
            for group in host.groups:
                if group not in data:
                    self.fail(host.name, "groups", f"group {group!r} is not declared under `groups:`"
                              f"{_did_you_mean(group, data)}")
        names = set(data)
        groups = {}
        for group in sorted(names):
            entry = data.get(group) or {}
            self.mapping(entry, None, f"groups.{group}", "a mapping")
            self.known_keys(entry, GROUP_KEYS, None, f"groups.{group}")
            members = tuple(h.name for h in hosts.values() if group in h.groups)
            groups[group] = Group(group, str(entry.get("description", "")), members)
        return groups


# The keys of a host entry (and of `defaults`): the Host fields but its name and the Slurm request,
# whose keys (SLURM_KEYS) only a host entry may give.
HOST_KEYS = tuple(f.name for f in dataclasses.fields(Host) if f.name not in ("name", "slurm"))


def _type(value) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "empty"}.get(type(value), type(value).__name__)
