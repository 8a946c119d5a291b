"""Every environment variable Regent reads, in one place: its name, type, default and meaning.

Each variable is declared once below as a `Setting`; code reads it only through that declaration
(`settings.REGENT_STOP_TIMEOUT.get()`), never with `os.environ` directly, and writes it into a child's
environment under `Setting.name`. The README's table of variables is generated from this module
(`python -m regent.settings` prints it; a test fails when the README differs).

Rules shared by every variable:

- Values are read when asked for (`get()`), so a test or a parent that sets a variable at runtime is seen;
  the few modules that read one once at import say so.
- Unset, empty or blank means the default, except where a variable lists "" among its "off" words.
- A value that does not parse raises `SettingError` (a ValueError) with one line naming the variable and
  the value, e.g. `REGENT_STOP_TIMEOUT='abc': not a number of seconds`.
- Booleans take 1/0, true/false, yes/no, on/off (any case).
- Aliases (TorchFT's and Monarch's names for the same knob) are read when Regent's own name is unset.
- "Internal" variables are set by Regent for its own child processes; they are listed for completeness,
  not to be set by hand.

Kept free of heavy imports: a spawned proc imports this before anything else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TYPES = ("str", "int", "float", "seconds", "bool", "path")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class SettingError(ValueError):
    """An environment variable holds a value its declaration does not accept."""


@dataclass(frozen=True)
class Setting:
    """One environment variable.

    name: the variable. type: one of TYPES ("seconds" is a float of seconds; "path" has `~` expanded).
    default: the value when unset. meaning: one line for the README. internal: set by Regent for its own
    child processes, not by users. aliases: other names read, in order, when `name` is unset. choices: the
    accepted values of a "str" (compared lowercased). off: words (lowercased, "" allowed) that make `get()`
    return None. positive: numbers must be > 0. hint: appended to error messages. default_text: how the
    README shows a default that is computed rather than stored here."""

    name: str
    type: str
    default: Any
    meaning: str
    internal: bool = False
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    off: tuple[str, ...] = ()
    positive: bool = False
    hint: str = ""
    default_text: str | None = None

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise TypeError(f"{self.name}: type {self.type!r} is not one of {', '.join(TYPES)}")

    # -- reading ----------------------------------------------------------------------------------------
    def source(self, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
        """(variable, text) of the first of `name` and its aliases that is set; None when none is. Empty or
        blank text counts as unset unless "" is one of the `off` words."""
        env = os.environ if environ is None else environ
        for var in (self.name, *self.aliases):
            text = env.get(var)
            if text is None or (not text.strip() and "" not in self.off):
                continue
            return var, text
        return None

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The text as set (see `source`), unparsed; None when unset."""
        found = self.source(environ)
        return None if found is None else found[1]

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        return self.source(environ) is not None

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The parsed value (`os.environ` unless `environ` is given); the default when unset; None for an
        `off` word; `SettingError` for a value that does not parse."""
        found = self.source(environ)
        if found is None:
            return self.default
        return self.parse(found[1], found[0])

    def require(self, environ: Mapping[str, str] | None = None) -> Any:
        """Like `get`, but a variable that is unset is an error (for internal variables a parent must set)."""
        found = self.source(environ)
        if found is None:
            raise SettingError(f"{self.name} is not set{self._hint()}")
        return self.parse(found[1], found[0])

    def take(self) -> Any:
        """`require`, then remove the variable from this process's environment (so its children do not
        inherit it)."""
        value = self.require()
        for var in (self.name, *self.aliases):
            os.environ.pop(var, None)
        return value

    # -- parsing ----------------------------------------------------------------------------------------
    def parse(self, text: str, var: str | None = None) -> Any:
        var = var or self.name
        word = text.strip()
        if word.lower() in self.off:
            return None
        if self.type == "bool":
            if word.lower() in TRUE_WORDS:
                return True
            if word.lower() in FALSE_WORDS:
                return False
            raise self._error(var, text, "not a boolean (1/0, true/false, yes/no, on/off)")
        if self.type == "int":
            try:
                value: Any = int(word)
            except ValueError:
                raise self._error(var, text, "not an integer") from None
        elif self.type in ("float", "seconds"):
            try:
                value = float(word)
            except ValueError:
                what = "not a number of seconds" if self.type == "seconds" else "not a number"
                raise self._error(var, text, what) from None
        elif self.type == "path":
            return os.path.expanduser(word)
        else:
            if self.choices:
                if word.lower() not in self.choices:
                    raise self._error(var, text, f"use one of {', '.join(self.choices)}")
                return word.lower()
            return text
        if self.positive and value <= 0:
            raise self._error(var, text, "must be > 0" + (" seconds" if self.type == "seconds" else ""))
        return value

    def _error(self, var: str, text: str, problem: str) -> SettingError:
        return SettingError(f"{var}={text!r}: {problem}{self._hint()}")

    def _hint(self) -> str:
        return f"; {self.hint}" if self.hint else ""

    # -- documentation ----------------------------------------------------------------------------------
    def type_text(self) -> str:
        if self.choices:
            return "/".join(self.choices)
        return self.type

    def default_doc(self) -> str:
        if self.default_text is not None:
            return self.default_text
        if self.default is None:
            return "unset"
        if self.type == "bool":
            return "1" if self.default else "0"
        if self.type == "int" and self.default >= 1024**2 and self.default % 1024**2 == 0:
            gib = self.default / 1024**3
            return f"{self.default} ({gib:g} GiB)" if gib == int(gib) else str(self.default)
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)


ALL: dict[str, Setting] = {}


def _declare(name: str, type: str, default: Any, meaning: str, **kw: Any) -> Setting:
    if name in ALL:
        raise ValueError(f"{name} is declared twice")
    ALL[name] = setting = Setting(name, type, default, meaning, **kw)
    return setting


def lookup(name: str) -> Setting:
    """The declaration of variable `name` (KeyError if Regent does not read it)."""
    return ALL[name]


# ---- the job secret and the control plane's security ------------------------------------------------------

REGENT_JOB_SECRET = _declare(
    "REGENT_JOB_SECRET", "str", None,
    "The job secret (hex) every connection between Regent processes must prove; `regent train` makes one "
    "when neither this nor REGENT_JOB_SECRET_FILE is set, and sets it for every process it starts.")
REGENT_JOB_SECRET_FILE = _declare(
    "REGENT_JOB_SECRET_FILE", "path", None,
    "A file (mode 0600) holding the job secret; read when REGENT_JOB_SECRET is unset.")
REGENT_USER_SECRET_FILE = _declare(
    "REGENT_USER_SECRET_FILE", "path", None,
    "This user's default job secret (made 0600 on first use; refused if others can read it): what a "
    "`regent.actor` client and a `regent worker` use when no job secret is given (0/off/none: a client makes "
    "up its own and a worker refuses to start).",
    off=("0", "off", "none"), default_text="$XDG_CONFIG_HOME/regent/job-secret (~/.config/regent/job-secret)")
REGENT_FT_RPC_AUTH = _declare(
    "REGENT_FT_RPC_AUTH", "bool", True,
    "0: the Lighthouse and Managers do not require the job secret on gRPC calls (`--ft.rpc-auth false`).")
REGENT_FT_TLS_CERT = _declare(
    "REGENT_FT_TLS_CERT", "path", None,
    "PEM certificate: the control plane (gRPC, dashboard) serves TLS (`--ft.tls-cert`).")
REGENT_FT_TLS_KEY = _declare(
    "REGENT_FT_TLS_KEY", "path", None, "PEM private key of REGENT_FT_TLS_CERT (`--ft.tls-key`).")
REGENT_FT_TLS_CA = _declare(
    "REGENT_FT_TLS_CA", "path", None,
    "PEM CA bundle: clients verify servers with it, and servers require client certificates (mutual TLS).")
REGENT_FT_TLS_SERVER_NAME = _declare(
    "REGENT_FT_TLS_SERVER_NAME", "str", None,
    "The name clients expect in server certificates (one certificate for every host).")

# ---- regent.ft: Lighthouse, Manager, process groups -------------------------------------------------------

REGENT_FT_LIGHTHOUSE = _declare(
    "REGENT_FT_LIGHTHOUSE", "str", None,
    "The Lighthouse address a `regent.ft.Manager` joins when `lighthouse_addr=` is not given.",
    aliases=("TORCHFT_LIGHTHOUSE",))
REGENT_FT_HOSTNAME = _declare(
    "REGENT_FT_HOSTNAME", "str", "127.0.0.1",
    "The address a Manager advertises to its peers (set it to the host's cluster address across hosts).")
REGENT_FT_REPLICA_ID = _declare(
    "REGENT_FT_REPLICA_ID", "str", "replica",
    "A Manager's replica group name when `replica_id=` is not given.")
REGENT_FT_TIMEOUT_SEC = _declare(
    "REGENT_FT_TIMEOUT_SEC", "seconds", None,
    "Overrides the Manager's `timeout` (collectives, state transfer; `--ft.timeout-s`).",
    aliases=("TORCHFT_TIMEOUT_SEC",), positive=True, default_text="the argument")
REGENT_FT_QUORUM_TIMEOUT_SEC = _declare(
    "REGENT_FT_QUORUM_TIMEOUT_SEC", "seconds", None,
    "Overrides the Manager's `quorum_timeout` (`--ft.quorum-timeout-s`).",
    aliases=("TORCHFT_QUORUM_TIMEOUT_SEC",), positive=True, default_text="the argument")
REGENT_FT_CONNECT_TIMEOUT_SEC = _declare(
    "REGENT_FT_CONNECT_TIMEOUT_SEC", "seconds", None,
    "Overrides the Manager's `connect_timeout` (`--ft.connect-timeout-s`).",
    aliases=("TORCHFT_CONNECT_TIMEOUT_SEC",), positive=True, default_text="the argument")
REGENT_LIGHTHOUSE_FRONTENDS = _declare(
    "REGENT_LIGHTHOUSE_FRONTENDS", "int", 0,
    "Front-end processes a lite Lighthouse serves gRPC from when `frontends=` is not given (0: its own).")
REGENT_COMPACT_QUORUM = _declare(
    "REGENT_COMPACT_QUORUM", "str", "auto",
    "Ask the Lighthouse for compact quorum answers: auto (once a quorum is large), 1 (always), 0 (never).",
    choices=("auto", "1", "0"))
REGENT_P2P_WINDOW = _declare(
    "REGENT_P2P_WINDOW", "int", 64,
    "Point-to-point messages per coalesced NCCL batch (read at import).", positive=True)
REGENT_P2P_COALESCE = _declare(
    "REGENT_P2P_COALESCE", "bool", True,
    "0: do not coalesce batched point-to-point messages on NCCL (for comparison, or a misbehaving build).")
REGENT_DIGEST_TORCH = _declare(
    "REGENT_DIGEST_TORCH", "bool", False,
    "1: compute state digests with plain torch instead of the Triton kernel on CUDA.")
TORCHFT_USE_BUCKETIZATION = _declare(
    "TORCHFT_USE_BUCKETIZATION", "bool", False,
    "TorchFT's switch, honoured the same way: 1 makes DiLoCo use bucketization.")

# ---- regent.actor: the actor runtime --------------------------------------------------------------------

REGENT_LOG_LEVEL = _declare(
    "REGENT_LOG_LEVEL", "str", "WARNING",
    "Python log level of spawned procs and `regent worker` (DEBUG, INFO, WARNING, ...).")
REGENT_LISTEN_HOST = _declare(
    "REGENT_LISTEN_HOST", "str", "127.0.0.1",
    "The address the actor runtime listens on (a host's cluster address, or 0.0.0.0, across hosts).")
REGENT_ORPHAN_TIMEOUT = _declare(
    "REGENT_ORPHAN_TIMEOUT", "seconds", 60.0,
    "A proc whose owner is unreachable this long exits by itself (none/off/inf: never).",
    off=("none", "off", "inf"))
REGENT_MAX_FRAME_BYTES = _declare(
    "REGENT_MAX_FRAME_BYTES", "int", 10 * 1024**3,
    "Largest message frame accepted; larger ones are refused with an error (set it on every process).")
REGENT_CLEANUP_TIMEOUT = _declare(
    "REGENT_CLEANUP_TIMEOUT", "seconds", 3.0,
    "How long an actor's `__cleanup__` may run when it stops (0/none: the default).",
    off=("none", "off", "inf"))
REGENT_STOP_TIMEOUT = _declare(
    "REGENT_STOP_TIMEOUT", "seconds", 10.0,
    "How long a stopping proc may take before it is killed (0/none: the default).",
    off=("none", "off", "inf"))
REGENT_SPAWN_TIMEOUT = _declare(
    "REGENT_SPAWN_TIMEOUT", "seconds", 60.0,
    "How long a new proc may take to start and connect back (0/none: the default).",
    off=("none", "off", "inf"))
REGENT_ATTACH_TIMEOUT = _declare(
    "REGENT_ATTACH_TIMEOUT", "seconds", 10.0,
    "How long `attach_to_workers` keeps dialling a worker that refuses connections (0/none: the default).",
    off=("none", "off", "inf"))
REGENT_PEER_TIMEOUT = _declare(
    "REGENT_PEER_TIMEOUT", "seconds", 60.0,
    "A connection whose peer's kernel is silent this long is closed (TCP keepalive and user timeout; "
    "empty/0/none/off: the kernel's defaults; read at import).",
    off=("", "0", "none", "off"))
REGENT_PREFIX_OUTPUT = _declare(
    "REGENT_PREFIX_OUTPUT", "bool", True, "0: do not prefix forwarded proc output with the proc's rank.")
REGENT_SHARED_ASYNCIO_RUNTIME = _declare(
    "REGENT_SHARED_ASYNCIO_RUNTIME", "bool", False,
    "1: a process's sync actors share one thread instead of one each (Monarch's `shared_asyncio_runtime`).",
    aliases=("HYPERACTOR_SHARED_ASYNCIO_RUNTIME",))
REGENT_CAST = _declare(
    "REGENT_CAST", "str", "tree",
    "How a call to many actors is sent: tree (one message per host agent), proc (one per process), actor "
    "(one per actor, for comparison).",
    choices=("tree", "proc", "actor"))
REGENT_EXIT_WINDOW = _declare(
    "REGENT_EXIT_WINDOW", "seconds", 0.05,
    "How long supervision gathers proc exits into one report.")
REGENT_NO_UVLOOP = _declare(
    "REGENT_NO_UVLOOP", "bool", False, "1: use the default asyncio event loop even when uvloop is installed.")

# ---- training -------------------------------------------------------------------------------------------

REGENT_TOKEN_CACHE = _declare(
    "REGENT_TOKEN_CACHE", "path", None,
    "Where tokenized corpora are cached (empty/0/off/none: no cache).",
    off=("", "0", "off", "none"), default_text="$XDG_CACHE_HOME/regent/tokens (~/.cache/regent/tokens)")
REGENT_TORCH_THREADS = _declare(
    "REGENT_TORCH_THREADS", "int", 1, "torch's CPU threads in each `regent train` trainer.", positive=True)
REGENT_PEAK_FLOPS = _declare(
    "REGENT_PEAK_FLOPS", "float", None,
    "Peak dense bf16 FLOP/s of one device for MFU (e.g. 989e12), instead of the built-in table.",
    positive=True, hint="set it to the device's peak FLOP/s, e.g. 989e12", default_text="the table")
GPU_PLATFORM = _declare(
    "GPU_PLATFORM", "str", None,
    "Overrides platform detection: cuda, rocm, or cpu (no GPUs).",
    choices=("cuda", "rocm", "cpu"), hint="or unset it to auto-detect", default_text="detected")

# ---- internal: set by Regent for the processes it starts --------------------------------------------------

REGENT_JOB_SECRET_INHERITED_FILE = _declare(
    "REGENT_JOB_SECRET_INHERITED_FILE", "path", None,
    "A 0600 file holding the made-up job secret of the client that started this program (a `regent.actor` "
    "client only reads it).", internal=True)
REGENT_BOOT = _declare(
    "REGENT_BOOT", "str", None,
    "A spawned proc's boot record (JSON: id, parent address, sys.path, modules to preload).", internal=True)
REGENT_RUN_MARKER = _declare(
    "REGENT_RUN_MARKER", "str", None,
    "A run's marker, inherited by every process of the run (finds leftover processes).", internal=True)
REGENT_FT_STORE_PORT = _declare(
    "REGENT_FT_STORE_PORT", "int", None, "The port of a replica's group store, for its trainers.",
    internal=True)
REGENT_REPLICA = _declare(
    "REGENT_REPLICA", "int", None, "The replica index of a trainer process.", internal=True)
REGENT_GENERATION = _declare(
    "REGENT_GENERATION", "int", None, "The generation (restart count) of a trainer process.", internal=True)


# ---- documentation ----------------------------------------------------------------------------------------

def _row(s: Setting) -> str:
    names = f"`{s.name}`" + "".join(f" (or `{a}`)" for a in s.aliases)
    return f"| {names} | {s.type_text()} | {s.default_doc()} | {s.meaning.replace('|', '/')} |"


def markdown_table() -> str:
    """The README's list of variables (between its `settings` markers), generated from the declarations."""
    head = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    user = [_row(s) for s in ALL.values() if not s.internal]
    internal = [_row(s) for s in ALL.values() if s.internal]
    return "\n".join([*head, *user, "", "Set by Regent for the processes it starts (not to be set by hand):", "",
                      *head, *internal]) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
