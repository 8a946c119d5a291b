"""regent.settings: every environment variable declared once, parsed the same way, and documented in the README
from the declarations (issue 34)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

import regent
from regent import settings
from regent.settings import Setting, SettingError

SRC = Path(regent.__file__).resolve().parent
README = Path(__file__).resolve().parents[2] / "README.md"
# REGENT_-prefixed strings in src/regent that are not environment variables
NOT_VARIABLES = {"REGENT_WORKER_READY"}  # the line a worker prints once it listens (regent.jobs.base)


def sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "proto" not in p.parts)


# ---- parsing ----------------------------------------------------------------------------------------------

def test_unset_or_blank_gives_the_default():
    s = Setting("REGENT_X", "int", 5, "x")
    assert s.get({}) == 5 and s.get({"REGENT_X": ""}) == 5 and s.get({"REGENT_X": "  "}) == 5
    assert not s.is_set({"REGENT_X": ""}) and s.raw({"REGENT_X": ""}) is None
    assert s.get({"REGENT_X": " 7 "}) == 7 and s.is_set({"REGENT_X": "7"})


@pytest.mark.parametrize("text,value", [("1", True), ("true", True), ("YES", True), ("on", True),
                                        ("0", False), ("False", False), ("no", False), (" off ", False)])
def test_bool_words(text, value):
    assert Setting("REGENT_X", "bool", None, "x").get({"REGENT_X": text}) is value


@pytest.mark.parametrize("type_,text,message", [
    ("bool", "maybe", "REGENT_X='maybe': not a boolean (1/0, true/false, yes/no, on/off)"),
    ("int", "4.5", "REGENT_X='4.5': not an integer"),
    ("float", "fast", "REGENT_X='fast': not a number"),
    ("seconds", "abc", "REGENT_X='abc': not a number of seconds"),
])
def test_errors_name_the_variable_and_the_value(type_, text, message):
    with pytest.raises(SettingError) as err:
        Setting("REGENT_X", type_, None, "x").get({"REGENT_X": text})
    assert str(err.value) == message
    assert isinstance(err.value, ValueError)  # callers that caught ValueError still do


def test_the_brief_s_example_message(monkeypatch):
    monkeypatch.setenv("REGENT_STOP_TIMEOUT", "abc")
    with pytest.raises(SettingError, match=r"^REGENT_STOP_TIMEOUT='abc': not a number of seconds$"):
        settings.REGENT_STOP_TIMEOUT.get()


def test_positive_choices_hint_and_off_words():
    pos = Setting("REGENT_X", "seconds", None, "x", positive=True, hint="try 5")
    assert pos.get({"REGENT_X": "2.5"}) == 2.5
    with pytest.raises(SettingError, match=r"^REGENT_X='-1': must be > 0 seconds; try 5$"):
        pos.get({"REGENT_X": "-1"})
    choice = Setting("REGENT_X", "str", "a", "x", choices=("a", "b"))
    assert choice.get({"REGENT_X": " B "}) == "b" and choice.get({}) == "a"
    with pytest.raises(SettingError, match=r"^REGENT_X='c': use one of a, b$"):
        choice.get({"REGENT_X": "c"})
    off = Setting("REGENT_X", "seconds", 60.0, "x", off=("", "none"))
    assert off.get({}) == 60.0 and off.get({"REGENT_X": ""}) is None and off.get({"REGENT_X": "None"}) is None
    assert off.is_set({"REGENT_X": ""})


def test_aliases_are_read_when_regent_s_name_is_unset():
    s = Setting("REGENT_X", "seconds", None, "x", aliases=("TORCHFT_X",))
    assert s.get({"TORCHFT_X": "5"}) == 5 and s.get({"REGENT_X": "", "TORCHFT_X": "5"}) == 5
    assert s.get({"REGENT_X": "7", "TORCHFT_X": "5"}) == 7
    with pytest.raises(SettingError, match="^TORCHFT_X='x'"):  # the error names the variable actually read
        s.get({"TORCHFT_X": "x"})


def test_path_expands_the_home_directory():
    assert Setting("REGENT_X", "path", None, "x").get({"REGENT_X": "~/f"}) == os.path.expanduser("~/f")


def test_values_are_read_at_call_time(monkeypatch):
    monkeypatch.delenv("REGENT_EXIT_WINDOW", raising=False)
    assert settings.REGENT_EXIT_WINDOW.get() == 0.05
    monkeypatch.setenv("REGENT_EXIT_WINDOW", "0.3")
    assert settings.REGENT_EXIT_WINDOW.get() == 0.3


def test_require_and_take(monkeypatch):
    monkeypatch.delenv("REGENT_RUN_MARKER", raising=False)
    with pytest.raises(SettingError, match="REGENT_RUN_MARKER is not set"):
        settings.REGENT_RUN_MARKER.require()
    monkeypatch.setenv("REGENT_BOOT", '{"id": "x"}')
    assert settings.REGENT_BOOT.take() == '{"id": "x"}' and "REGENT_BOOT" not in os.environ


def test_declarations_are_well_formed():
    assert settings.ALL and len(settings.ALL) == len({s.name for s in settings.ALL.values()})
    for name, s in settings.ALL.items():
        assert s.name == name and getattr(settings, name) is s, name
        assert s.meaning and "\n" not in s.meaning and s.meaning.strip() == s.meaning, name
        if s.default is not None:  # a stored default is what its own text parses to
            text = ("1" if s.default else "0") if s.type == "bool" else str(s.default)
            assert s.parse(text) == s.default, name
    with pytest.raises(TypeError):
        Setting("REGENT_X", "list", None, "x")
    with pytest.raises(KeyError):
        settings.lookup("REGENT_NOT_A_THING")


# ---- the variables behave as before ----------------------------------------------------------------------

def test_runtime_config_defaults_are_the_declared_ones(monkeypatch):
    from regent.actor._config import RuntimeConfig

    for s in settings.ALL.values():
        for var in (s.name, *s.aliases):
            monkeypatch.delenv(var, raising=False)
    assert RuntimeConfig.from_env() == RuntimeConfig()
    monkeypatch.setenv("REGENT_ORPHAN_TIMEOUT", "none")
    monkeypatch.setenv("REGENT_STOP_TIMEOUT", "0")  # 0 or none: the default, these cannot be turned off
    monkeypatch.setenv("REGENT_SPAWN_TIMEOUT", "off")
    monkeypatch.setenv("REGENT_CLEANUP_TIMEOUT", "1.5")
    monkeypatch.setenv("REGENT_PREFIX_OUTPUT", "0")
    cfg = RuntimeConfig.from_env()
    assert cfg.orphan_timeout is None and cfg.stop_timeout == 10.0 and cfg.spawn_timeout == 60.0
    assert cfg.cleanup_timeout == 1.5 and cfg.prefix_output is False
    for name, text in cfg.child_env().items():  # what a child reads back is what this process has
        monkeypatch.setenv(name, text)
    assert RuntimeConfig.from_env() == cfg


def test_peer_timeout_words():
    s = settings.REGENT_PEER_TIMEOUT
    assert s.get({}) == 60.0 and s.get({"REGENT_PEER_TIMEOUT": "3"}) == 3.0
    for text in ("", "0", "none", "OFF"):
        assert s.get({"REGENT_PEER_TIMEOUT": text}) is None


def test_token_cache(monkeypatch, tmp_path):
    from regent.train.data import token_cache_dir

    monkeypatch.setenv("REGENT_TOKEN_CACHE", str(tmp_path))
    assert token_cache_dir() == tmp_path
    for off in ("", "0", "off", "none"):
        monkeypatch.setenv("REGENT_TOKEN_CACHE", off)
        assert token_cache_dir() is None
    monkeypatch.delenv("REGENT_TOKEN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert token_cache_dir() == tmp_path / "regent" / "tokens"


def test_rpc_auth_and_tls_from_the_environment(monkeypatch, tmp_path):
    from regent.ft.rpc_security import Security, TLSFiles

    monkeypatch.setenv("REGENT_JOB_SECRET", "00ff")
    monkeypatch.delenv("REGENT_FT_RPC_AUTH", raising=False)
    for name in ("REGENT_FT_TLS_CERT", "REGENT_FT_TLS_KEY", "REGENT_FT_TLS_CA", "REGENT_FT_TLS_SERVER_NAME"):
        monkeypatch.delenv(name, raising=False)
    assert Security.resolve().secret == b"\x00\xff"
    monkeypatch.setenv("REGENT_FT_RPC_AUTH", "off")
    assert Security.resolve().secret is None
    assert TLSFiles.from_env({"REGENT_FT_TLS_CA": "/ca.pem", "REGENT_FT_TLS_CERT": ""}) == TLSFiles(ca="/ca.pem")


def test_ft_timeouts_keep_torchft_names():
    from regent.ft.config import env_timeout

    assert env_timeout("timeout", 60, {}) == 60.0
    assert env_timeout("quorum_timeout", 60, {"TORCHFT_QUORUM_TIMEOUT_SEC": "9"}) == 9.0
    with pytest.raises(ValueError, match=r"^REGENT_FT_TIMEOUT_SEC='0': must be > 0 seconds$"):
        env_timeout("timeout", 60, {"REGENT_FT_TIMEOUT_SEC": "0"})


# ---- the README lists them from the declarations -------------------------------------------------------

def test_readme_table_is_the_generated_one():
    text = README.read_text()
    match = re.search(r"<!-- settings:begin[^\n]*-->\n(.*?)<!-- settings:end -->", text, re.S)
    assert match, "README.md has no <!-- settings:begin --> ... <!-- settings:end --> section"
    assert match.group(1) == settings.markdown_table(), (
        "README.md's table of environment variables differs from regent/settings.py; paste the output of "
        "`python -m regent.settings` between its settings markers")


# ---- nothing reads a variable behind the declarations' back ----------------------------------------------

def _is_settings_name(node: ast.AST) -> bool:
    """`settings.X.name`."""
    return (isinstance(node, ast.Attribute) and node.attr == "name" and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "settings")


def _is_os_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os")


def name_constants(trees: list[ast.Module]) -> set[str]:
    """Module-level names bound to a variable's name (SECRET_ENV = "REGENT_JOB_SECRET" or = settings.X.name)."""
    names = set()
    for tree in trees:
        for node in tree.body:
            if isinstance(node, ast.Assign) and (
                    (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                     and node.value.value in settings.ALL) or _is_settings_name(node.value)):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def direct_reads(tree: ast.Module, constants: set[str]) -> list[int]:
    """Lines that read one of the declared variables from an environment mapping without its declaration:
    `environ.get(K)`, `environ[K]`, `K in environ`, `os.getenv(K)`, `os.environ.pop(K)`, where K is a literal
    variable name, a constant bound to one, or `settings.X.name`."""

    def is_key(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value.startswith("REGENT_") or node.value in settings.ALL
        if isinstance(node, ast.Name):
            return node.id in constants
        if isinstance(node, ast.Attribute):
            return node.attr in constants or _is_settings_name(node)
        return False

    def reads(node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            return is_key(node.args[0]) and (
                f.attr in ("get", "getenv") or (f.attr in ("pop", "setdefault") and _is_os_environ(f.value)))
        if isinstance(node, ast.Subscript):
            return isinstance(node.ctx, ast.Load) and is_key(node.slice)
        if isinstance(node, ast.Compare):
            return is_key(node.left) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
        return False

    return [node.lineno for node in ast.walk(tree) if reads(node)]


def test_the_checker_finds_direct_reads():
    code = '''
import os
SECRET_ENV = "REGENT_JOB_SECRET"
a = os.environ.get("REGENT_CAST", "tree")
b = os.environ["REGENT_FT_STORE_PORT"] if "REGENT_FT_STORE_PORT" in os.environ else None
c = env.get(SECRET_ENV)
d = os.getenv("GPU_PLATFORM")
e = os.environ.pop(settings.REGENT_BOOT.name)
child[settings.REGENT_BOOT.name] = "{}"
child.pop("REGENT_JOB_SECRET_FILE", None)
'''
    tree = ast.parse(code)
    assert sorted(set(direct_reads(tree, name_constants([tree])))) == [4, 5, 6, 7, 8]


def test_no_direct_reads_outside_settings():
    trees = {path: ast.parse(path.read_text(), str(path)) for path in sources()}
    constants = name_constants(list(trees.values()))
    assert {"SECRET_ENV", "SECRET_FILE_ENV", "RUN_MARKER_ENV"} <= constants  # the checker sees the aliases
    found = [f"{path.relative_to(SRC.parent)}:{line}" for path, tree in trees.items()
             if path.name != "settings.py" or path.parent != SRC for line in direct_reads(tree, constants)]
    assert not found, f"read these through regent.settings instead: {found}"


def test_every_regent_name_in_the_source_is_declared():
    undeclared = set()
    for path in sources():
        for name in re.findall(r"\bREGENT_[A-Z0-9_]*", path.read_text()):
            if name in NOT_VARIABLES or name in settings.ALL:
                continue
            if name.endswith("_") and any(n.startswith(name) for n in settings.ALL):
                continue  # a family, as in `REGENT_FT_TLS_*`
            undeclared.add(f"{name} ({path.relative_to(SRC.parent)})")
    assert not undeclared, f"declare these in regent/settings.py: {sorted(undeclared)}"
